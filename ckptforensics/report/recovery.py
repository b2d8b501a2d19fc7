"""A recovery report's renderings: did the resumed run follow the plan and the trajectory.

The section (the checks, the windows against the pre-incident trajectory, the legs read) is
built once as blocks from the document's `recovery` dict; report.md and report.html render
those blocks, around the page's head and, in HTML, the loss and grad-norm plot. They format
what `recovery` decided and decide nothing.
"""

from __future__ import annotations

from typing import Any

from ckptforensics.report.blocks import (
    Block,
    Bold,
    Code,
    Facts,
    Item,
    Para,
    Steps,
    Table,
    Text,
    html_blocks,
    inline,
    markdown_lines,
    md_footer,
)
from ckptforensics.report.page import NO_PLOTS, esc, footer, num, page, png
from ckptforensics.report.text import finite, fmt

__all__ = ["recovery_blocks", "render_recovery_markdown", "render_recovery_html"]


def _cell(x: Any) -> Any:
    """An expected or observed figure: a number through `fmt`, a list as it is."""
    return x if isinstance(x, list) else fmt(x)


def recovery_blocks(r: dict[str, Any]) -> list[Block]:
    """The recovery section: the checks, the windows against the trajectory, the legs read."""
    checks = [
        [c["name"], c["status"], _cell(c["expected"]), _cell(c["observed"]), c["message"]]
        for c in r["checks"]
    ]
    t = r["trajectory"]["loss"]
    fitted = (
        f" (fitted on steps {t['fitted_on'][0]}-{t['fitted_on'][1]}: loss ∝ step^{t['slope']:.3g}, noise {t['sigma']:.3g} log10; "
        f"a window is on it within {r['trajectory']['band_z']:g} standard errors)"
    )
    blocks: list[Block] = [
        Para([Bold("Checks that the resume was the plan")]),
        Table(["check", "status", "expected", "observed", "what it says"], checks),
        Para([Bold("Against the pre-incident trajectory"), fitted]),
        Table(
            ["steps", "loss", "trajectory", "ratio", "z", "grad norm", "its level", "ratio", "z", "onsets", "on trajectory"],
            [[f"{w['first']}-{w['last']}", finite(w["loss"]), fmt(w["expected_loss"]), finite(w["ratio"]), finite(w["z"]), finite(w["grad_norm"]), fmt(w["grad_level"]),
              finite(w["grad_ratio"]), finite(w["grad_z"]), ", ".join(map(str, w["onsets"])) or "—", fmt(w["in_band"])] for w in r["windows"]],
        ),
    ]  # fmt: skip
    if r.get("gap_trend") and "slope_per_100_steps" in r["gap_trend"]:
        g = r["gap_trend"]
        blocks.append(
            Para(
                [
                    f"Gap to the trajectory: {g['slope_per_100_steps']:+.3g} log10 per 100 steps, now {g['gap_now']:.3g}x"
                    + (
                        f", back around step {g['projected_step']}"
                        if g.get("projected_step")
                        else ""
                    )
                    + "."
                ]
            )
        )
    legs: list[str | Code | Bold] = ["Legs read: "]
    for i, leg in enumerate(r["legs"]):
        legs += ["; "] if i else []
        legs += [Code(leg["source"]), f" steps {leg['first']}-{leg['last']}"]
    blocks.append(Para([*legs, " (resumed leg: ", Code(r["log"]), ")."]))
    if r.get("plan"):
        blocks.append(Para(["Plan: ", Code(r["plan"]), "."], tight=True))
    return blocks


def _head(r: dict[str, Any]) -> str:
    """'recovered at step N', 'relapsed at step N', 'recovering'."""
    return r["status"] + (
        f" at step {r['step']}" if r["step"] is not None and r["status"] != "recovering" else ""
    )


def _head_blocks(doc: dict[str, Any]) -> list[Block]:
    """Where the run resumed, and what next: the facts and the actions both pages lead with."""
    r, v, inc = doc["recovery"], doc["verdict"], doc["incident"]
    rows: list[tuple[str, Text]] = [
        ("Resumed from", [Code(inc["before"]["path"]), f" (step {fmt(r['resumed_from'])})"])
    ]
    if r.get("checkpoint_after"):
        rows.append(("First checkpoint after the resume", [Code(r["checkpoint_after"])]))
    if r.get("onset") is not None:
        rows.append(("Incident onset", [f"step {r['onset']}"]))
    blocks: list[Block] = [Facts(rows)]
    if v["recommended_actions"]:
        blocks += [
            Para([Bold("Next")]),
            Steps([Item(i, inline(a)) for i, a in enumerate(v["recommended_actions"], 1)]),
        ]
    return blocks


def render_recovery_markdown(doc: dict[str, Any]) -> str:
    """report.md of a recovery: the status and summary, where it resumed, what next, the section."""
    r, v = doc["recovery"], doc["verdict"]
    lines = [f"# ckptforensics: recovery — {_head(r)}", "", f"**{v['summary']}**", ""]
    lines += markdown_lines(_head_blocks(doc))
    lines += ["", *markdown_lines(recovery_blocks(r))]
    lines += ["", md_footer(doc), ""]
    return "\n".join(lines)


def _plot(r: dict[str, Any]) -> str:
    """Loss and grad norm: the pre-incident steps, the incident leg, the resumed leg, the
    trajectory with its band, the resume and the verdict's step marked ('' without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    se = r["series"]
    fig, ax = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for a, key in ((ax[0], "loss"), (ax[1], "grad_norm")):
        for leg, style, label in (
            ("pre", dict(color="0.5", lw=1), "before the resume"),
            ("incident", dict(color="r", lw=1, ls="--"), "incident leg"),
            ("resumed", dict(color="C0", lw=1.3), "resumed leg"),
        ):
            s = se.get(leg) or {}
            if s.get("step"):
                a.plot(s["step"], [num(x) for x in s[key]], label=label, **style)
        exp = se.get("expected_loss" if key == "loss" else "expected_grad_norm") or []
        steps = (se.get("resumed") or {}).get("step") or []
        if exp and len(exp) == len(steps):
            a.plot(steps, exp, color="k", ls=":", lw=1, label="pre-incident trajectory")
            if key == "loss" and len(se.get("loss_band_upper") or []) == len(steps):
                a.fill_between(
                    steps, exp, se["loss_band_upper"], color="g", alpha=0.12, label="band"
                )
        a.axvline(r["resumed_from"], color="g", lw=1, label="resumed from")
        if r.get("step") is not None:
            a.axvline(
                r["step"],
                color="r" if r["status"] == "relapsed" else "C2",
                ls="--",
                lw=1,
                label=r["status"],
            )
        a.set_ylabel(key.replace("_", " "))
    ax[1].set_yscale("log")
    ax[1].set_xlabel("step")
    ax[0].legend(fontsize=7)
    return png(fig)


def render_recovery_html(doc: dict[str, Any]) -> str:
    """report.html of a recovery: the same section as report.md, with the plot above it."""
    r, v = doc["recovery"], doc["verdict"]
    parts = [
        f"<h1>ckptforensics: recovery — {esc(_head(r))}</h1>",
        f"<p class='summary'>{esc(v['summary'])}</p>",
        html_blocks(_head_blocks(doc)),
    ]
    plot = _plot(r)
    parts.append(
        f"<h2>Loss and grad norm</h2><div class='plots'>{plot}</div>" if plot else NO_PLOTS
    )
    parts.append("<h2>Details</h2>" + html_blocks(recovery_blocks(r)))
    parts.append(footer(doc))
    return page("ckptforensics recovery", parts)
