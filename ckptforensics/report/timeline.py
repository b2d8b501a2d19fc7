"""triage's own page: the onset, the rollback checkpoint and a timeline of the log."""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.report.page import esc, num, page, png, table
from ckptforensics.report.text import fmt

__all__ = ["render_triage_markdown", "render_triage_html"]


def _noise(t: dict[str, Any]) -> str:
    n = t.get("noise") or {}
    if not n:
        return "—"
    cols = (
        f"; left out (0 on every row): {n['ignored_columns']}" if n.get("ignored_columns") else ""
    )
    return (f"{n['kind']}: the loss moves {n['loss_noise_pct_per_step']}% a step; {n['steps_over_z']} steps over z "
            f"(normal noise: {n['expected_over_z_if_normal']:.2g}); {n['recovering_blips']} blips that recover{cols}")  # fmt: skip


def _head(t: dict[str, Any]) -> list[tuple[str, str]]:
    files = t.get("files") or [t["metrics_file"]]
    return [
        ("training log", t["metrics_file"]),
        (
            "files read",
            f"{len(files)} ({t.get('log_format') or '?'}, {len(t.get('legs') or [])} legs)",
        ),
        ("steps read", fmt(t["steps"])),
        ("first bad step", fmt(t["first_bad_step"])),
        ("rule", t.get("rule") or "—"),
        ("log noise", _noise(t)),
        ("rollback checkpoint", t["rollback"] or "none before the onset"),
        *([("rollback caveat", t["rollback_caveat"])] if t.get("rollback_caveat") else []),
        ("checkpoint after the onset", t["after"] or "—"),
        *[("passed over", note) for note in t.get("skipped") or []],
        *(
            [
                (
                    "rolled back",
                    f"{len(t['resumed']['legs'])} legs in the log; the latest resumed at step {t['resumed']['from']} (`ckptforensics recovery` judges it)",
                )
            ]
            if t.get("resumed")
            else []
        ),
    ]


# Rows of the set-aside table a page shows; a long log's routine blips can number hundreds.
_ASIDE_ROWS = 40


def _set_aside(t: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(the candidates set aside that the page lists, by step, and a line on the rest): the
    `_ASIDE_ROWS` furthest from their trend (robust z; an overflow's is infinite, null in JSON);
    report.json keeps every one."""
    every = t.get("ignored") or []

    def far(o: dict[str, Any]) -> float:
        z = o.get("robust_z")  # null: an overflow, infinite (JSON has no inf)
        return math.inf if z is None else float(z)

    shown = sorted(every, key=far, reverse=True)[:_ASIDE_ROWS]
    rest = len(every) - len(shown)
    more = f"{rest} more, nearer their trend, in report.json (`ignored`)." if rest > 0 else ""
    return sorted(shown, key=lambda o: o["step"]), more


def _md_table(summary: str, onsets: list[dict[str, Any]], more: str = "") -> list[str]:
    """A collapsed table of onsets (step, signal, rule, message), and a line after it."""
    return [
        "",
        f"<details><summary>{summary}</summary>",
        "",
        "| step | signal | rule | message |",
        "| --- | --- | --- | --- |",
        *(
            f"| {o['step']} | {o['signal']} | {o.get('rule', '')} | {o['message'].replace('|', '/')} |"
            for o in onsets
        ),
        *(["", more] if more else []),
        "",
        "</details>",
    ]


def _html_rows(onsets: list[dict[str, Any]]) -> list[list[Any]]:
    return [[o["step"], o["signal"], o.get("rule", ""), o["message"]] for o in onsets]


def render_triage_markdown(t: dict[str, Any]) -> str:
    """Verdict first: onset, rollback, the commands; then every signal."""
    first = t["first_bad_step"]
    lines = [
        "# ckptforensics: triage",
        "",
        f"**{'First bad step: ' + fmt(first) if first is not None else 'No spike onset in the log.'}**",
        "",
    ]
    lines += [f"- **{k}**: {v}" for k, v in _head(t)[1:]]
    if t["drift"]:
        lines.append(f"- **drift**: {t['drift']}")
    if t["commands"]:
        lines += ["", "**Next**", "", "```", *t["commands"], "```"]
    if t["onsets"]:
        lines += _md_table(f"Signals ({len(t['onsets'])})", t["onsets"])
    aside, more = _set_aside(t)
    if aside:
        summary = f"Set aside ({len(t['ignored'])}): candidates that are not onsets, and why"
        lines += _md_table(summary, aside, more)
    return "\n".join(lines) + "\n"


def _timeline(t: dict[str, Any]) -> str:
    """Loss and grad norm over the whole log, checkpoints, onset and rollback marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    tl = t.get("timeline") or {}
    steps = tl.get("step") or []
    if not steps:
        return ""
    fig, ax = plt.subplots(2, 1, figsize=(10, 4), sharex=True)
    for a, key, log in ((ax[0], "loss", False), (ax[1], "grad_norm", True)):
        a.plot(steps, [num(x) for x in tl.get(key) or [float("nan")] * len(steps)], "-", lw=1)
        if log:
            a.set_yscale("log")
        a.set_ylabel(key.replace("_", " "))
        for c in tl.get("checkpoints") or []:
            a.axvline(c, color="0.8", lw=0.6)
        if t["rollback_step"] is not None:
            a.axvline(t["rollback_step"], color="g", lw=1.2, label="rollback checkpoint")
        if t["first_bad_step"] is not None:
            a.axvline(t["first_bad_step"], color="r", ls=":", lw=1.5, label="first bad step")
    ax[1].set_xlabel("step (grey lines: checkpoints)")
    if t["first_bad_step"] is not None:
        ax[0].legend(fontsize=7)
    return png(fig)


def render_triage_html(t: dict[str, Any]) -> str:
    """One self-contained page; the timeline degrades to nothing without matplotlib."""
    first = t["first_bad_step"]
    head = f"First bad step: {fmt(first)}" if first is not None else "No spike onset in the log."
    parts = [
        "<h1>ckptforensics: triage</h1>",
        f"<p class='summary'>{esc(head)}</p>",
        table(["", ""], [[k, v] for k, v in _head(t)]),
    ]
    plot = _timeline(t)
    if plot:
        parts.append(f"<h2>Timeline</h2><div class='plots'>{plot}</div>")
    if t["commands"]:
        parts.append("<h2>Next</h2><pre>" + esc("\n".join(t["commands"])) + "</pre>")
    if t["onsets"]:
        parts.append(
            "<h2>Signals</h2>"
            + table(
                ["step", "signal", "rule", "message"],
                _html_rows(t["onsets"]),
            )
        )
    aside, more = _set_aside(t)
    if aside:
        parts.append(
            "<details><summary>Set aside: candidates that are not onsets, and why "
            f"({len(t['ignored'])})</summary>"
            + table(
                ["step", "signal", "rule", "message"],
                _html_rows(aside),
            )
            + (f"<p>{esc(more)}</p>" if more else "")
            + "</details>"
        )
    return page("ckptforensics triage", parts)
