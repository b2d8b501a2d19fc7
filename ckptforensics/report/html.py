"""report.html: one self-contained file (no network), plots inline where matplotlib is installed.

The page shell (head, stylesheet, tables) is `page`'s; the resume plan is the blocks report.md
renders too (`plan`); a recovery's and an audit's page are `recovery`'s and `audit`'s.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from ckptforensics.report.audit import render_audit_html
from ckptforensics.report.blocks import html_blocks
from ckptforensics.report.page import NO_PLOTS, esc, footer, num, ol, page, png, table
from ckptforensics.report.plan import plan_blocks
from ckptforensics.report.recovery import render_recovery_html
from ckptforensics.report.text import fmt, reproduces

__all__ = ["render_html"]


def _short(names: list[str]) -> list[str]:
    """Names without the first component they all share ('model.', 'transformer.')."""
    first = {n.split(".", 1)[0] for n in names}
    if len(first) == 1 and all("." in n for n in names):
        return [n.split(".", 1)[1] for n in names]
    return list(names)


def _name_ticks(ax: Any, names: list[str], axis: str, most: int = 40) -> None:
    """Label an axis with names (every k-th where there are more than `most`)."""
    k = max(1, -(-len(names) // most))
    pos = list(range(0, len(names), k))
    labels = [_short(names)[i] for i in pos]
    if axis == "x":
        ax.set_xticks(pos, labels, rotation=90, fontsize=6)
    else:
        ax.set_yticks(pos, labels, fontsize=6)


def _heatmap(
    plt: Any, per: dict[str, Any], mods: list[str], v: dict[str, Any]
) -> list[tuple[str, str]]:
    """Modules (forward order, named) x replayed steps, coloured by each module's output-gradient
    and activation norm against its own median over the window (log10): the view that shows
    where a spike starts and how it travels. The first anomalous module and bad step marked."""
    steps = sorted(per, key=int)
    out = []
    for key, what in (("grad_norm", "output-gradient norm"), ("rms", "activation RMS")):
        m = np.array([[num(x) for x in per[s][key]] for s in steps], float).T  # [modules, steps]
        with warnings.catch_warnings(), np.errstate(divide="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            rel = np.log10(m / np.nanmedian(np.where(m > 0, m, np.nan), axis=1, keepdims=True))
        keep = np.isfinite(rel).any(axis=1)
        if not keep.any():
            continue
        names = [n for n, k in zip(mods, keep, strict=True) if k]
        rel = np.clip(np.nan_to_num(rel[keep], nan=0.0, posinf=3.0, neginf=-3.0), -3, 3)
        fig, ax = plt.subplots(figsize=(10, min(12, 1.5 + 0.14 * len(names))))
        im = ax.imshow(
            rel,
            aspect="auto",
            cmap="RdBu_r",
            vmin=-max(1.0, float(np.abs(rel).max())),
            vmax=max(1.0, float(np.abs(rel).max())),
        )
        ax.set_xticks(range(len(steps)), steps, fontsize=7, rotation=90 if len(steps) > 20 else 0)
        _name_ticks(ax, names, "y", most=60)
        ax.set_xlabel("replayed step")
        fbs, fam = v.get("first_bad_step"), v.get("first_anomalous_module")
        if fbs is not None and str(fbs) in steps:
            ax.axvline(steps.index(str(fbs)), color="k", ls=":", lw=1)
        if fam and any(n == fam or n.startswith(fam + ".") for n in names):
            row = next(i for i, n in enumerate(names) if n == fam or n.startswith(fam + "."))
            ax.axhline(row, color="k", ls="--", lw=0.8)
            ax.annotate(
                f"first anomalous: {_short([fam, *names])[0]}", (0, row), fontsize=7, va="bottom"
            )
        fig.colorbar(im, ax=ax, label=f"log10 {what} / its window median")
        ax.set_title(f"per-module {what} x step, against each module's own baseline")
        out.append((f"Modules x steps: {what}", png(fig)))
    return out


def _plots(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, <img>) for each plot the document has data for; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    v = doc["verdict"]
    rep = doc.get("replay") or {}
    if rep.get("steps"):
        steps = [s["step"] for s in rep["steps"]]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3))
        # The run's own log before the window (grey), the window logged and replayed,
        # the two checkpoints and the first bad step.
        logged = {**(rep.get("history") or {}), **(rep.get("logged") or {})}
        for a, key in ((ax[0], "loss"), (ax[1], "grad_norm")):
            ls = sorted(int(s) for s in logged if key in logged[s])
            if ls:
                a.plot(
                    ls,
                    [num(logged[str(s)][key]) for s in ls],
                    "-",
                    color="0.6",
                    lw=1,
                    label="training log",
                )
            a.plot(steps, [num(s[key]) for s in rep["steps"]], "o-", ms=3, label="replayed")
        ax[1].set_yscale("log")
        inc = doc["incident"]
        for a, t in zip(ax, ("loss", "grad norm (pre-clip)"), strict=True):
            a.set_title(t)
            a.set_xlabel("step")
            for side, style in (("before", "-"), ("after", "--")):
                st = (inc.get(side) or {}).get("step")
                if st is not None:
                    a.axvline(st, color="g", ls=style, lw=0.8, label=f"{side} checkpoint")
            if v.get("first_bad_step") is not None:
                a.axvline(v["first_bad_step"], color="r", ls=":", label="first bad step")
        ax[0].legend(fontsize=7)
        out.append(("Loss and grad norm around the spike", png(fig)))
        per, mods = rep.get("per_module_steps") or {}, rep.get("modules") or []
        s0 = v.get("first_bad_step")
        if per and mods and s0 is not None and str(s0) in per:
            others = [per[k]["grad_norm"] for k in per if k != str(s0)]
            if others:
                cur = np.array([num(x) for x in per[str(s0)]["grad_norm"]], float)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # modules without gradients
                    base = np.nanmedian(
                        np.array([[num(x) for x in o] for o in others], float), axis=0
                    )
                keep = np.isfinite(cur) & np.isfinite(base) & (cur > 0)
                fig, ax = plt.subplots(figsize=(10, 3.6))
                idx = np.flatnonzero(keep)
                ax.semilogy(range(len(idx)), cur[idx], label=f"step {s0}")
                ax.semilogy(range(len(idx)), base[idx], label="other steps (median)")
                _name_ticks(ax, [mods[i] for i in idx], "x")
                ax.set_title("per-module output-gradient norm (forward order of modules)")
                ax.legend()
                out.append(("Per-layer gradient norm: suspect step vs baseline", png(fig)))
        if per and mods:
            out += _heatmap(plt, per, mods, v)
        srow = next((s for s in rep["steps"] if s["step"] == s0), None)
        if srow and srow.get("sample_grad_sq"):
            sq = [num(x) for x in srow["sample_grad_sq"]]
            tot = sum(x for x in sq if math.isfinite(x)) or 1.0
            fig, ax = plt.subplots(figsize=(6, 2.6))
            ax.bar(range(len(sq)), [x / tot for x in sq])
            ax.set_title(f"share of the gradient norm² per row, step {s0}")
            ax.set_xlabel("row")
            out.append(("Per-sample gradient share", png(fig)))
    diff = doc.get("diff") or {}
    if diff.get("tensors"):
        ts = diff["tensors"]
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        ax[0].semilogy([num(t["update_ratio"]) for t in ts], ".")
        ax[0].set_title("update/weight ratio per step, per tensor")
        ax[1].semilogy([num(t["headroom_b"]) for t in ts], ".")
        ax[1].set_title("dtype headroom (max / max|x|), per tensor")
        for a in ax:
            _name_ticks(a, [t["name"] for t in ts], "x")
        out.append(("Update/weight ratio and dtype headroom", png(fig)))
    wi = doc.get("whatif") or {}
    if wi.get("outcomes"):
        fig, ax = plt.subplots(figsize=(10, 3))
        for o in wi["outcomes"]:
            ax.plot(o["steps"], [num(x) for x in o["losses"]], "o-", label=o["mitigation"])
        if wi.get("level") is not None:
            ax.axhline(wi["level"] + wi["band"], color="k", ls=":", label="band")
        ax.set_title("what-if: loss per mitigation")
        ax.legend(fontsize=8)
        out.append(("What-if trajectories", png(fig)))
    return out


def render_html(doc: dict[str, Any]) -> str:
    """report.html of any report document (a recovery's and an audit's have their own page)."""
    if doc.get("recovery"):
        return render_recovery_html(doc)
    if doc.get("audit"):
        return render_audit_html(doc)
    v, inc = doc["verdict"], doc["incident"]
    parts = [
        f"<h1>ckptforensics: {esc(v['causes'][0]['cause'].replace('_', ' '))}</h1>",
        f"<p class='summary'>{esc(v['summary'])}</p>",
        table(
            ["", ""],
            [
                [
                    "before",
                    f"{inc['before']['path']} (step {fmt(inc['before']['step'])}, {inc['before']['format']})",
                ],
                [
                    "after",
                    f"{inc['after']['path']} (step {fmt(inc['after']['step'])}, {inc['after']['format']})",
                ],
                ["causes", ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"])],
                ["reproduces", reproduces(v)],
                ["replay vs the run's log", (v.get("replay_check") or {}).get("reason") or "—"],
                ["first bad step", fmt(v["first_bad_step"])],
                ["first anomalous module", v["first_anomalous_module"] or "—"],
                ["layers standing out", ", ".join(v["exploding_layers"][:5]) or "—"],
                ["rollback checkpoint", v["rollback_checkpoint"] or "—"],
            ],
        ),
    ]
    if v["recommended_actions"]:
        parts.append("<h2>Recommended actions</h2>" + ol(v["recommended_actions"]))
    p = doc.get("plan") or {}
    if p.get("status") == "ready":
        parts.append("<h2>Resume plan</h2>" + html_blocks(plan_blocks(p)))
    if v["anomalous_samples"]:
        parts.append(
            "<h2>Anomalous samples</h2>"
            + table(
                ["row", "sample id", "why"],
                [[s["index"], fmt(s["sample_id"]), s["why"]] for s in v["anomalous_samples"]],
            )
        )
    if v["corrupted_elements"]:
        parts.append(
            "<h2>Corrupted elements</h2>"
            + table(
                ["tensor", "index", "before", "after", "kind"],
                [
                    [e["tensor"], e["index"], fmt(e["before"]), fmt(e["after"]), e["kind"]]
                    for e in v["corrupted_elements"]
                ],
            )
        )
    if v["overflowing_tensors"]:
        parts.append(
            "<h2>Overflowing tensors</h2>"
            + table(
                ["name", "dtype", "where"],
                [[o["name"], o["dtype"], o["where"]] for o in v["overflowing_tensors"]],
            )
        )
    plots = _plots(doc)
    if plots:
        parts.append(
            "<h2>Plots</h2><div class='plots'>"
            + "".join(f"<h3>{esc(t)}</h3>{img}" for t, img in plots)
            + "</div>"
        )
    else:
        parts.append(NO_PLOTS)
    parts.append(
        "<h2>Findings</h2>"
        + table(
            ["id", "severity", "kind", "subject", "message"],
            [
                [f["id"], f["severity"], f["kind"], f["subject"], f["message"]]
                for f in doc["findings"]
            ],
        )
    )
    wi = doc.get("whatif") or {}
    if wi.get("outcomes"):
        parts.append(
            "<h2>What-if</h2>"
            + table(
                ["mitigation", "on track", "max loss", "max grad norm"],
                [
                    [
                        o["mitigation"],
                        fmt(o["on_track"]),
                        fmt(o["max_loss"]),
                        fmt(o["max_grad_norm"]),
                    ]
                    for o in wi["outcomes"]
                ],
            )
        )
    parts.append(footer(doc))
    return page("ckptforensics report", parts)
