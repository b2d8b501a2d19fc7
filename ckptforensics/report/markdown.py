"""report.md: the verdict on the first screen, details in <details> blocks below."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["render_markdown", "fmt", "md_table", "reproduces"]


def fmt(x: Any) -> str:
    """Numbers for people: 65,504 / 1.2e-03 / 3.4; None -> '—'."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x == 0:
            return "0"
        a = abs(x)
        if a >= 1e5 or a < 1e-2:
            return f"{x:.2e}"
        if float(x).is_integer() and a < 1e5:
            return f"{int(x):,}"
        return f"{x:.3g}"
    return str(x)


# How the verdict's replay check reads in a ticket.
_CHECK_WORDS = {
    "missed_first": "withheld: the replay does not reproduce the run's own log",
    "missed_later": "withheld: the replay leaves the run's own log before any spike",
    "unchecked": "inconclusive (no logged figure to check the replay against)",
}


def reproduces(v: dict[str, Any]) -> str:
    """The verdict's 'reproduces' cell: yes / no, or why there is no answer."""
    if v["reproducible"] is not None:
        return fmt(v["reproducible"])
    check = v.get("replay_check")
    if check is None:
        return "not replayed"
    return _CHECK_WORDS.get(check["status"], "inconclusive (the replay deviates from after: see replay.config)")


