"""Online spike monitor: the training log's own onset rule, judged step by step as it runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ckptforensics.core.tensors import TrendBaseline

__all__ = ["SpikeMonitor", "Spike"]


@dataclass(frozen=True, slots=True)
class Spike:
    """An alarm: the step the excursion started at, and why it is one."""

    step: int
    loss: float
    grad_norm: float | None
    loss_z: float
    grad_z: float
    why: str


@dataclass
class SpikeMonitor:
    """Flags the step where the loss leaves the run's trend, or where the grad norm does and
    the loss answers, by the rule `triage` and the replay judge a finished log by
    (`tensors.TrendBaseline`: a robust line through the recent accepted steps, noise from
    their one-step-ahead errors; docs/signatures.md#spike-onset):

    - a non-finite loss;
    - a loss z > `z` that also clears the loss's recent level, or that the grad norm
      confirms (z >= z/2);
    - a grad-norm z > `z` whose own step's loss is at z/2, or whose next step's loss is at
      z/2 on its trend and above its recent level (then the alarm comes one step late and
      names the grad-norm step). A blip the loss ignores is no alarm.

    Attributes:
        z: robust z that makes a spike (6, triage's default; OLMo-core's SkipStep rule).
        cooldown: steps after an alarm with no new alarm (one excursion, one black box).
    """

    z: float = 6.0
    cooldown: int = 50
    _loss: TrendBaseline = field(init=False)
    _level: TrendBaseline = field(init=False)
    _grad: TrendBaseline = field(init=False)
    _grad_spike: tuple[int, float, float] | None = (
        None  # (step, grad norm, z) waiting on the next loss
    )
    _quiet_until: int = -1

    def __post_init__(self) -> None:
        self._loss = TrendBaseline(z=self.z)
        self._level = TrendBaseline(z=self.z, above_level=True)
        self._grad = TrendBaseline(z=self.z)

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> Spike | None:
        """Add one step's loss (and pre-clip grad norm); return the spike it shows, if any."""
        zl, _ = self._loss.push(loss)
        za, _ = self._level.push(loss)
        zg = self._grad.push(grad_norm)[0] if grad_norm is not None else 0.0
        waiting, self._grad_spike = self._grad_spike, None
        if step <= self._quiet_until:
            return None
        half = self.z / 2
        if not math.isfinite(loss):
            return self._alarm(step, loss, grad_norm, zl, zg, "the loss is not finite")
        if zl > self.z and (za > self.z or zg >= half):
            return self._alarm(
                step,
                loss,
                grad_norm,
                zl,
                zg,
                f"loss {loss:.4g} is {zl:.1f} robust sigma above its trend",
            )
        if waiting is not None and zl >= half and za >= half:
            s, g, z = waiting
            return self._alarm(
                s,
                loss,
                g,
                zl,
                z,
                f"grad norm {g:.4g} at step {s} (robust z {z:.1f}), and the loss rises after it (z {zl:.1f})",
            )
        if zg > self.z and grad_norm is not None and math.isfinite(grad_norm):
            if zl >= half:
                return self._alarm(
                    step,
                    loss,
                    grad_norm,
                    zl,
                    zg,
                    f"grad norm {grad_norm:.4g} (robust z {zg:.1f}) with the loss up (z {zl:.1f})",
                )
            self._grad_spike = (step, grad_norm, zg)
        return None

    def _alarm(
        self, step: int, loss: float, grad_norm: float | None, zl: float, zg: float, why: str
    ) -> Spike:
        self._quiet_until = step + self.cooldown
        return Spike(step, loss, grad_norm, zl, zg, why)
