"""Dtype limits, bit-level helpers and robust statistics shared by diff, replay and detectors."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "DtypeLimits",
    "dtype_limits",
    "dtype_name",
    "float_bits",
    "flip_bit",
    "bit_role",
    "robust_z",
    "theil_sen",
    "adam_ratio_bound",
]


@dataclass(frozen=True, slots=True)
class DtypeLimits:
    """Range of a floating dtype.

    Attributes:
        max: largest finite value.
        tiny: smallest positive normal value.
        eps: machine epsilon (spacing at 1.0).
        bits: storage width in bits.
        mantissa_bits: explicit mantissa bits; the exponent sits above them.
    """

    max: float
    tiny: float
    eps: float
    bits: int
    mantissa_bits: int


def dtype_limits(dtype: torch.dtype) -> DtypeLimits | None:
    """Limits of a floating dtype, or None for integer/bool dtypes."""
    if not dtype.is_floating_point:
        return None
    fi = torch.finfo(dtype)
    mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}.get(dtype, 0)
    return DtypeLimits(max=float(fi.max), tiny=float(fi.tiny), eps=float(fi.eps), bits=fi.bits, mantissa_bits=mant)


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bf16' style short names used in reports."""
    return {
        torch.float32: "fp32",
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.float64: "fp64",
    }.get(dtype, str(dtype).replace("torch.", ""))


_INT_OF = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret a float tensor's storage as signed integers of the same width."""
    return x.view(_INT_OF[x.dtype])


def flip_bit(value: float, bit: int, dtype: torch.dtype) -> float:
    """Value obtained by flipping bit `bit` (0 = LSB) of `value` stored in `dtype`."""
    t = torch.tensor([value], dtype=dtype)
    width = torch.finfo(dtype).bits
    as_int = t.view(_INT_OF[dtype]).to(torch.int64) & ((1 << width) - 1)
    flipped = as_int ^ (1 << bit)
    # Back to the signed container of the dtype's width.
    if flipped.item() >= 1 << (width - 1):
        flipped = flipped - (1 << width)
    return float(flipped.to(_INT_OF[dtype]).view(dtype).to(torch.float64).item())


def bit_role(bit: int, dtype: torch.dtype) -> str:
    """Name of the field a bit belongs to: 'sign', 'exponent' or 'mantissa'."""
    lim = dtype_limits(dtype)
    assert lim is not None
    if bit == lim.bits - 1:
        return "sign"
    return "exponent" if bit >= lim.mantissa_bits else "mantissa"


# MAD -> standard deviation for normal data (the one consistency constant; Rousseeuw & Croux 1993).
MAD_TO_SIGMA = 1.4826


