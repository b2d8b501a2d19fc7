"""What a replay detector reads (`ReplayEvidence`), its shape (`ReplayDetector`), and the
robust z every stage judges a step's figures by (`step_z`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptforensics.core.tensors import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    log_curve,
    robust_z,
    trend_z,
)
from ckptforensics.detectors.base import Finding, Thresholds

__all__ = ["ReplayDetector", "ReplayEvidence", "step_z"]


def step_z(
    values: Sequence[float], baseline: Sequence[float] = (), above_level: bool = False
) -> np.ndarray:
    """Robust z of per-step values (log scale) against the run's own trend: the logged
    history before the window leads into the window (`tensors.trend_z`, as triage judges
    the log; `above_level` as there); lacking that much history, against every step there
    is, the short history and the window together (5 window steps alone make a MAD of
    noise: a healthy run's 1.4x grad-norm wiggle read z 6.9 against its 4 neighbours and
    1.8 against the 20 steps of the run, fixtures/hf_ddp_run.py 15 -> 20). Non-finite = +inf."""
    if len(baseline) >= CURVE_MIN_HISTORY:
        return trend_z([*baseline, *values], judge_from=len(baseline), above_level=above_level)[0][
            len(baseline) :
        ]
    x = log_curve(values)
    pool = log_curve([*baseline, *values])
    ref = pool[np.isfinite(pool)]
    return np.where(
        np.isfinite(x), robust_z(x, floor=CURVE_FLOOR, reference=ref if ref.size else None), np.inf
    )


@dataclass(frozen=True, slots=True)
class ReplayEvidence:
    """What a replay detector reads: the replay, and the step the onset detectors settled.

    Attributes:
        rep: the replay (replay.ReplayResult).
        step: the step to examine: the first bad step where one is known, else the step
            with the largest grad norm (None before the onset detectors ran).
        bad: whether `step` went bad (a module "leaving its range" means something only
            on a step that did: on a healthy window the largest step always has a largest
            module).
    """

    rep: Any
    step: int | None = None
    bad: bool = False


ReplayDetector = Callable[[ReplayEvidence, Thresholds], list[Finding]]
