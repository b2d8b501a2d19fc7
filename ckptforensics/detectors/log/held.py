"""A held rise of the loss (docs/signatures.md#log-held): a fault that lifts the loss by
less than the trend rule's z a step, held for CURVE_SHORT steps. Its margin, `HELD_Z`, is
also the excerpt rules' (`short`)."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import CURVE_SHORT
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig, grad_up

# A fault that lifts the loss by less than z noise-widths a step shows as a held excursion:
# CURVE_SHORT steps in a row with their lower quartile (6 of 8) at z/3 or more above the level
# before the first (6 of 8 normal values >= 2 sigma has probability 4e-9, binomial), which the
# trend, reading each step alone, absorbs. Its first step is the first of three in a row at z/3,
# the second keeping half the first's excess: a blip just before the fault, followed by a step
# back at (or halfway to) the level, is not its start.
HELD_Z = 1 / 3


def held_rise(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The first step of a held rise of the loss (docs/signatures.md#log-held)."""
    # Judged above the level the loss has just been at too (`above_level`): in a descent a
    # pause runs above the trend line, not above where the curve is. The window is measured
    # against the level before its first step, in that step's noise units: the trend accepts
    # steps under z 6 and would follow the rise it is asked about.
    z, steps, vals, base = (
        ev.loss_level.z,
        ev.loss_level.steps,
        ev.loss_level.values,
        ev.loss_level.level,
    )
    lv = np.log10(np.maximum(np.asarray(vals, dtype=np.float64), 1e-30))
    lv = np.where(np.isfinite(lv), lv, np.inf)  # a NaN loss is held above any level
    k = CURVE_SHORT
    for i in range(len(z) - k + 1):
        if not (
            z[i] >= HELD_Z * cfg.z
            and math.isfinite(z[i])
            and math.isfinite(base[i])
            and math.isfinite(lv[i])
        ):
            continue
        lb = math.log10(base[i])
        scale = (lv[i] - lb) / z[i]
        units = (lv[i : i + k] - lb) / scale
        held = float(np.percentile(units, 25))
        # Contiguity: the next step keeps at least half this one's excess, and the one after
        # stays at z/3 (a blip that falls back before the rise is not where it continues from).
        if (
            held >= HELD_Z * cfg.z
            and units[1] >= max(HELD_Z * cfg.z, units[0] / 2)
            and units[2] >= HELD_Z * cfg.z
            and _persists_or_confirmed(ev, cfg, i, (lv[i + k : i + 2 * k] - lb) / scale)
        ):
            return [Onset(steps[i], "loss", vals[i], float(base[i]), held,
                          f"loss {vals[i]:.4g} at step {steps[i]} starts {k} steps held above its level {base[i]:.4g} (6 of 8 at robust z {held:.1f} or more)", "held")]  # fmt: skip
    return []


def _persists_or_confirmed(ev: LogEvidence, cfg: TriageConfig, i: int, later: np.ndarray) -> bool:
    """A held window is an onset where the excursion persists past it (the median of the
    CURVE_SHORT steps after it still at z/3 units or more, or the log ends first) or the grad
    norm confirms it (z/2 or more on its trend within the window, as `blips._grad_confirms`
    asks of a blip): issue 32, an onset is an excursion that persists or that the grad norm
    and the following steps confirm. Heavy-tailed noise holds the loss up for seven steps and
    lets it fall back with the gradient quiet (tuning log draw 554: 235-241, the fault at 266)."""
    if later.size < CURVE_SHORT or float(np.median(later)) >= HELD_Z * cfg.z:
        return True
    return grad_up(ev, cfg, ev.loss.steps[i : i + CURVE_SHORT])
