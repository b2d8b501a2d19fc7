"""What `history` hands its detectors: every module's trajectory over a run's checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["METRICS", "Trajectory", "HistoryEvidence"]

# Each trajectory's metric and the direction in which it leaves its trend when it goes wrong
# (an attention head collapsing lowers its entropy; everything else grows).
METRICS: dict[str, str] = {
    "attn_max_logit": "up",
    "attn_entropy": "down",
    "log_z": "up",
    "max_logit": "up",
    "act_rms": "up",
    "update_ratio": "up",
    "r_v": "up",
    "max_abs_m": "up",
    "max_v": "up",
    "rho_share": "up",
    "max_step": "up",
}


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One module's figure at each checkpoint (or checkpoint pair) of the run.

    Attributes:
        module: the model's own module name (a tensor's name for the diff's figures).
        metric: one of `METRICS` (`attn_max_logit` in logit units, `attn_entropy` as a share
            of uniform, `log_z` and `max_logit` in nats, `act_rms` in the activation's unit,
            the diff's per-pair figures dimensionless, dated at the pair's later checkpoint;
            `max_step` the tensor's largest per-element step in units of the LR per optimizer
            step, 1 a sign-like Adam step).
        steps: the checkpoints' steps, ascending.
        values: the figure at each step (NaN where not measured).
    """

    module: str
    metric: str
    steps: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def direction(self) -> str:
        return METRICS[self.metric]

    def finite(self) -> list[tuple[int, float]]:
        """(step, value) where the value was measured."""
        return [(s, v) for s, v in zip(self.steps, self.values, strict=True) if math.isfinite(v)]


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryEvidence:
    """A run's history.

    Attributes:
        steps: the checkpoints' steps, ascending.
        attn_modules: the modules that ran attention, in forward order.
        head: the module whose output is the logits (None: a bare function computes them).
        trajectories: every module's trajectory of every metric measured.
    """

    steps: tuple[int, ...]
    attn_modules: tuple[str, ...]
    head: str | None
    trajectories: tuple[Trajectory, ...]

    def of(self, metric: str, module: str) -> Trajectory | None:
        return next(
            (t for t in self.trajectories if t.metric == metric and t.module == module), None
        )
