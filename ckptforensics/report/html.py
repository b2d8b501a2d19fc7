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
from ckptforensics.report.blocks import html_text, sections_html
from ckptforensics.report.history import history_plots
from ckptforensics.report.page import NO_PLOTS, esc, footer, num, page, png
from ckptforensics.report.recovery import render_recovery_html
from ckptforensics.report.sections import detail_sections, report_sections, title
from ckptforensics.report.text import fmt
from ckptforensics.report.words import headline

__all__ = ["render_html", "NEAR_LIMIT"]

# A tensor within this factor of its dtype's largest value is near its limit: the headroom
# plot shows those alone (a 2x headroom is the detectors' own alarm, docs/signatures.md).
NEAR_LIMIT = 100.0

# Names on a per-tensor or per-module axis: the largest few, the rest unlabelled.
TOP_LABELS = 12


def _short(names: list[str]) -> list[str]:
    """Names without the first component they all share ('model.', 'transformer.')."""
    first = {n.split(".", 1)[0] for n in names}
    if len(first) == 1 and all("." in n for n in names):
        return [n.split(".", 1)[1] for n in names]
    return list(names)


def _name_ticks(ax: Any, names: list[str], axis: str, values: Any = None) -> None:
    """Label an axis with names: all where they are few, else the `TOP_LABELS` with the
    largest `values` (the ones a reader looks for), in axis order."""
    if len(names) <= TOP_LABELS or values is None:
        pos = list(range(0, len(names), max(1, -(-len(names) // TOP_LABELS))))
    else:
        v = np.nan_to_num(np.asarray(values, float), nan=-np.inf)
        pos = sorted(int(i) for i in np.argsort(-v)[:TOP_LABELS])
    labels = [_short(names)[i] for i in pos]
    if axis == "x":
        ax.set_xticks(pos, labels, rotation=90, fontsize=7)
    else:
        ax.set_yticks(pos, labels, fontsize=7)


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
        _name_ticks(ax, names, "y", np.abs(rel).max(axis=1))
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


def _plots(doc: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(title, <img>) for each plot the document has data for; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
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
                _name_ticks(ax, [mods[i] for i in idx], "x", cur[idx] / base[idx])
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
    ts = (doc.get("diff") or {}).get("tensors") or []
    if ts:
        # Update/weight ratio, largest first, the top tensors named.
        ts = sorted(ts, key=lambda t: -num(t["update_ratio"]) if math.isfinite(num(t["update_ratio"])) else math.inf)  # fmt: skip
        ratio = [num(t["update_ratio"]) for t in ts]
        fig, ax = plt.subplots(figsize=(10, 3.8))
        ax.semilogy(ratio, ".")
        ax.set_title("update/weight ratio per step, per tensor (largest first)")
        _name_ticks(ax, [t["name"] for t in ts], "x", ratio)
        out.append(("Update/weight ratio per tensor", png(fig)))
        near, _ = _near_limit(ts)
        if near:
            fig, ax = plt.subplots(figsize=(10, 3.2))
            ax.semilogy([num(t["headroom_b"]) for t in near], "o")
            ax.axhline(2.0, color="r", ls=":", lw=1, label="2x: the detectors' alarm")
            ax.set_title(
                f"dtype headroom (largest value / max|x|) of the tensors within {NEAR_LIMIT:g}x of it"
            )
            _name_ticks(ax, [f"{t['name']} ({t['dtype']})" for t in near], "x")
            ax.legend(fontsize=7)
            out.append(("Tensors near their dtype's limit", png(fig)))
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
    if doc.get("history"):
        out += history_plots(plt, doc["history"])
    return out


def _near_limit(ts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """(the tensors within `NEAR_LIMIT`x of their dtype's largest value, closest first; the line
    that says so where none is: a page of headroom at 10^38 says nothing)."""
    known = [t for t in ts if math.isfinite(num(t.get("headroom_b")))]
    near = sorted((t for t in known if num(t["headroom_b"]) < NEAR_LIMIT), key=lambda t: num(t["headroom_b"]))  # fmt: skip
    if near or not known:
        return near, ""
    t = min(known, key=lambda t: num(t["headroom_b"]))
    return [], (
        f"No tensor comes within {NEAR_LIMIT:g}× of its dtype's largest value: the closest, "
        f"{t['name']} ({t['dtype']}), stays {fmt(num(t['headroom_b']))}× below it."
    )


def render_html(doc: dict[str, Any]) -> str:
    """report.html of any report document (a recovery's and an audit's have their own page):
    the verdict box, then the sections report.md renders too, the plots after the plan."""
    if doc.get("recovery"):
        return render_recovery_html(doc)
    if doc.get("audit"):
        return render_audit_html(doc)
    parts = [
        f"<h1>ckptforensics: {esc(title(doc))}</h1>",
        f"<p class='summary'>{html_text(headline(doc))}</p>",
        *sections_html(report_sections(doc)),
    ]
    plots = _plots(doc)
    if plots is None:
        parts.append(NO_PLOTS)
    elif plots:
        parts.append(
            "<h2>Plots</h2><div class='plots'>"
            + "".join(f"<h3>{esc(t)}</h3>{img}" for t, img in plots)
            + "</div>"
        )
    _, said = _near_limit((doc.get("diff") or {}).get("tensors") or [])
    if said:
        parts.append(f"<p class='note'>{esc(said)}</p>")
    parts += sections_html(detail_sections(doc))
    parts.append(footer(doc))
    return page("ckptforensics report", parts)
