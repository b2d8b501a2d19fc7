"""report.md: the verdict on the first screen, details in <details> blocks below.

Over 400 lines: one renderer per report kind over shared formatting helpers (`html` reuses
them); split, the helpers would scatter across files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["render_markdown", "fmt", "md_table", "reproduces", "plan_lines", "recovery_lines"]


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
    return _CHECK_WORDS.get(
        check["status"], "inconclusive (the replay deviates from after: see replay.config)"
    )


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
    rows = [
        [
            c["step"],
            fmt(c["loss"]),
            fmt(c["logged_loss"]),
            fmt(c["loss_ok"]),
            fmt(c["grad_norm"]),
            fmt(c["logged_grad_norm"]),
            fmt(c["grad_ok"]),
        ]
        for c in check.get("steps", [])
    ]
    if not rows:
        return [f"No logged figure to compare ({check.get('note') or 'no log'})."]
    return _table(
        [
            "step",
            "replayed loss",
            "logged loss",
            "match",
            "replayed grad norm",
            "logged grad norm",
            "match",
        ],
        rows,
    )


_STATUS_WORDS = {
    "verified": "verified by what-if",
    "not_replayed": "not replayed",
    "refuted": "refuted by what-if",
}


def _evidence_text(c: dict[str, Any]) -> str:
    ev = c.get("evidence")
    if not ev:
        return _STATUS_WORDS[c["status"]]
    if ev["source"] == "bisect":
        return (
            f"verified by bisect (step {ev.get('step')}: the spike goes with rows {ev.get('rows')})"
        )
    steps = ev.get("steps") or []
    span = f" over steps {steps[0]}-{steps[-1]}" if steps else ""
    return (
        f"{_STATUS_WORDS[c['status']]} ({ev['mitigation']}{span}: max loss {_finite(ev.get('max_loss'))} vs {_finite(ev.get('baseline_max_loss'))} "
        f"without it, max grad norm {_finite(ev.get('max_grad_norm'))} vs {_finite(ev.get('baseline_max_grad_norm'))})"
    )


def plan_lines(p: dict[str, Any], run_dir: str | None = None) -> list[str]:
    """The resume plan as a ticket reads it: rollback, skip, changes with their evidence, the
    diff of the run's own settings, the resume keys and the recovery command."""
    if not p:
        return []
    if p["status"] != "ready":
        return [
            f"No resume plan ({p['status'].replace('_', ' ')}): "
            + "; ".join(p.get("notes") or [])
            + "."
        ]
    r = p["rollback"]
    lines = [
        f"Trainer: {p['trainer_title']}"
        + (
            f" (settings read from `{p['settings']}`)"
            if p.get("settings")
            else " (its settings are not in the checkpoint)"
        ),
        "",
    ]
    lines.append(f"1. **Roll back to** `{r['path']}` (step {r['step']}): {r['why']}.")
    for note in r.get("skipped") or []:
        lines.append(f"   - passed over: {note}")
    k = 2
    sk = p.get("skip")
    if sk:
        what = (
            f"samples {sorted(sk['sample_ids'])}"
            if sk["sample_ids"]
            else f"the batch of step{'s' if len(sk['steps']) > 1 else ''} {', '.join(map(str, sk['steps']))}"
        )
        lines += [f"{k}. **Skip** {what} ({sk['format']}):", "", "```", sk["text"], "```"]
        k += 1
    for c in p["changes"]:
        if c["knob"] in ("skip_samples", "skip_step"):
            lines.append(f"   - {c['knob']}: {_evidence_text(c)}")
            continue
        keys = (
            ", ".join(f"`{e['key']}` {fmt(e['before'])} → {fmt(e['after'])}" for e in c["edits"])
            or f"{c['knob']}={c['value']}"
        )
        lines.append(f"{k}. **Change** {keys}: {c['why']}; {_evidence_text(c)}.")
        for e in c["edits"]:
            if e["note"]:
                lines.append(f"   - {e['note']}")
        k += 1
    if p.get("config_diff"):
        lines += ["", "```diff", p["config_diff"], "```"]
    if p.get("resume"):
        lines += [
            "",
            f"{k}. **Resume**: "
            + "; ".join(
                f"`{e['key']}` = `{e['after']}`" + (f" ({e['note']})" if e["note"] else "")
                for e in p["resume"]
            )
            + ".",
        ]
    rd = run_dir or str(Path(r["path"]).parent)
    lines += [
        "",
        f"Then, once the resumed run has trained a while: `ckptforensics recovery --run-dir {rd} --resumed-from {r['step']} --plan PLAN_DIR` (this report's directory)",
    ]
    for alt in p.get("alternatives") or []:
        lines.append(
            f"- also replayed: {alt['mitigation']} ({'on track' if alt['on_track'] else 'leaves the track'}, max loss {_finite(alt.get('max_loss'))})"
        )
    lines += [f"- {n}" for n in p.get("notes") or []]
    return lines


