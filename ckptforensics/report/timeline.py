"""triage's own page: the onset, the rollback checkpoint and a timeline of the log."""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.report.blocks import Facts, Spans, Table, html_blocks, html_text, inline
from ckptforensics.report.page import NO_PLOTS, esc, num, page, png
from ckptforensics.report.text import fmt
from ckptforensics.report.words import how_far

__all__ = ["render_triage_markdown", "render_triage_html"]


def _noise(t: dict[str, Any]) -> str:
    n = t.get("noise") or {}
    if not n:
        return "—"
    cols = (
        f"; left out (0 on every row): {n['ignored_columns']}" if n.get("ignored_columns") else ""
    )
    return (f"{n['kind']}: the loss moves {n['loss_noise_pct_per_step']}% a step; {n['steps_over_z']} steps far off their trend "
            f"(robust z over the threshold; normal noise would give {n['expected_over_z_if_normal']:.2g}); "
            f"{n['recovering_blips']} blips that recover{cols}")  # fmt: skip


def _onset_words(t: dict[str, Any]) -> str:
    """The verdict line: the first bad step, in plain words first ('the grad norm at 3.4× its
    trend'), the statistic after."""
    first = t["first_bad_step"]
    if first is None:
        return "No spike onset in the log."
    o = next((o for o in t.get("onsets") or [] if o["step"] == first), None)
    if o is None:
        return f"First bad step: {fmt(first)}"
    far = how_far(o.get("value"), o.get("baseline"), o.get("robust_z"))
    return f"First bad step: {fmt(first)}, the {o['signal'].replace('_', ' ')} at {far}"


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
        "| step | signal | rule | how far | message |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {o['step']} | {o['signal']} | {o.get('rule', '')} | {_far(o)} | {o['message'].replace('|', '/')} |"
            for o in onsets
        ),
        *(["", more] if more else []),
        "",
        "</details>",
    ]


def _html_rows(onsets: list[dict[str, Any]]) -> list[list[Any]]:
    return [
        [o["step"], o["signal"], o.get("rule", ""), _far(o), Spans(inline(o["message"]))]
        for o in onsets
    ]


def _far(o: dict[str, Any]) -> str:
    """How far a candidate lies from its trend, in words ('3.4× its trend (robust z 7.6)')."""
    if o.get("value") is None and o.get("robust_z") is None:
        return "—"
    return how_far(o.get("value"), o.get("baseline"), o.get("robust_z"))


_ROW_HEAD = ["step", "signal", "rule", "how far", "message"]


def render_triage_markdown(t: dict[str, Any]) -> str:
    """Verdict first: onset, rollback, the commands; then every signal."""
    lines = ["# ckptforensics: triage", "", f"**{_onset_words(t)}**", ""]
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


def _timeline(t: dict[str, Any]) -> str | None:
    """Loss and grad norm over the whole log, checkpoints, onset and rollback marked, and the
    candidates triage set aside (not onsets) as grey crosses on their signal; None without
    matplotlib, '' with nothing to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
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
        aside = [o for o in t.get("ignored") or [] if o.get("signal") == key]
        if aside:
            at = {s: i for i, s in enumerate(steps)}
            ys = tl.get(key) or []
            xs = [o["step"] for o in aside if o["step"] in at and at[o["step"]] < len(ys)]
            a.plot(xs, [num(ys[at[x]]) for x in xs], "x", color="0.35", ms=6,
                   label="set aside (not an onset)")  # fmt: skip
    ax[1].set_xlabel("step (grey lines: checkpoints)")
    marked = 0
    for a in ax:
        handles, labels = a.get_legend_handles_labels()
        marked += sum(
            len(h.get_xdata())
            for h, lab in zip(handles, labels, strict=True)
            if lab.startswith("set aside")
        )
        if handles:
            a.legend(fontsize=7)
    onset = (
        f", first bad step {t['first_bad_step']} marked" if t["first_bad_step"] is not None else ""
    )
    return png(fig, f"timeline of loss and grad norm{onset}, {marked} candidates set aside marked")


def render_triage_html(t: dict[str, Any]) -> str:
    """One self-contained page; the timeline degrades to nothing without matplotlib."""
    parts = [
        "<h1>ckptforensics: triage</h1>",
        f"<p class='summary'>{esc(_onset_words(t))}</p>",
        html_blocks([Facts([(k, inline(v)) for k, v in _head(t)])]),
    ]
    plot = _timeline(t)
    if plot is None:
        parts.append(NO_PLOTS)
    elif plot:
        parts.append(f"<h2>Timeline</h2><div class='plots'>{plot}</div>")
    if t["commands"]:
        parts.append("<h2>Next</h2><pre>" + esc("\n".join(t["commands"])) + "</pre>")
    if t["onsets"]:
        parts.append("<h2>Signals</h2>" + html_blocks([Table(_ROW_HEAD, _html_rows(t["onsets"]))]))
    aside, more = _set_aside(t)
    if aside:
        parts.append(
            "<details><summary>Set aside: candidates that are not onsets, and why "
            f"({len(t['ignored'])})</summary>"
            + html_blocks([Table(_ROW_HEAD, _html_rows(aside))])
            + (f"<p>{html_text(inline(more))}</p>" if more else "")
            + "</details>"
        )
    return page("ckptforensics triage", parts)