def _finite(x: Any) -> str:
    """A replayed figure; JSON carries inf/NaN as null, which here means 'not finite'."""
    return "not finite" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt(x)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def md_table(head: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines (cells escaped)."""
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


_table = md_table


def _config_lines(config: dict[str, Any]) -> list[str]:
    out = ["", "Configuration (value, source):", ""]
    for k, c in config.items():
        val = c["value"]
        if isinstance(val, dict) and len(val) > 4:
            val = f"{len(val)} steps"
        out.append(f"- {k}: {val} ({c['source']})")
    return out


def _check_table(check: dict[str, Any]) -> list[str]:
    rows = [[c["step"], fmt(c["loss"]), fmt(c["logged_loss"]), fmt(c["loss_ok"]), fmt(c["grad_norm"]), fmt(c["logged_grad_norm"]), fmt(c["grad_ok"])] for c in check.get("steps", [])]
    if not rows:
        return [f"No logged figure to compare ({check.get('note') or 'no log'})."]
    return _table(["step", "replayed loss", "logged loss", "match", "replayed grad norm", "logged grad norm", "match"], rows)


def render_markdown(doc: dict[str, Any]) -> str:
    if doc.get("audit"):
        from .audit import render_audit_markdown

        return render_audit_markdown(doc)
    v = doc["verdict"]
    inc = doc["incident"]
    b, a = inc["before"], inc["after"]
    top = v["causes"][0]
    lines = [
        f"# ckptforensics: {'what-if' if doc.get('whatif') else top['cause'].replace('_', ' ')}",
        "",
        f"**{v['summary']}**",
        "",
        f"- **Before**: `{b['path']}` (step {fmt(b['step'])}, {b['format']})",
    ]
    if doc.get("whatif") and not doc.get("replay"):
        # A what-if replays forward from *before*: there is no *after* and no diagnosis.
        w = doc["whatif"]
        lines.append(f"- **Replayed**: {len(w['outcomes'][0]['steps']) if w['outcomes'] else 0} steps per mitigation, {len(w['outcomes'])} runs")
    else:
        lines += [
            f"- **After**: `{a['path']}` (step {fmt(a['step'])}, {a['format']})",
            "- **Causes**: " + ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"]),
            f"- **Reproduces**: {reproduces(v)}",
            f"- **Rollback checkpoint**: {('`' + v['rollback_checkpoint'] + '`') if v['rollback_checkpoint'] else '—'}",
        ]
    if v.get("replay_check"):
        lines.append(f"- **Replay vs the run's log**: {v['replay_check']['reason']}")
    if v["exploding_layers"]:
        lines.append("- **Layers standing out**: " + ", ".join(f"`{m}`" for m in v["exploding_layers"][:5]))
    if v["first_bad_step"] is not None:
        lines.append(f"- **First bad step**: {fmt(v['first_bad_step'])}")
    if v["first_anomalous_module"]:
        lines.append(f"- **First anomalous module**: `{v['first_anomalous_module']}`")
    if v["corrupted_elements"]:
        lines += ["", "**Corrupted elements**", ""]
        lines += _table(
            ["tensor", "where", "index", "before", "after", "kind"],
            [[f"`{e['tensor']}`", e["where"], e["index"], fmt(e["before"]), fmt(e["after"]), e["kind"]] for e in v["corrupted_elements"][:10]],
        )
    if v["anomalous_samples"]:
        lines += ["", "**Anomalous samples**", ""]
        lines += _table(
            ["row", "sample id", "score", "why"],
            [[s["index"], fmt(s["sample_id"]), fmt(s["score"]), s["why"]] for s in v["anomalous_samples"][:16]],
        )
    if v["overflowing_tensors"]:
        lines += ["", "**Tensors at their dtype's limit**", ""]
        lines += _table(
            ["tensor", "where", "dtype", "max abs", "limit"],
            [[f"`{o['name']}`", o["where"], o["dtype"], fmt(o["max_abs"]), fmt(o["limit"])] for o in v["overflowing_tensors"][:10]],
        )
    if v["recommended_actions"]:
        lines += ["", "**Recommended actions**", ""]
        lines += [f"{i}. {act}" for i, act in enumerate(v["recommended_actions"], 1)]
    findings = doc.get("findings", [])
    lines += ["", f"<details><summary>Findings ({len(findings)})</summary>", ""]
    if findings:
        lines += _table(
            ["id", "severity", "kind", "subject", "score", "message"],
            [[f["id"], f["severity"], f["kind"], f"`{f['subject']}`", fmt(f["score"]), f["message"]] for f in findings],
        )
    else:
        lines.append("No findings.")
    lines += ["", "</details>"]
    diff = doc.get("diff") or {}
    if diff:
        p = diff["pair"]
        lines += ["", "<details><summary>Checkpoint pair</summary>", ""]
        lines += _table(
            ["", "before", "after"],
            [
                ["trainer step", fmt(p["step_a"]), fmt(p["step_b"])],
                ["optimizer step", fmt(p["adam_step_a"]), fmt(p["adam_step_b"])],
                ["loss scale", fmt(p["loss_scale_a"]), fmt(p["loss_scale_b"])],
                ["LR per group", ", ".join(fmt(x) for x in p["lr_a"]) or "—", ", ".join(fmt(x) for x in p["lr_b"]) or "—"],
            ],
        )
        lines += ["", f"Optimizer: {p['optimizer'] or 'none (weights only)'}; betas {p['betas'] or '—'}."]
        for n in p.get("notes") or []:
            lines.append(f"- {n}")
        lines += ["", "</details>", "", f"<details><summary>Per-tensor diff ({len(diff['tensors'])} tensors)</summary>", ""]
        rows = sorted(diff["tensors"], key=lambda t: -(t["update_ratio"] or 0))
        lines += _table(
            ["tensor", "dtype", "update/weight per step", "max abs Δ", "r_v", "sign-like share", "bound violations", "non-finite"],
            [
                [
                    f"`{t['name']}`",
                    t["dtype"],
                    fmt(t["update_ratio"]),
                    fmt(t["dw_max_abs"]),
                    fmt(t["r_v"]),
                    fmt(t["rho_share_b"]),
                    t["bound_violations"] + t["vfloor_violations"] + t["mbound_violations"] + t["outlier_changes"],
                    t["nonfinite_b"],
                ]
                for t in rows
            ],
        )
        lines += ["", "</details>"]
    rep = doc.get("replay") or {}
    if rep.get("withheld"):
        lines += ["", f"<details><summary>Replay (withheld, {rep['precision']})</summary>", "", rep["withheld"] + ".", ""]
        lines += _check_table(rep.get("check") or {})
        lines += _config_lines(rep["config"])
        lines += ["", "</details>"]
    elif rep:
        lines += ["", f"<details><summary>Replay ({len(rep['steps'])} steps, {rep['precision']})</summary>", ""]
        lines += _table(
            ["step", "loss", "logged loss", "grad norm", "skipped", "loss scale", "max abs logit", "log Z"],
            [
                [
                    r["step"],
                    fmt(r["loss"]),
                    fmt((rep["logged"].get(str(r["step"])) or {}).get("loss")),
                    fmt(r["grad_norm"]),
                    fmt(r["skipped"]),
                    fmt(r["loss_scale"]),
                    fmt(r["logit_absmax"]),
                    fmt(r["log_z"]),
                ]
                for r in rep["steps"]
            ],
        )
        att = rep.get("attention") or {}
        if att:
            steps = sorted(att, key=int)
            mods = att[steps[0]]["modules"]
            def peak(i: int) -> float:  # JSON null: a non-finite logit (an overflow upstream)
                return max((v for s in steps if i < len(att[s]["max_logit"]) and (v := att[s]["max_logit"][i]) is not None), default=0.0)

            top = sorted(range(len(mods)), key=lambda i: -peak(i))[:6]
            top.sort()
            lines += ["", "Largest pre-softmax attention logit per layer (entropy of its most collapsed head, of uniform):", ""]
            lines += _table(
                ["step", *[f"`{mods[i]}`" for i in top]],
                [[s, *[f"{fmt(att[s]['max_logit'][i])} ({fmt(att[s]['entropy'][i])})" for i in top]] for s in steps],
            )
        lines += _config_lines(rep["config"])
        check = rep.get("check") or {}
        if check.get("checked_steps"):
            t = check["tolerance"]
            lines += ["", f"Checked against the run's log on {len(check['checked_steps'])} steps (its loss read as {check['loss_as']}; "
                      f"tolerance {t['loss_rtol']:g} relative on the loss, {t['grad_rtol']:g} on the grad norm)."]  # fmt: skip
        if check.get("note"):
            lines += ["", f"Log check: {check['note']}."]
        r = rep.get("reproduction")
        if r:
            lines += ["", f"Reproduction against after: {r['mismatched']:,} of {r['elements']:,} elements outside tolerance, {r['impossible']:,} beyond any Adam step."]
        lines += ["", "</details>"]
    bis = doc.get("bisect") or {}
    if bis:
        lines += ["", "**Bisection**", ""]
        lines.append(f"- first bad step: {fmt(bis['first_bad_step'])}; culprit rows: {bis['rows'] or '—'} (sample ids {bis['sample_ids'] or '—'})")
        lines.append(f"- minimal set whose removal removes the spike: {bis['minimal_rows'] or '—'}; alone with healthy rows it {'spikes' if bis['presence_spikes'] else 'does not spike' if bis['presence_spikes'] is False else '—'}")
        lines.append(f"- evaluations: {bis['replays']} (budget {bis['budget']})" + (f"; {bis['note']}" if bis.get("note") else ""))
        if bis.get("texts"):
            lines += ["", "Culprit rows, decoded:", ""]
            lines += _table(["row", "text (first 256 tokens)"], [[r, "`" + t.replace("`", "'").replace("\n", " ")[:300] + "`"] for r, t in bis["texts"].items()])
            lines.append("")
        if bis["disagreements"]:
            lines.append(f"- replayed loss differs from the training log at steps {[d['step'] for d in bis['disagreements']]}")
        if bis["trials"]:
            lines += ["", "<details><summary>Bisection trials</summary>", ""]
            lines += _table(["trial", "loss", "grad norm", "robust z", "spikes"], [[t["label"], fmt(t["loss"]), fmt(t["grad_norm"]), fmt(t["robust_z"]), fmt(t["spiked"])] for t in bis["trials"]])
            lines += ["", "</details>"]
    wi = doc.get("whatif") or {}
    if wi:
        lines += ["", "**What-if**", ""]
        lines += _table(
            ["mitigation", "on track", "max loss", "max grad norm", "final loss", "overflow-skipped steps"],
            [
                [o["mitigation"], fmt(o["on_track"]), _finite(o["max_loss"]), _finite(o["max_grad_norm"]), _finite(o["final_loss"]), ", ".join(map(str, o["skipped_updates"])) or "none"]
                for o in wi["outcomes"]
            ],
        )
        lines += ["", f"Band: loss ≤ {fmt(wi['level'])} + {fmt(wi['band'])}, grad norm ≤ {fmt(wi['grad_norm_level'])} + {fmt(wi['grad_norm_band'])} ({wi['source']})."]
    lines += ["", f"<sub>{inc['command']} · ckptforensics {inc['tool_version']} · schema {doc['schema']}</sub>", ""]
    return "\n".join(lines)
