"""A settled level shift (docs/signatures.md#log-settled): a departure of the trend rule that
is the first step of the level the run then keeps, a sustained small shift rather than an
incident (a data-mixture switch: the new source's batches lift the loss a little and go on
lifting it; tuning draw 1546, its grad norm 1.4x and its loss 1.32x at the switch, the loss
level 1.2x from there on, both as noisy as that step from then on).

The rule, on log10 of the loss (and of the grad norm where the log has one), judged against
the run's own statistics after the departure, where the log has at least SETTLE_AFTER steps
after it (a departure near the log's end is left standing: nothing after it can tell):

1. sustained, and a step: the median of the steps after it sits between half and all of its
   excess (the larger of its own step's and the next's: a grad-norm spike's loss answers on
   either) above the median of the 2 x CURVE_SHORT steps before it; a blip falls back, an
   excursion grows past its first step, a switch steps up and stays;
2. no outlier of the level after it: its loss, and its grad norm, at robust z under z/2
   (median and robust spread of the steps after it): what the run does on every few steps
   from then on, not a departure large against its own noise;
3. small: the level before it is itself still inside the spread of the steps after it
   (robust z under z/2): the new level contains the old one, as a mixture of two sources'
   batches does; a fault that lifts the loss for good moves it clear of where it was;
4. no instability after: every step after it finite, none a spike against the level after
   it (loss and grad norm at robust z under z), the grad norm's level before it still inside
   the spread of the grad norms after it (robust z under z/2: a gradient that grows for good
   is an update gone wrong), and the loss not still rising over the last half of them
   (Kendall's tau, one-sided p at least CREEP_ALPHA, as the creep rule asks of a settled
   lift).

Source: the run's own statistics, read after the departure as the trend rule reads them
before it (a robust z, median and MAD; z the trend rule's 6, after OLMo-core's 6 sigma; z/2 the
band a blip recovers into, `blips`): a spike is a departure large against the run's own noise
or followed by instability, a data-mixture switch a sustained small level shift. Its limit: a
switch that lifts the loss at once by more than the steps' noise is a held shift (`shift`),
which this rule does not judge.

An LR fault's excursion grows past its first step or spikes after it (tuning draw 1466: its
grad norm up to 5.4 after the jump, 10x its level before it); a poisoned batch's loss falls
back (1485, 1499: the level after it within 1% of the level before, its own loss at robust z
19-23 against the steps after it). Both stand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ckptforensics.core.stats import CURVE_SHORT, log_curve, robust_sigma
from ckptforensics.detectors.log.creep import CREEP_ALPHA, CREEP_FLOOR, _rising
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig

# The steps a departure needs after it to be judged a settled level: two short windows.
SETTLE_AFTER = 2 * CURVE_SHORT


def _spread(x: np.ndarray) -> tuple[float, float]:
    """(median, robust spread floored at CREEP_FLOOR) of log10 values."""
    return float(np.median(x)), max(robust_sigma(x), CREEP_FLOOR)


def settled_level(
    before: Sequence[float],
    own: Sequence[float],
    after: Sequence[float],
    z: float,
    grad_own: Sequence[float] = (),
    grad_after: Sequence[float] = (),
    grad_before: Sequence[float] = (),
) -> str | None:
    """Why a departure is the first step of a settled level shift (the module's rule, on the
    losses of the 2 x CURVE_SHORT steps `before` it, of its own step and the next (`own`), and
    of every step `after` it; the grad norms of its steps, of those after it and of those
    before it, where logged; `z` the spike threshold), as a sentence, or None where it is not
    one (or the steps after it are too few, or not all finite, to tell)."""
    pre, mine, post = log_curve(before), log_curve(own), log_curve(after)
    if pre.size < CURVE_SHORT or not mine.size or post.size < SETTLE_AFTER:
        return None
    if not (np.isfinite(pre).all() and np.isfinite(mine).all() and np.isfinite(post).all()):
        return None
    lo, peak = float(np.median(pre)), float(mine.max())
    hi, unit = _spread(post)
    excess, shift = peak - lo, hi - lo
    if not (excess > 0 and excess / 2 <= shift <= excess):
        return None  # falls back (a blip), or grows past its first step (an excursion)
    z_peak, z_old, z_top = (peak - hi) / unit, (hi - lo) / unit, float((post.max() - hi) / unit)
    if z_peak >= z / 2 or z_old >= z / 2 or z_top >= z:
        return None
    grad = ""
    g_own, g_post, g_pre = log_curve(grad_own), log_curve(grad_after), log_curve(grad_before)
    if g_own.size and g_post.size >= SETTLE_AFTER:
        if not (np.isfinite(g_own).all() and np.isfinite(g_post).all()):
            return None
        gm, gu = _spread(g_post)
        zg, zg_top = (float(g_own.max()) - gm) / gu, float((g_post.max() - gm) / gu)
        g_pre = g_pre[np.isfinite(g_pre)]
        zg_old = (gm - float(np.median(g_pre))) / gu if g_pre.size >= CURVE_SHORT else 0.0
        if zg >= z / 2 or zg_old >= z / 2 or zg_top >= z:
            return None
        grad = (f"; so is its grad norm (robust z {zg:.1f} against the grad norms after it, "
                f"the level before at {zg_old:.1f}, none of them a spike: at most "
                f"{zg_top:.1f})")  # fmt: skip
    p_late = _rising(post[post.size // 2 :])
    if p_late < CREEP_ALPHA:
        return None
    return (f"a settled level shift: the loss's level over the {post.size} steps after it is "
            f"{10**shift:.3g}x the one before, between half and all of this step's "
            f"{10**excess:.3g}x, and stays; this step is no outlier of it (robust z "
            f"{z_peak:.1f} < {z / 2:g} against those steps), the level before still inside their "
            f"spread (z {z_old:.1f} < {z / 2:g}), none of them a spike (at most z {z_top:.1f} < "
            f"{z:g}) and the loss no longer rising (Kendall p {p_late:.2g} over their last "
            f"half){grad}: a data-mixture switch, not an incident")  # fmt: skip


def settled_shift(o: Onset, ev: LogEvidence, cfg: TriageConfig) -> str | None:
    """Why a trend onset of a full log (a loss spike, a grad-norm spike the loss followed) is
    the first step of a settled level shift, not an incident (`settled_level`), or None."""
    if o.rule != "trend" or o.signal not in ("loss", "grad_norm") or ev.excerpt:
        return None
    steps, vals, k = ev.loss.steps, ev.loss.values, CURVE_SHORT
    i = next((n for n, s in enumerate(steps) if s >= o.step), None)
    if i is None or i < 2 * k or i + 1 >= len(steps):
        return None
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.values, strict=True))
    return settled_level(
        vals[i - 2 * k : i],
        vals[i : i + 2],
        vals[i + 1 :],
        cfg.z,
        [g[s] for s in steps[i : i + 2] if s in g],
        [g[s] for s in steps[i + 1 :] if s in g],
        [g[s] for s in steps[i - 2 * k : i] if s in g],
    )
