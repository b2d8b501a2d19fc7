"""A held shift of the loss (docs/signatures.md#log-shift): the CURVE_SHORT steps from a
start sit above the 2 x CURVE_SHORT before them by ranks (Mann-Whitney), with the grad norm
where the log has one, the level moving by at least one noise unit and extreme against the
log's own earlier moves; the shift's first step is the change point near the best window."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import (
    BIWEIGHT_K,
    CURVE_FLOOR,
    CURVE_SHORT,
    biweight_change,
    family_alpha,
    family_z,
    log_curve,
    robust_sigma,
)
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig, grad_up
from ckptforensics.detectors.log.short import SHORT_MIN

# A fault that lifts the loss by less than its noise a step, on a log whose noise is heavy
# tailed, still moves where the loss is: the CURVE_SHORT steps from its onset sit above the
# 2 x CURVE_SHORT before them. Mann-Whitney's rank test (scipy.stats.mannwhitneyu, exact)
# reads ranks, not the spread a heavy tail widens, and a lone blip moves one rank of eight.
# The grad norm, where the log has one, must rise with the loss: each at SHIFT_ALPHA (1%)
# on its own, and both together (Fisher's combination, scipy.stats.combine_pvalues) at the
# Sidak level for the windows tested (stats.family_alpha), as the loss alone must where no
# grad norm was logged. A loss logged from one rank's micro-batch blips where the gradient,
# averaged over all ranks, does not move; a fault moves both and stays.
SHIFT_ALPHA = 0.01
# Ranks say whether the steps after sit above those before, not by how much, and they assume
# independent steps: a healthy log whose heavy tail comes in bursts, or whose loss wanders
# slowly (autocorrelated), ranks a quiet stretch under a noisy one though its level hardly
# moved (tuning draw 388: p 2.6e-5 on the loss, 9.6e-3 on the grad norm, for a median 0.8
# noise units up). So the level must move too: the median of the CURVE_SHORT steps from the
# start at least SHIFT_EFFECT noise units above that of the 2 x CURVE_SHORT before it, where
# the unit is the log's own, the trend rule's: the robust spread of the loss about its trend's
# one-step-ahead level over the CURVE_WINDOW steps before the window, floored at CURVE_FLOOR
# (`_shift_effect`). One unit: a level that moved by less than one step's noise is what
# the log does on its own (every held shift the rank test finds at a fault of the tuning
# draws 100-429 moved 2.2 units or more); a shift under one unit is left to the trend rules.
SHIFT_EFFECT = 1.0
# And the move must be extreme against the log's own history: the same move (the median of
# CURVE_SHORT steps less that of the 2 x CURVE_SHORT before them) at every earlier start whose
# window ends before this one's begins, over the trend's window of them, is the null of a log
# that drifts: a slowly wandering (autocorrelated) loss moves its windows' medians by far more
# than independent steps would, and Mann-Whitney, which assumes independent steps, reads that
# as a shift. The candidate's robust z against them (their median and robust spread) must
# reach the Sidak level of SHIFT_ALPHA over the windows tested (stats.family_z): the same
# correction the rank test's level has (draw 388: z 3.7 against 4.0; the held shifts at the
# tuning draws' faults 4.6 or more; an AR(1) drift of a log's level with its grad norm, the
# unit tests' class, passes the ranks and often the effect). A log with fewer than SHIFT_HISTORY such windows has
# no history to set a null by, and is judged by the rank test and the effect alone.
SHIFT_HISTORY = 2 * CURVE_SHORT


def _window_moves(ev: LogEvidence) -> np.ndarray:
    """The move of the loss's level (log10) at every index i >= 2 x CURVE_SHORT: the median of
    the CURVE_SHORT steps from i less that of the 2 x CURVE_SHORT before it (NaN where the
    windows do not fit, or a NaN loss sits on both sides)."""
    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = log_curve(ev.loss.values)
    out = np.full(x.size, np.nan)
    with np.errstate(invalid="ignore"):
        for i in range(h, x.size - k + 1):
            out[i] = np.median(x[i : i + k]) - np.median(x[i - h : i])
    return out


def _shift_effect(
    ev: LogEvidence, starts: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """How far the loss's level moves at each window start (`_window_moves`): in the log's
    noise units (over the robust spread of the loss about its trend's level over the `window`
    steps before it, floored at CURVE_FLOOR, and the floor where fewer than 3 are known),
    and as a robust z against the same move at the earlier starts whose windows end before
    it begins (the last `window` of them; +inf with fewer than SHIFT_HISTORY)."""
    k = CURVE_SHORT
    x = log_curve(ev.loss.values)
    moves = _window_moves(ev)
    with np.errstate(invalid="ignore"):
        resid = x - log_curve(ev.loss.level)  # not finite where the trend had not judged yet
    units, zs = np.empty(starts.size), np.full(starts.size, math.inf)
    for n, i in enumerate(starts):
        units[n] = moves[i] / _noise_unit(resid, i, window)
        past = moves[max(0, i - k + 1 - window) : i - k + 1]
        past = past[np.isfinite(past)]
        spread = robust_sigma(past)
        if past.size >= SHIFT_HISTORY and spread > 0:
            zs[n] = (moves[i] - float(np.median(past))) / spread
    # A NaN loss on both sides of a start moves nothing measurable: left to the ranks.
    return np.nan_to_num(units, nan=math.inf), np.nan_to_num(zs, nan=math.inf)


def _shift_p(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """One-sided Mann-Whitney p of the CURVE_SHORT values from each start against the
    2 x CURVE_SHORT before it (a non-finite value ranks above every finite one)."""
    from scipy import stats

    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = np.nan_to_num(log_curve(values), posinf=1e300)
    before = np.stack([x[i - h : i] for i in starts])
    after = np.stack([x[i : i + k] for i in starts])
    return np.asarray(
        stats.mannwhitneyu(after, before, alternative="greater", axis=1, method="exact").pvalue,
        dtype=np.float64,
    )


def held_shift(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The first step of CURVE_SHORT steps whose loss (and grad norm) sit above the steps
    before them, by ranks: the change point the log's windows agree on best near the first
    window that passes (docs/signatures.md#log-shift)."""
    from scipy import stats

    steps, k, h = ev.loss.steps, CURVE_SHORT, 2 * CURVE_SHORT
    starts = np.arange(max(h, cfg.judge_after), len(steps) - k + 1)
    if starts.size == 0:
        return []
    p_loss = _shift_p(np.asarray(ev.loss.values, dtype=np.float64), starts)
    gsteps = ev.grad_norm.steps
    level = family_alpha(int(starts.size), SHIFT_ALPHA)
    if len(gsteps) >= h + k:
        # The grad norm's own windows, from its first step at or after each loss window's.
        gi = np.searchsorted(np.asarray(gsteps), np.asarray(steps)[starts])
        ok = (gi >= h) & (gi <= len(gsteps) - k)
        p_grad = np.ones(starts.size)
        if ok.any():
            p_grad[ok] = _shift_p(np.asarray(ev.grad_norm.values, dtype=np.float64), gi[ok])
        p = np.array(
            [
                stats.combine_pvalues([a, b], method="fisher").pvalue
                for a, b in zip(p_loss, p_grad, strict=True)
            ]
        )
        passed = (p_loss < SHIFT_ALPHA) & (p_grad < SHIFT_ALPHA) & (p < level)
        how = "and the grad norm with it"
    else:
        p_grad, p, passed = np.full(starts.size, math.nan), p_loss, p_loss < level
        how = "(no grad norm logged)"
    effect, past_z = _shift_effect(ev, starts, cfg.window)
    passed &= (effect >= SHIFT_EFFECT) & (past_z >= family_z(int(starts.size), SHIFT_ALPHA))
    passed &= _persists_or_confirmed(ev, cfg, starts)
    if not passed.any():
        return []
    first = int(np.argmax(passed))
    near = np.arange(first, min(first + k, starts.size))
    j = int(near[np.argmin(np.where(passed[near], p[near], np.inf))])
    w = int(starts[j])
    i = _shift_start(ev, w)
    s, v = steps[i], ev.loss.values[i]
    before = float(np.median(ev.loss.values[i - h : i]))
    moved = (
        ""
        if i == w
        else f"; the window with the smallest p starts at step {steps[w]}, the steps best split "
        f"into the level before and the level after at step {s} (biweight loss, K {BIWEIGHT_K:g})"
    )
    msg = (f"loss from step {s} ({v:.4g}) sits above the {h} steps before it (median {before:.4g}) for {k} steps, {how}: "
           f"Mann-Whitney p {p_loss[j]:.1e} (loss), {p_grad[j]:.1e} (grad norm), together {p[j]:.1e} < {level:.1e} "
           f"(1% over the {starts.size} windows tested, Sidak); its median {effect[j]:.1f} noise units up "
           f"(>= {SHIFT_EFFECT:g}){moved}")  # fmt: skip
    return [Onset(s, "loss", v, before, math.inf, msg, "held-shift")]