def recovery_lines(r: dict[str, Any]) -> list[str]:
    """The recovery section: the checks, the windows against the trajectory, the legs read."""
    lines = ["**Checks that the resume was the plan**", ""]
    lines += _table(
        ["check", "status", "expected", "observed", "what it says"],
        [
            [
                c["name"],
                c["status"],
                fmt(c["expected"]) if not isinstance(c["expected"], list) else c["expected"],
                fmt(c["observed"]) if not isinstance(c["observed"], list) else c["observed"],
                c["message"],
            ]
            for c in r["checks"]
        ],
    )
    t = r["trajectory"]["loss"]
    lines += [
        "",
        f"**Against the pre-incident trajectory** (fitted on steps {t['fitted_on'][0]}-{t['fitted_on'][1]}: loss ∝ step^{t['slope']:.3g}, noise {t['sigma']:.3g} log10; "
        f"a window is on it within {r['trajectory']['band_z']:g} standard errors)",
        "",
    ]
    lines += _table(
        ["steps", "loss", "trajectory", "ratio", "z", "grad norm", "its level", "ratio", "z", "onsets", "on trajectory"],
        [[f"{w['first']}-{w['last']}", _finite(w["loss"]), fmt(w["expected_loss"]), _finite(w["ratio"]), _finite(w["z"]), _finite(w["grad_norm"]), fmt(w["grad_level"]),
          _finite(w["grad_ratio"]), _finite(w["grad_z"]), ", ".join(map(str, w["onsets"])) or "—", fmt(w["in_band"])] for w in r["windows"]],
    )  # fmt: skip
    if r.get("gap_trend") and "slope_per_100_steps" in r["gap_trend"]:
        g = r["gap_trend"]
        lines += [
            "",
            f"Gap to the trajectory: {g['slope_per_100_steps']:+.3g} log10 per 100 steps, now {g['gap_now']:.3g}x"
            + (f", back around step {g['projected_step']}" if g.get("projected_step") else "")
            + ".",
        ]
    lines += [
        "",
        "Legs read: "
        + "; ".join(f"`{leg['source']}` steps {leg['first']}-{leg['last']}" for leg in r["legs"])
        + f" (resumed leg: `{r['log']}`).",
    ]
    if r.get("plan"):
        lines.append(f"Plan: `{r['plan']}`.")
    return lines


def _render_recovery(doc: dict[str, Any]) -> str:
    r, v, inc = doc["recovery"], doc["verdict"], doc["incident"]
    head = r["status"] + (
        f" at step {r['step']}" if r["step"] is not None and r["status"] != "recovering" else ""
    )
    lines = [f"# ckptforensics: recovery — {head}", "", f"**{v['summary']}**", ""]
    lines.append(f"- **Resumed from**: `{inc['before']['path']}` (step {fmt(r['resumed_from'])})")
    if r.get("checkpoint_after"):
        lines.append(f"- **First checkpoint after the resume**: `{r['checkpoint_after']}`")
    if r.get("onset") is not None:
        lines.append(f"- **Incident onset**: step {r['onset']}")
    if v["recommended_actions"]:
        lines += ["", "**Next**", ""] + [
            f"{i}. {a}" for i, a in enumerate(v["recommended_actions"], 1)
        ]
    lines += ["", *recovery_lines(r)]
    lines += [
        "",
        f"<sub>{inc['command']} · ckptforensics {inc['tool_version']} · schema {doc['schema']}</sub>",
        "",
    ]
    return "\n".join(lines)


