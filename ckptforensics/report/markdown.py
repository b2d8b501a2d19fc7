"""report.md: the verdict on the first screen, details in <details> blocks below.

Sections shared with report.html (the resume plan, a recovery) are blocks built once
(`plan`, `recovery`); an audit's page is `audit`'s. Figures are written by `text`.
"""

from __future__ import annotations

from typing import Any

from ckptforensics.report.audit import render_audit_markdown
from ckptforensics.report.blocks import markdown_lines, md_footer, md_table
from ckptforensics.report.plan import plan_blocks
from ckptforensics.report.recovery import recovery_blocks, render_recovery_markdown
from ckptforensics.report.text import finite, fmt, reproduces

__all__ = ["render_markdown", "fmt", "md_table", "reproduces", "plan_lines", "recovery_lines"]


def plan_lines(p: dict[str, Any], run_dir: str | None = None) -> list[str]:
    """The resume plan as Markdown lines (`plan.plan_blocks`): report.md's section, and what
    `ckptforensics plan` prints."""
    return markdown_lines(plan_blocks(p, run_dir))


def recovery_lines(r: dict[str, Any]) -> list[str]:
    """The recovery section as Markdown lines (`recovery.recovery_blocks`)."""
    return markdown_lines(recovery_blocks(r))


def render_markdown(doc: dict[str, Any]) -> str:
    """report.md of any report document (a recovery's and an audit's have their own page):
    the verdict first, then the plan, then each section's details."""
    if doc.get("recovery"):
        return render_recovery_markdown(doc)
    if doc.get("audit"):
        return render_audit_markdown(doc)
    v = doc["verdict"]
    lines = [*_head_lines(doc), *_verdict_lines(v)]
    p = doc.get("plan") or {}
    if p.get("status") == "ready":
        lines += ["", "**Resume plan**", "", *plan_lines(p)]
    lines += _findings_lines(doc.get("findings", []))
    if doc.get("diff"):
        lines += _diff_lines(doc["diff"])
    if doc.get("replay"):
        lines += _replay_lines(doc["replay"])
    if doc.get("bisect"):
        lines += _bisect_lines(doc["bisect"])
    if doc.get("whatif"):
        lines += _whatif_lines(doc["whatif"])
    lines += ["", md_footer(doc), ""]
    return "\n".join(lines)


def _head_lines(doc: dict[str, Any]) -> list[str]:
    """The title, the summary and the verdict's key facts."""
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
    return lines


def _verdict_lines(v: dict[str, Any]) -> list[str]:
    """The verdict's tables (corrupted elements, anomalous samples, tensors at their limit)
    and its recommended actions."""
    lines: list[str] = []
    if v["corrupted_elements"]:
        lines += ["", "**Corrupted elements**", ""]
        lines += md_table(
            ["tensor", "where", "index", "before", "after", "kind"],
            [
                [f"`{e['tensor']}`", e["where"], e["index"], fmt(e["before"]), fmt(e["after"]), e["kind"]]
                for e in v["corrupted_elements"][:10]
            ],
        )  # fmt: skip
    if v["anomalous_samples"]:
        lines += ["", "**Anomalous samples**", ""]
        lines += md_table(
            ["row", "sample id", "score", "why"],
            [
                [s["index"], fmt(s["sample_id"]), fmt(s["score"]), s["why"]]
                for s in v["anomalous_samples"][:16]
            ],
        )
    if v["overflowing_tensors"]:
        lines += ["", "**Tensors at their dtype's limit**", ""]
        lines += md_table(
            ["tensor", "where", "dtype", "max abs", "limit"],
            [
                [f"`{o['name']}`", o["where"], o["dtype"], fmt(o["max_abs"]), fmt(o["limit"])]
                for o in v["overflowing_tensors"][:10]
            ],
        )
    if v["recommended_actions"]:
        lines += ["", "**Recommended actions**", ""]
        lines += [f"{i}. {act}" for i, act in enumerate(v["recommended_actions"], 1)]
    return lines


def _findings_lines(findings: list[dict[str, Any]]) -> list[str]:
    """Every finding, collapsed."""
    lines = ["", f"<details><summary>Findings ({len(findings)})</summary>", ""]
    if findings:
        lines += md_table(
            ["id", "severity", "kind", "subject", "score", "message"],
            [
                [f["id"], f["severity"], f["kind"], f"`{f['subject']}`", fmt(f["score"]), f["message"]]
                for f in findings
            ],
        )  # fmt: skip
    else:
        lines.append("No findings.")
    return [*lines, "", "</details>"]


_TENSOR_HEAD = ["tensor", "dtype", "update/weight per step", "max abs Δ", "r_v", "sign-like share",
                "bound violations", "non-finite"]  # fmt: skip