def _persists_or_confirmed(ev: LogEvidence, cfg: TriageConfig, starts: np.ndarray) -> np.ndarray:
    """Per window start: the shift persists past its window (the median of the CURVE_SHORT
    steps after it still SHIFT_EFFECT noise units or more above the 2 x CURVE_SHORT before the
    window, in `_shift_effect`'s unit; or the log ends first) or the grad norm confirms it on
    its trend (z/2 or more, or not finite, within the window: `held._persists_or_confirmed`'s
    test for a held rise). Issue 32: an onset is an excursion that persists, or that the grad
    norm and the following steps confirm. A heavy tail's burst of blips ranks a window above
    the steps before it and falls back after (held-out log draw 10379, healthy: six blips of
    +0.5 nats in 256-263, the level back at 1.48 from 264, the grad norm under z/2)."""
    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = log_curve(ev.loss.values)
    with np.errstate(invalid="ignore"):
        resid = x - log_curve(ev.loss.level)
    out = np.ones(starts.size, dtype=bool)
    for n, i in enumerate(starts):
        later = x[i + k : i + 2 * k]
        if later.size < k:
            continue  # the log ends first
        with np.errstate(invalid="ignore"):
            moved = float(np.median(later)) - float(np.median(x[i - h : i]))
        if not moved / _noise_unit(resid, i, cfg.window) < SHIFT_EFFECT:
            continue  # persists (a NaN loss after it counts as persisting)
        out[n] = grad_up(ev, cfg, ev.loss.steps[i : i + k])
    return out