def robust_z(values: np.ndarray, floor: float = 0.0, reference: np.ndarray | None = None, axis: int | None = None) -> np.ndarray:
    """Robust z-scores: (x - median) / (1.4826 * MAD), MAD floored to stay finite.

    The one robust z of the package. `reference` (default: the values themselves) gives
    the population the values are judged against (the window's other steps, say); with
    `axis`, medians run along that axis of the reference (per module across steps) and
    NaN entries of the reference are ignored. The floor keeps a population of
    near-identical values from turning a tiny absolute difference into a huge z; pass a
    scale-aware floor (e.g. 5% of the median) where the statistic is a ratio.
    Non-finite values get +inf.
    """
    x = np.asarray(values, dtype=np.float64)
    if axis is not None:
        ref = np.asarray(reference, dtype=np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: modules that never ran
            med = np.nanmedian(ref, axis=axis)
            mad = np.nanmedian(np.abs(ref - med), axis=axis) * MAD_TO_SIGMA
        return (x - med) / np.maximum(mad, max(floor, 1e-12))
    out = np.zeros_like(x)
    finite = np.isfinite(x)
    ref = x[finite] if reference is None else np.asarray(reference, dtype=np.float64)
    ref = ref[np.isfinite(ref)]
    if ref.size < 3 or not finite.any():
        return out
    med = float(np.median(ref))
    mad = float(np.median(np.abs(ref - med))) * MAD_TO_SIGMA
    scale = max(mad, floor, 1e-12)
    out[finite] = (x[finite] - med) / scale
    out[~finite] = np.inf
    return out


# Per-step training curves (loss, grad norm) on a log10 scale. A step is predicted by the
# robust line through the last 2 x CURVE_SHORT accepted steps; CURVE_SHORT steps held at a
# new level re-anchor the baseline (the shortest run whose median's own noise stays under
# half the per-step noise, 1.25/sqrt(8) = 0.44 sigma). The noise floor of 0.02 (4.7%)
# keeps a curve quieter than float noise from turning any wiggle into an alarm; 128 steps
# of history is OLMo-core's SkipStepAdamW window. A step is judged once CURVE_MIN_HISTORY
# steps precede it: twice CURVE_SHORT, since early-training curves move faster than a
# shorter history follows (tuning draws 1039 and 1074: grad-norm transients as warmup ends).
CURVE_SHORT = 8
CURVE_WINDOW = 128
CURVE_FLOOR = 0.02
CURVE_MIN_HISTORY = 16


# A linear warmup from zero multiplies the LR by step_b / step_a between two steps at most;
# growth beyond LR_GROWTH_MARGIN times that is no schedule (docs/signatures.md#update-weight-ratio).
LR_GROWTH_MARGIN = 2.0


def lr_growth_limit(step_a: int, step_b: int, margin: float = LR_GROWTH_MARGIN) -> float:
    """The largest LR ratio lr(step_b) / lr(step_a) any warmup-then-decay schedule gives."""
    return margin * max(1.0, step_b / max(step_a, 1))


def log_curve(values: Sequence[float]) -> np.ndarray:
    """log10 of a positive curve; non-finite values -> +inf, non-positive -> -12 (far below)."""
    x = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(x > 0, np.log10(np.where(x > 0, x, 1.0)), -12.0)
    return np.where(np.isfinite(x), out, np.inf)


def trend_z(
    values: Sequence[float],
    judge_from: int = 0,
    z: float = 6.0,
    floor: float = CURVE_FLOOR,
    window: int = CURVE_WINDOW,
    min_history: int = CURVE_MIN_HISTORY,
    above_level: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Robust z of each step of a curve against a baseline that follows the run's own trend.

    Walking the curve in order, a step is compared with what the Theil-Sen line through
    the last 2 x `CURVE_SHORT` accepted steps predicts for it (`_trend_at`), corrected by
    the recent predictions' bias (with `above_level`, or with the median of the last
    `CURVE_SHORT` accepted steps where that is higher: how a loss excursion that nothing
    else confirms is judged); the noise scale is the robust spread of the accepted
    steps' one-step-ahead errors over the last `window`, or over the recent 2 x
    `CURVE_SHORT` where that is larger. A step whose z exceeds `z` does not enter the
    baseline, so a spike cannot hide the next one; a smooth lift (a data-mixture switch)
    is followed. Steps before `judge_from`, and steps with fewer than `min_history`
    accepted before them, get z = 0 (history only). A new level held for `CURVE_SHORT`
    steps in a row becomes the baseline (its first step was flagged). Non-finite values
    get +inf.

    Returns:
        (z per step, the baseline level per step in the curve's units; NaN where unjudged).
    """
    tb = TrendBaseline(z=z, floor=floor, window=window, min_history=min_history, above_level=above_level)
    lv = log_curve(values)
    out = np.zeros(lv.size)
    level = np.full(lv.size, np.nan)
    for i, v in enumerate(lv):
        zi, base = tb.push_log(float(v))
        if i >= judge_from:
            out[i], level[i] = zi, base
    return out, level


@dataclass
class TrendBaseline:
    """`trend_z`'s walk, one step at a time: what an online monitor pushes each step into
    (record.SpikeMonitor), so that it judges a step exactly as `triage` will later judge
    the log. Keeps only the tails the rule reads (bounded memory on a year-long run)."""

    z: float = 6.0
    floor: float = CURVE_FLOOR
    window: int = CURVE_WINDOW
    min_history: int = CURVE_MIN_HISTORY
    above_level: bool = False
    _i: int = 0
    _n_acc: int = 0  # accepted steps so far (acc keeps only the last 2 x CURVE_SHORT)
    _acc: list[float] = field(default_factory=list)  # accepted values (log10) ...
    _at: list[int] = field(default_factory=list)  # ... and their positions
    _err: list[float] = field(default_factory=list)  # one-step-ahead errors of the accepted steps
    _pending: list[tuple[int, float]] = field(default_factory=list)  # consecutive rejected (position, value)

    def push(self, value: float) -> tuple[float, float]:
        """Judge the next step's value: (robust z, baseline level in the curve's units);
        (0, NaN) while unjudged, (+inf, ...) for a non-finite value."""
        return self.push_log(float(log_curve([value])[0]))

    def push_log(self, v: float) -> tuple[float, float]:
        i = self._i
        self._i += 1
        acc, at, err, pending = self._acc, self._at, self._err, self._pending
        if self._n_acc >= self.min_history:
            pred = _trend_at(at[-2 * CURVE_SHORT :], acc[-2 * CURVE_SHORT :], i)
            e = np.asarray(err[-self.window :]) if len(err) >= 3 else np.zeros(1)
            # Bias of the recent predictions (a descent that slows runs above the line),
            # and the noise: the errors' robust spread around their own centre, over the
            # window or over the recent 2 x CURVE_SHORT steps where that is larger (noise
            # that grows, as a data mixture's does as its share ramps up).
            recent = e[-2 * CURVE_SHORT :]
            c = float(np.median(recent))
            spread = max(float(np.median(np.abs(e - np.median(e)))), float(np.median(np.abs(recent - c))))
            scale = max(MAD_TO_SIGMA * spread, self.floor)
            # With `above_level`, a spike stands above its trend and above where the curve
            # has just been (the median of its last CURVE_SHORT accepted steps, the level
            # Megatron's and Lightning's ratio rules judge against). In a steep descent the
            # line runs below that level: a step between the two may be the descent pausing.
            base = max(pred + c, float(np.median(acc[-CURVE_SHORT:]))) if self.above_level else pred + c
            zi = (v - base) / scale if math.isfinite(v) else math.inf
            if zi > self.z:
                if math.isfinite(v):
                    pending.append((i, v))
                if len(pending) >= CURVE_SHORT:
                    # A level the curve holds for CURVE_SHORT steps is its new level (a phase
                    # of training, a data switch): re-anchor, having flagged its start.
                    for p in pending:
                        self._accept(p[0], p[1], 0.0)
                    pending.clear()
                return zi, 10**base
            pending.clear()
            self._accept(i, v, v - pred)
            return zi, 10**base
        if not math.isfinite(v):
            return math.inf, math.nan
        # The unjudged history's one-step-ahead errors enter the noise too: judged from the
        # first few errors alone, a window that opens just after `min_history` rests on a
        # spread of 3-4 numbers, which chance makes tiny (tuning draws 1112, 1238: 1.2x
        # grad-norm wiggles at robust z 7).
        e_i = v - _trend_at(at[-2 * CURVE_SHORT :], acc[-2 * CURVE_SHORT :], i) if self._n_acc >= 3 else None
        self._accept(i, v, e_i)
        return 0.0, math.nan

    def _accept(self, i: int, v: float, e: float | None) -> None:
        self._at.append(i)
        self._acc.append(v)
        self._n_acc += 1
        if e is not None:
            self._err.append(e)
        keep = 2 * CURVE_SHORT
        if len(self._acc) > 4 * keep:  # trim in batches: the rule reads the last 2 x CURVE_SHORT
            del self._acc[:-keep], self._at[:-keep]
        if len(self._err) > 2 * self.window:
            del self._err[: -self.window]


def _trend_at(xs: list[int], ys: list[float], x: int) -> float:
    """The value a curve's recent points predict at x: Theil-Sen's robust line (the median
    of pairwise slopes; Theil 1950, Sen 1968) through the last 2 x CURVE_SHORT accepted
    points. A line follows a steep early descent that a rolling median lags behind, and one
    outlier among 16 points moves it little (29% breakdown)."""
    if len(ys) < 3:
        return float(np.median(ys))
    slope, intercept = theil_sen(xs, ys)
    return intercept + slope * x


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of Theil-Sen's robust line: the median of pairwise slopes, the
    median of the residual offsets (Theil 1950, Sen 1968; 29% breakdown)."""
    xa, ya = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if len(ya) < 2:
        return 0.0, float(np.median(ya)) if len(ya) else 0.0
    i, j = np.triu_indices(len(ya), 1)
    keep = xa[j] != xa[i]
    slope = float(np.median((ya[j] - ya[i])[keep] / (xa[j] - xa[i])[keep])) if keep.any() else 0.0
    return slope, float(np.median(ya - slope * xa))


# Steps within which the loss must answer a grad-norm spike for it to start an incident: a
# bad update shows in the next steps' loss; twice the rolling median, measured on the tuning
# draws (fixtures/draws.py), where natural grad-norm blips the loss ignores are 2-4x.
LOSS_FOLLOW = 16


def loss_follows(
    z_loss: Sequence[float],
    i: int,
    z: float = 6.0,
    follow: int = LOSS_FOLLOW,
    z_grad: Sequence[float] | None = None,
    benefit: bool = True,
    routine: bool = False,
    z_level: Sequence[float] | None = None,
) -> bool:
    """Whether the loss follows a grad-norm spike (or loss-scale backoff) at index i: the loss
    at half the spike z on that step or the next (a poisoned batch's own loss, a bad update's
    first effect), or, within `follow` steps, a loss spike or two steps at half z reached
    while the grad norm stays up (z_grad >= z/2 on every step between: one excursion, not a
    blip followed by an unrelated spike). Where the curve ends before the loss could
    answer, it is given the benefit unless `benefit` is False (signals that are routine
    by design, a loss-scale backoff). A signal that is `routine` by design (a backoff, an
    overflow under a loss scaler) needs the loss's own spike (z) on that step or the next:
    a half-z echo of a plateau's noise is what a routine backoff meets half the time
    (tuning draw 1242: a 1.11x loss the step after a backoff)."""
    seen = [float(v) for v in z_loss[i : i + follow + 1]]
    if routine:
        return any(v > z for v in seen[:2]) or (len(seen) <= 1 and benefit)
    half = z / 2
    # The loss of the spike's own step (a poisoned batch's) answers at half z on its trend;
    # the next step's (a bad update's first effect) must also stand above where the loss
    # has just been (`z_level`: the curve judged `above_level`), where that curve is given:
    # in a descent, a half-z bump the step after a blip is the descent pausing (tuning draw
    # 1062: a natural 2.3x grad-norm blip, the next loss 8% up, below its last 8 steps' median).
    nxt = float(z_level[i + 1]) if z_level is not None and i + 1 < len(z_level) else math.inf
    if seen[0] >= half or (len(seen) > 1 and seen[1] >= half and nxt >= half):
        return True
    if len(seen) <= follow // 2:
        return benefit
    if z_grad is not None:
        run = 2
        for g in z_grad[i + 2 : i + len(seen)]:
            if not g >= half:
                break
            run += 1
        seen = seen[:run]
    return any(v > z for v in seen) or sum(v >= half for v in seen) >= 2


def adam_ratio_bound(beta1: float, beta2: float, t_first: int, t_last: int) -> float:
    """Largest |m_hat| / sqrt(v_hat) any Adam step t in [t_first, t_last] can produce.

    Cauchy-Schwarz on the two EMAs gives, for step t with r = beta1^2 / beta2,
    |m_t| / sqrt(v_t) <= (1-beta1)/sqrt(1-beta2) * sqrt(sum_{j<t} r^j), and bias
    correction multiplies by sqrt(1-beta2^t)/(1-beta1^t). As t grows this tends to
    (1-beta1)/sqrt((1-beta2)(1-beta1^2/beta2)), 1.16 at (0.9, 0.95). No gradient,
    however large, moves an element further than lr times this bound per step.
    """
    t_first = max(1, int(t_first))
    t_last = max(t_first, int(t_last))
    # Evaluate on a bounded set of steps: the bound is smooth and monotone in t for
    # t beyond a few hundred, so the tail is represented by its endpoint.
    ts = np.unique(np.concatenate([np.arange(t_first, min(t_last, t_first + 4096) + 1), [t_last]]))
    r = beta1 * beta1 / beta2
    if abs(1 - r) < 1e-12:
        geo = ts.astype(np.float64)
    else:
        geo = (1 - np.power(r, ts.astype(np.float64))) / (1 - r)
    raw = (1 - beta1) / math.sqrt(1 - beta2) * np.sqrt(np.maximum(geo, 0.0))
    corr = np.sqrt(1 - np.power(beta2, ts.astype(np.float64))) / (1 - np.power(beta1, ts.astype(np.float64)))
    return float(np.max(raw * corr))
