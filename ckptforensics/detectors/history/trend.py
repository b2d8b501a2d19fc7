"""Where a module leaves its own trend: the change-point rule `history` dates every
trajectory with (docs/signatures.md#history-departure).

A checkpoint is judged against the robust line (Theil-Sen) through the module's own previous
`TREND_WINDOW` checkpoints, on a log10 scale: it departs when it stands past that line's
prediction by more than a factor (`Thresholds.attn_growth`, 1.5: Zhai et al. 2023's entropy
collapse and the replay's logit growth use the same factor) in the metric's bad direction,
and stays past the line's level at every later checkpoint (a departure for good, not a blip).
Only checkpoints with `TREND_WINDOW` measured ones before them are judged: a module's trend
needs a history of its own, and warm-up's early learning is that history's start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckptforensics.core.stats import theil_sen
from ckptforensics.detectors.history.evidence import Trajectory

__all__ = ["TREND_WINDOW", "Departure", "departure"]

# Checkpoints in the trend a checkpoint is judged against: the fewest through which a robust
# line still ignores one odd point (Theil-Sen's breakdown point is 29%: 1 of 4).
TREND_WINDOW = 4


@dataclass(frozen=True, slots=True)
class Departure:
    """The first checkpoint at which a trajectory left its trend for good.

    Attributes:
        module, metric: the trajectory's.
        step: the checkpoint's step.
        value: the figure there (the metric's unit).
        expected: what the trend through the checkpoints before it predicted (same unit).
        ratio: value / expected (expected / value for a metric that falls when it goes wrong).
    """

    module: str
    metric: str
    step: int
    value: float
    expected: float
    ratio: float


def _log(v: float) -> float:
    return math.log10(abs(v)) if v != 0 else -12.0


def departure(t: Trajectory, factor: float, window: int = TREND_WINDOW) -> Departure | None:
    """The first checkpoint of `t` past its own trend by `factor` and held there; None if none."""
    pts = t.finite()
    sign = 1.0 if t.direction == "up" else -1.0
    logs = [_log(v) for _, v in pts]
    margin = math.log10(factor)
    for i in range(window, len(pts)):
        xs = [float(s) for s, _ in pts[i - window : i]]
        slope, icpt = theil_sen(xs, logs[i - window : i])
        pred = icpt + slope * pts[i][0]
        if sign * (logs[i] - pred) <= margin:
            continue
        if all(sign * (y - pred) > 0 for y in logs[i + 1 :]):
            step, value = pts[i]
            expected = 10.0**pred
            ratio = abs(value) / expected if sign > 0 else expected / max(abs(value), 1e-12)
            return Departure(t.module, t.metric, step, value, expected, ratio)
    return None