def _noise_unit(resid: np.ndarray, i: int, window: int) -> float:
    """The log's noise unit at index i: the robust spread of the loss about its trend's level
    (log10 residuals) over the `window` steps before i, floored at CURVE_FLOOR (the floor where
    it cannot be measured)."""
    unit = robust_sigma(resid[max(0, i - window) : i])
    return max(unit, CURVE_FLOOR) if math.isfinite(unit) else CURVE_FLOOR


def _shift_start(ev: LogEvidence, w: int) -> int:
    """The index of a held shift's first step, near the start `w` of the window that tested
    best: the change point between the level of the 2 x CURVE_SHORT steps before `w` and that
    of the CURVE_SHORT from it (their medians, in log10), each step weighed by its one-step
    likelihood under either level with outliers of both capped (`stats.biweight_change`), in
    the noise units of the steps before (their robust spread, floored at the trend rule's
    CURVE_FLOOR). Candidates lie within half a window either side of `w`: the rank test
    places the shift to within its window, not further. A hard batch the step before the
    fault ranks top in every window and is an outlier of both levels: it does not start
    the shift; the step after it, back at the old level, does not either."""
    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = log_curve(ev.loss.values)
    pre, post = x[w - h : w], x[w : w + k]
    pre, post = pre[np.isfinite(pre)], post[np.isfinite(post)]
    if pre.size < SHORT_MIN or post.size < SHORT_MIN:
        return w
    scale = max(robust_sigma(pre), CURVE_FLOOR)
    lo, hi = max(h, w - k // 2), min(x.size - 1, w + k // 2)
    return biweight_change(
        x, range(lo, hi + 1), float(np.median(pre)), float(np.median(post)), scale
    )