def render_markdown(doc: dict[str, Any]) -> str:
    if doc.get("recovery"):
        return _render_recovery(doc)
    if doc.get("audit"):
        from ckptforensics.report.audit import render_audit_markdown

        return render_audit_markdown(doc)
    v = doc["verdict"]
    inc = doc["incident"]
    b, a = inc["before"], inc["after"]
    top = v["causes"][0]
    planned = bool(doc.get("whatif") and doc.get("replay"))  # the `plan` command's report
    title = (
        f"plan — {top['cause'].replace('_', ' ')}"
        if planned
        else ("what-if" if doc.get("whatif") else top["cause"].replace("_", " "))
    )
    lines = [
        f"# ckptforensics: {title}",
        "",
        f"**{v['summary']}**",
        "",
        f"- **Before**: `{b['path']}` (step {fmt(b['step'])}, {b['format']})",
    ]
    if doc.get("whatif") and not doc.get("replay"):
        # A what-if replays forward from *before*: there is no *after* and no diagnosis.
        w = doc["whatif"]
        lines.append(
            f"- **Replayed**: {len(w['outcomes'][0]['steps']) if w['outcomes'] else 0} steps per mitigation, {len(w['outcomes'])} runs"
        )
    else:
        lines += [
            f"- **After**: `{a['path']}` (step {fmt(a['step'])}, {a['format']})",
            "- **Causes**: "
            + ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"]),
            f"- **Reproduces**: {reproduces(v)}",
            f"- **Rollback checkpoint**: {('`' + v['rollback_checkpoint'] + '`') if v['rollback_checkpoint'] else '—'}",
        ]
    if v.get("replay_check"):
        lines.append(f"- **Replay vs the run's log**: {v['replay_check']['reason']}")
    if v["exploding_layers"]:
        lines.append(
            "- **Layers standing out**: " + ", ".join(f"`{m}`" for m in v["exploding_layers"][:5])
        )
    if v["first_bad_step"] is not None:
        lines.append(f"- **First bad step**: {fmt(v['first_bad_step'])}")
    if v["first_anomalous_module"]:
        lines.append(f"- **First anomalous module**: `{v['first_anomalous_module']}`")
    if v["corrupted_elements"]:
        lines += ["", "**Corrupted elements**", ""]
        lines += _table(
            ["tensor", "where", "index", "before", "after", "kind"],
            [
                [
                    f"`{e['tensor']}`",
                    e["where"],
                    e["index"],
                    fmt(e["before"]),
                    fmt(e["after"]),
                    e["kind"],
                ]
                for e in v["corrupted_elements"][:10]
            ],
        )
    if v["anomalous_samples"]:
        lines += ["", "**Anomalous samples**", ""]
        lines += _table(
            ["row", "sample id", "score", "why"],
            [
                [s["index"], fmt(s["sample_id"]), fmt(s["score"]), s["why"]]
                for s in v["anomalous_samples"][:16]
            ],
        )
    if v["overflowing_tensors"]:
        lines += ["", "**Tensors at their dtype's limit**", ""]
        lines += _table(
            ["tensor", "where", "dtype", "max abs", "limit"],
            [
                [f"`{o['name']}`", o["where"], o["dtype"], fmt(o["max_abs"]), fmt(o["limit"])]
                for o in v["overflowing_tensors"][:10]
            ],
        )
    if v["recommended_actions"]:
        lines += ["", "**Recommended actions**", ""]
        lines += [f"{i}. {act}" for i, act in enumerate(v["recommended_actions"], 1)]
    p = doc.get("plan") or {}
    if p.get("status") == "ready":
        lines += ["", "**Resume plan**", "", *plan_lines(p)]
    findings = doc.get("findings", [])
    lines += ["", f"<details><summary>Findings ({len(findings)})</summary>", ""]
    if findings:
        lines += _table(
            ["id", "severity", "kind", "subject", "score", "message"],
            [
                [
                    f["id"],
                    f["severity"],
                    f["kind"],
                    f"`{f['subject']}`",
                    fmt(f["score"]),
                    f["message"],
                ]
                for f in findings
            ],
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
                [
                    "LR per group",
                    ", ".join(fmt(x) for x in p["lr_a"]) or "—",
                    ", ".join(fmt(x) for x in p["lr_b"]) or "—",
                ],
            ],
        )
        lines += [
            "",
            f"Optimizer: {p['optimizer'] or 'none (weights only)'}; betas {p['betas'] or '—'}.",
        ]
        for n in p.get("notes") or []:
            lines.append(f"- {n}")
        lines += [
            "",
            "</details>",
            "",
            f"<details><summary>Per-tensor diff ({len(diff['tensors'])} tensors)</summary>",
            "",
        ]
        rows = sorted(diff["tensors"], key=lambda t: -(t["update_ratio"] or 0))
        lines += _table(
            [
                "tensor",
                "dtype",
                "update/weight per step",
                "max abs Δ",
                "r_v",
                "sign-like share",
                "bound violations",
                "non-finite",
            ],
            [
                [
                    f"`{t['name']}`",
                    t["dtype"],
                    fmt(t["update_ratio"]),
                    fmt(t["dw_max_abs"]),
                    fmt(t["r_v"]),
                    fmt(t["rho_share_b"]),
                    t["bound_violations"]
                    + t["vfloor_violations"]
                    + t["mbound_violations"]
                    + t["outlier_changes"],
                    t["nonfinite_b"],
                ]
                for t in rows
            ],
        )
        lines += ["", "</details>"]
    rep = doc.get("replay") or {}
    if rep.get("withheld"):
        lines += [
            "",
            f"<details><summary>Replay (withheld, {rep['precision']})</summary>",
            "",
            rep["withheld"] + ".",
            "",
        ]
        lines += _check_table(rep.get("check") or {})
        lines += _config_lines(rep["config"])
        lines += ["", "</details>"]
    elif rep:
        lines += [
            "",
            f"<details><summary>Replay ({len(rep['steps'])} steps, {rep['precision']})</summary>",
            "",
        ]
        lines += _table(
            [
                "step",
                "loss",
                "logged loss",
                "grad norm",
                "skipped",
                "loss scale",
                "max abs logit",
                "log Z",
            ],
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
                return max(
                    (
                        v
                        for s in steps
                        if i < len(att[s]["max_logit"])
                        and (v := att[s]["max_logit"][i]) is not None
                    ),
                    default=0.0,
                )

            top = sorted(range(len(mods)), key=lambda i: -peak(i))[:6]
            top.sort()
            lines += [
                "",
                "Largest pre-softmax attention logit per layer (entropy of its most collapsed head, of uniform):",
                "",
            ]
            lines += _table(
                ["step", *[f"`{mods[i]}`" for i in top]],
                [
                    [
                        s,
                        *[
                            f"{fmt(att[s]['max_logit'][i])} ({fmt(att[s]['entropy'][i])})"
                            for i in top
                        ],
                    ]
                    for s in steps
                ],
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
            lines += [
                "",
                f"Reproduction against after: {r['mismatched']:,} of {r['elements']:,} elements outside tolerance, {r['impossible']:,} beyond any Adam step.",
            ]
        lines += ["", "</details>"]
    bis = doc.get("bisect") or {}
    if bis:
        lines += ["", "**Bisection**", ""]
        lines.append(
            f"- first bad step: {fmt(bis['first_bad_step'])}; culprit rows: {bis['rows'] or '—'} (sample ids {bis['sample_ids'] or '—'})"
        )
        lines.append(
            f"- minimal set whose removal removes the spike: {bis['minimal_rows'] or '—'}; alone with healthy rows it {'spikes' if bis['presence_spikes'] else 'does not spike' if bis['presence_spikes'] is False else '—'}"
        )
        lines.append(
            f"- evaluations: {bis['replays']} (budget {bis['budget']})"
            + (f"; {bis['note']}" if bis.get("note") else "")
        )
        if bis.get("texts"):
            lines += ["", "Culprit rows, decoded:", ""]
            lines += _table(
                ["row", "text (first 256 tokens)"],
                [
                    [r, "`" + t.replace("`", "'").replace("\n", " ")[:300] + "`"]
                    for r, t in bis["texts"].items()
                ],
            )
            lines.append("")
        if bis["disagreements"]:
            lines.append(
                f"- replayed loss differs from the training log at steps {[d['step'] for d in bis['disagreements']]}"
            )
        if bis["trials"]:
            lines += ["", "<details><summary>Bisection trials</summary>", ""]
            lines += _table(
                ["trial", "loss", "grad norm", "robust z", "spikes"],
                [
                    [
                        t["label"],
                        fmt(t["loss"]),
                        fmt(t["grad_norm"]),
                        fmt(t["robust_z"]),
                        fmt(t["spiked"]),
                    ]
                    for t in bis["trials"]
                ],
            )
            lines += ["", "</details>"]
    wi = doc.get("whatif") or {}
    if wi:
        lines += ["", "**What-if**", ""]
        lines += _table(
            [
                "mitigation",
                "on track",
                "max loss",
                "max grad norm",
                "final loss",
                "overflow-skipped steps",
            ],
            [
                [
                    o["mitigation"],
                    fmt(o["on_track"]),
                    _finite(o["max_loss"]),
                    _finite(o["max_grad_norm"]),
                    _finite(o["final_loss"]),
                    ", ".join(map(str, o["skipped_updates"])) or "none",
                ]
                for o in wi["outcomes"]
            ],
        )
        lines += [
            "",
            f"Band: loss ≤ {fmt(wi['level'])} + {fmt(wi['band'])}, grad norm ≤ {fmt(wi['grad_norm_level'])} + {fmt(wi['grad_norm_band'])} ({wi['source']}).",
        ]
    lines += [
        "",
        f"<sub>{inc['command']} · ckptforensics {inc['tool_version']} · schema {doc['schema']}</sub>",
        "",
    ]
    return "\n".join(lines)