def _diff_lines(diff: dict[str, Any]) -> list[str]:
    """The checkpoint pair and the per-tensor diff, collapsed; the largest movers first."""
    p = diff["pair"]
    lines = ["", "<details><summary>Checkpoint pair</summary>", ""]
    lines += md_table(
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
    lines += [f"- {n}" for n in p.get("notes") or []]
    lines += [
        "",
        "</details>",
        "",
        f"<details><summary>Per-tensor diff ({len(diff['tensors'])} tensors)</summary>",
        "",
    ]
    rows = sorted(diff["tensors"], key=lambda t: -(t["update_ratio"] or 0))
    lines += md_table(
        _TENSOR_HEAD,
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
    return [*lines, "", "</details>"]


def _config_lines(config: dict[str, Any]) -> list[str]:
    out = ["", "Configuration (value, source):", ""]
    for k, c in config.items():
        val = c["value"]
        if isinstance(val, dict) and len(val) > 4:
            val = f"{len(val)} steps"
        out.append(f"- {k}: {val} ({c['source']})")
    return out


_CHECK_HEAD = ["step", "replayed loss", "logged loss", "match", "replayed grad norm",
               "logged grad norm", "match"]  # fmt: skip


def _check_table(check: dict[str, Any]) -> list[str]:
    rows = [
        [c["step"], fmt(c["loss"]), fmt(c["logged_loss"]), fmt(c["loss_ok"]), fmt(c["grad_norm"]),
         fmt(c["logged_grad_norm"]), fmt(c["grad_ok"])]
        for c in check.get("steps", [])
    ]  # fmt: skip
    if not rows:
        return [f"No logged figure to compare ({check.get('note') or 'no log'})."]
    return md_table(_CHECK_HEAD, rows)


_REPLAY_HEAD = ["step", "loss", "logged loss", "grad norm", "skipped", "loss scale",
                "max abs logit", "log Z"]  # fmt: skip


def _replay_lines(rep: dict[str, Any]) -> list[str]:
    """The replay, collapsed: each step's figures, the attention logits, the configuration
    and how the replay checked out against the run's log and *after* (or why it is withheld)."""
    if rep.get("withheld"):
        lines = [
            "",
            f"<details><summary>Replay (withheld, {rep['precision']})</summary>",
            "",
            rep["withheld"] + ".",
            "",
        ]
        lines += _check_table(rep.get("check") or {})
        lines += _config_lines(rep["config"])
        return [*lines, "", "</details>"]
    lines = [
        "",
        f"<details><summary>Replay ({len(rep['steps'])} steps, {rep['precision']})</summary>",
        "",
    ]
    lines += md_table(
        _REPLAY_HEAD,
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
    if rep.get("attention"):
        lines += _attention_lines(rep["attention"])
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
    return [*lines, "", "</details>"]


def _attention_lines(att: dict[str, Any]) -> list[str]:
    """The six attention layers with the largest pre-softmax logit, per replayed step."""
    steps = sorted(att, key=int)
    mods = att[steps[0]]["modules"]

    def peak(i: int) -> float:  # JSON null: a non-finite logit (an overflow upstream)
        return max(
            (
                v
                for s in steps
                if i < len(att[s]["max_logit"]) and (v := att[s]["max_logit"][i]) is not None
            ),
            default=0.0,
        )

    top = sorted(range(len(mods)), key=lambda i: -peak(i))[:6]
    top.sort()
    lines = [
        "",
        "Largest pre-softmax attention logit per layer (entropy of its most collapsed head, of uniform):",
        "",
    ]
    return lines + md_table(
        ["step", *[f"`{mods[i]}`" for i in top]],
        [
            [s, *[f"{fmt(att[s]['max_logit'][i])} ({fmt(att[s]['entropy'][i])})" for i in top]]
            for s in steps
        ],
    )


def _bisect_lines(bis: dict[str, Any]) -> list[str]:
    """The bisection: first bad step, culprit rows (decoded), its trials collapsed."""
    lines = ["", "**Bisection**", ""]
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
        lines += md_table(
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
        lines += md_table(
            ["trial", "loss", "grad norm", "robust z", "spikes"],
            [
                [t["label"], fmt(t["loss"]), fmt(t["grad_norm"]), fmt(t["robust_z"]), fmt(t["spiked"])]
                for t in bis["trials"]
            ],
        )  # fmt: skip
        lines += ["", "</details>"]
    return lines


_WHATIF_HEAD = ["mitigation", "on track", "max loss", "max grad norm", "final loss",
                "overflow-skipped steps"]  # fmt: skip


def _whatif_lines(wi: dict[str, Any]) -> list[str]:
    """Each mitigation's outcome and the band it was judged against."""
    lines = ["", "**What-if**", ""]
    lines += md_table(
        _WHATIF_HEAD,
        [
            [
                o["mitigation"],
                fmt(o["on_track"]),
                finite(o["max_loss"]),
                finite(o["max_grad_norm"]),
                finite(o["final_loss"]),
                ", ".join(map(str, o["skipped_updates"])) or "none",
            ]
            for o in wi["outcomes"]
        ],
    )
    return [
        *lines,
        "",
        f"Band: loss ≤ {fmt(wi['level'])} + {fmt(wi['band'])}, grad norm ≤ {fmt(wi['grad_norm_level'])} + {fmt(wi['grad_norm_band'])} ({wi['source']}).",
    ]
