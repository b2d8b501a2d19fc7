"""A creep of the loss (docs/signatures.md#log-creep): the loss leaves its trend for good,
rising slowly with no step of it a spike, and is still rising where the log ends.

The rule, on log10 of the loss of a full log (an excerpt has no trend to leave):

1. the noise unit is the log's own: the robust spread (MAD) of its one-step differences over
   sqrt 2, the per-step noise a slow trend does not inflate;
2. the floor is the lowest level the loss reaches once judged (its rolling median over
   CURVE_SHORT + 1 steps, from `judge_after` on); a creep is a rise from it;
3. the loss rises for good: the median of the log's last CURVE_SHORT steps at least
   CREEP_UNITS noise units above the floor, at least CREEP_SPAN steps after it;
4. it keeps rising: from the floor to the end, and over the last half of that span too, the
   loss trends up by Kendall's tau, one-sided p under CREEP_ALPHA each (a data-mixture
   shift lifts the loss and settles, a re-warmup lifts it and descends: the last half of
   either no longer rises);
5. it is no schedule's: where the log carries the LR, the LR at the end is no higher than
   at the floor (a warm-up or re-warmup lifts the loss while the LR grows; the LR rules
   date an LR that jumps);
6. dated where it departs: the knee of a continuous two-piece line (least squares) through
   the loss from the floor to where its level crosses halfway from the floor to the end for
   good (a creep under a descent has begun where the loss is lowest: never before the
   floor); it gives way to an LR jump the log records just after it, as a held start does
   (`onsets._yields_to_lr_jump`).

Its limit: a creep that has settled at its new level before the log ends is not called (a
settled lift is what a data-mixture shift looks like; the held rules may see its start), and
neither is one that lives inside the weights and logits while the loss stays on its trend
(the creep draws' attention logits, log Z and Adam's rare rows: `history` reads those).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ckptforensics.core.stats import CURVE_SHORT, log_curve, robust_sigma
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig
from ckptforensics.logs import lr_columns

# How far the loss must have risen above its floor by the log's end, in the log's per-step
# noise units: the median of CURVE_SHORT steps has 0.44 of a unit's noise, two such levels
# differ by 0.63 units by chance; 8 units is 12 of those.
CREEP_UNITS = 8.0
# A creep takes time: the rise spans at least this many steps from the floor to the end (a
# faster lift is a step or a held shift, the trend and shift rules' business).
CREEP_SPAN = 4 * CURVE_SHORT
# Kendall's tau, one-sided, over the rise and over its last half.
CREEP_ALPHA = 0.01
# The knees tried on a first pass over a creep's stretch (`_departure`).
KNEE_GRID = 200
# The least noise unit (log10): a log quieter than float rounding does not turn a drift of
# 0.1% into a creep.
CREEP_FLOOR = 1e-3


def _rolling_median(x: np.ndarray, half: int) -> np.ndarray:
    """The median of x over [i - half, i + half] (clipped at the ends), per i."""
    n = x.size
    out = np.empty(n)
    if n > 2 * half:
        out[half : n - half] = np.median(sliding_window_view(x, 2 * half + 1), axis=1)
    for i in [*range(min(half, n)), *range(max(half, n - half), n)]:
        out[i] = float(np.median(x[max(0, i - half) : i + half + 1]))
    return out


def _rising(y: np.ndarray) -> float:
    """One-sided p of Kendall's tau of y against its index (small: y trends up)."""
    from scipy import stats

    if y.size < 4:
        return 1.0
    res = stats.kendalltau(np.arange(y.size), y, alternative="greater")
    return float(res.pvalue) if math.isfinite(res.pvalue) else 1.0


def _departure(x: np.ndarray, level: np.ndarray, floor: int, end: float) -> int:
    """The index where the rise departs: the knee of a continuous two-piece line (least
    squares) through the loss from the floor to where its level crosses halfway from the
    floor to the end for good. Up to that crossing, not to the end: a creep that slows as it
    grows would pull the knee to where it slows. At most KNEE_GRID knees are tried across
    the stretch, then every one around the best (a long log's creep spans thousands)."""
    half = level[floor] + (end - level[floor]) / 2
    below = np.flatnonzero(level[floor:] <= half) + floor
    cross = int(below[-1]) + 1 if below.size else floor
    if cross - floor < 4:
        return floor
    t = np.arange(floor, cross + 1, dtype=np.float64)
    y = x[floor : cross + 1]

    def cost(knee: int) -> float:
        a = np.stack([np.ones_like(t), np.minimum(t - knee, 0.0), np.maximum(t - knee, 0.0)], 1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        return float(((y - a @ coef) ** 2).sum())

    grid = np.unique(np.linspace(floor, cross - 2, KNEE_GRID).astype(int))
    step = int(grid[1] - grid[0]) if grid.size > 1 else 1
    best = int(grid[np.argmin([cost(int(k)) for k in grid])])
    near = range(max(floor, best - step), min(cross - 2, best + step) + 1)
    return min(near, key=lambda k: (cost(k), k))


def _lr_grew(ev: LogEvidence, start: int, end: int) -> bool:
    """Whether the logged LR at step `end` is above that at `start` (any group)."""
    rows = ev.rows
    for key in sorted({k for r in rows.values() for k in lr_columns(r)}):
        before = [rows[s][key] for s in rows if s <= start and key in rows[s]]
        after = [rows[s][key] for s in rows if s <= end and key in rows[s]]
        if before and after and after[-1] > before[-1] * (1 + 1e-6):
            return True
    return False


def loss_creep(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The first step of a creep of the loss (docs/signatures.md#log-creep), or nothing."""
    steps, k = ev.loss.steps, CURVE_SHORT
    x = log_curve(ev.loss.values)
    n = x.size
    if ev.excerpt or n < cfg.judge_after + CREEP_SPAN + k or not np.isfinite(x).all():
        return []  # a non-finite loss is the nonfinite rule's
    unit = max(robust_sigma(np.diff(x)) / math.sqrt(2), CREEP_FLOOR)
    level = _rolling_median(x, k // 2)
    floor = cfg.judge_after + int(np.argmin(level[cfg.judge_after :]))
    end = float(np.median(x[-k:]))
    units = (end - level[floor]) / unit
    if n - 1 - floor < CREEP_SPAN or units < CREEP_UNITS:
        return []
    span = x[floor:]
    p_all, p_late = _rising(span), _rising(span[span.size // 2 :])
    if p_all >= CREEP_ALPHA or p_late >= CREEP_ALPHA:
        return []
    if _lr_grew(ev, steps[floor], steps[-1]):
        return []
    i = _departure(x, level, floor, end)
    v = ev.loss.values[i]
    msg = (f"loss creeps up from step {steps[i]} ({v:.4g}): its last {k} steps' median "
           f"{10**end:.4g} is {units:.1f} noise units (>= {CREEP_UNITS:g}) above its floor "
           f"{10**level[floor]:.4g} at step {steps[floor]}, {steps[-1] - steps[floor]} steps "
           f"before the end, and still rising (Kendall p {p_all:.1e} over the rise, {p_late:.1e} "
           f"over its last half, < {CREEP_ALPHA:g}); dated where it left the floor")  # fmt: skip
    return [Onset(steps[i], "loss", v, 10 ** level[floor], units, msg, "creep")]
