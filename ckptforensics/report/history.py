"""The `history` block as report sections (report.md and report.html), its plots (module x
checkpoint heatmaps, the training log on the same step axis) and evidence.h5's `history`
group."""

from __future__ import annotations

import math
import warnings
from typing import Any

import h5py
import numpy as np

from ckptforensics.report.blocks import Code, Facts, Para, Section, Table
from ckptforensics.report.page import num, png
from ckptforensics.report.text import fmt

__all__ = ["history_sections", "history_plots", "write_history_h5"]

# The forward pass's trajectories the module x checkpoint table shows, in reading order.
_TABLE = (
    ("attn_max_logit", "largest attention logit"),
    ("attn_entropy", "attention entropy / uniform"),
    ("log_z", "output log Z"),
    ("max_logit", "largest |output logit|"),
)
# departures listed (all of them are in report.json)
_SHOWN = 30


def _cell(x: Any) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt(x)


def history_sections(h: dict[str, Any]) -> list[Section]:
    """The history's facts, its module x checkpoint table and every departure, earliest first."""
    steps = h["steps"]
    facts = Facts(
        [
            ("checkpoints", f"{len(steps)} ({steps[0]} .. {steps[-1]})"),
            ("fixed batch", h["batch"]),
            ("onset", [Code(h["onset_module"]), f" off its trend since step {h['onset_step']}"]
             if h.get("onset_step") is not None else "none: no module past its danger level"),
            ("departure rule", h["rule"]),
            ("cost", ", ".join(f"{k.removeprefix('seconds_')} {v:.3g} s"
                              for k, v in h["cost"].items() if k.startswith("seconds_"))),
        ]
    )  # fmt: skip
    rows = [
        [Code(mod), what, *(_cell(x) for x in vals)]
        for key, what in _TABLE
        for mod, vals in (h["trajectories"].get(key) or {}).items()
    ]
    deps = h.get("departures") or []
    dep_rows = [
        [d["step"], Code(d["module"]), d["metric"], fmt(d["value"]), fmt(d["expected"]), f"x{d['ratio']:.3g}"]
        for d in deps[:_SHOWN]
    ]  # fmt: skip
    out = [
        Section("History", [facts]),
        Section(
            "Modules x checkpoints",
            [Table(["module", "figure", *map(str, steps)], rows)],
        ),
    ]
    more = f" ({len(deps) - _SHOWN} more in report.json)" if len(deps) > _SHOWN else ""
    out.append(
        Section(
            "Departures from each module's own trend",
            [Table(["step", "module", "figure", "value", "trend", "ratio"], dep_rows)]
            if dep_rows
            else [Para(["No module left its own trend."])],
            collapsed=len(dep_rows) > 10,
        )
    )
    if more:
        out[-1].blocks.append(Para([more.strip(" ()")]))
    return out


def _relative(per: dict[str, list[Any]]) -> tuple[list[str], np.ndarray]:
    """Modules with a finite figure, and log10 of each against its own first finite value."""
    names, rows = [], []
    for mod, vals in per.items():
        m = np.array([num(x) for x in vals], float)
        ok = np.isfinite(m) & (m > 0)
        if not ok.any():
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            rows.append(np.log10(np.where(ok, m, np.nan) / m[ok][0]))
        names.append(mod)
    return names, np.array(rows)


def _heatmap(plt: Any, h: dict[str, Any], key: str, what: str) -> tuple[str, str] | None:
    names, rel = _relative(h["trajectories"].get(key) or {})
    if not names:
        return None
    rel = np.clip(np.nan_to_num(rel, nan=0.0), -3, 3)
    steps = h["steps"]
    fig, ax = plt.subplots(figsize=(10, min(12, 1.5 + 0.16 * len(names))))
    lim = max(0.5, float(np.abs(rel).max()))
    im = ax.imshow(rel, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_xticks(
        range(len(steps)),
        [str(s) for s in steps],
        fontsize=7,
        rotation=90 if len(steps) > 20 else 0,
    )
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.set_xlabel("checkpoint step")
    if h.get("onset_step") in steps:
        ax.axvline(steps.index(h["onset_step"]), color="k", ls=":", lw=1)
    fig.colorbar(im, ax=ax, label=f"log10 {what} / its first checkpoint's")
    ax.set_title(f"per-module {what} x checkpoint")
    return f"Modules x checkpoints: {what}", png(fig)


def _log_plot(plt: Any, h: dict[str, Any]) -> tuple[str, str] | None:
    """The training log's loss and grad norm on the checkpoints' step axis, the onset marked."""
    lg = h.get("log") or {}
    if not lg:
        return None
    fig, ax = plt.subplots(1, 2, figsize=(10, 3))
    for a, key in zip(ax, ("loss", "grad_norm"), strict=True):
        xs = sorted(int(s) for s in lg if key in lg[s])
        a.plot(xs, [num(lg[str(s)][key]) for s in xs], "-", lw=1)
        for s in h["steps"]:
            a.axvline(s, color="0.85", lw=0.6)
        if h.get("onset_step") is not None:
            a.axvline(h["onset_step"], color="r", ls=":", label="onset")
        a.set_title(key.replace("_", " "))
        a.set_xlabel("step")
    ax[1].set_yscale("log")
    return "Training log on the checkpoints' step axis", png(fig)


def history_plots(plt: Any, h: dict[str, Any]) -> list[tuple[str, str]]:
    """(title, <img>) for each of the history's plots that has data."""
    got = [
        _log_plot(plt, h),
        _heatmap(plt, h, "attn_max_logit", "largest attention logit"),
        _heatmap(plt, h, "act_rms", "activation RMS"),
        _heatmap(plt, h, "update_ratio", "update/weight ratio"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [g for g in got if g is not None]


def write_history_h5(h5: h5py.File, h: dict[str, Any]) -> None:
    """evidence.h5's `history`: the steps, and per figure its modules and [modules, steps] values."""
    g = h5.create_group("history")
    g.create_dataset("step", data=np.array(h["steps"], dtype=np.int64))
    g.attrs["onset_step"] = h["onset_step"] if h.get("onset_step") is not None else -1
    for key, per in (h.get("trajectories") or {}).items():
        if not per:
            continue
        sub = g.create_group(key)
        sub.create_dataset("modules", data=np.array(list(per), dtype=h5py.string_dtype()))
        sub.create_dataset(
            "values", data=np.array([[num(x) for x in v] for v in per.values()], dtype=np.float64)
        )
