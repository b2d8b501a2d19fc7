"""OLMo-core's SkipStepAdamW: which steps of the window the run's optimizer skipped.

OLMo-core 3.0's `SkipStepOptimizer.get_step_factor` (olmo_core/optim/skip_step_optimizer.py)
skips an update when the step's CE loss or pre-clip total grad norm exceeds the mean of the
previous `rolling_interval_length` steps (skipped ones included) by `sigma_factor` standard
deviations (`torch.std_mean`, unbiased; one-sided), once at least
`max(2, rolling_interval_length // 2)` losses are held; `SkipStepAdamW` multiplies the
whole update by that factor: weights, moments and Adam's `step` stay as they were. A replay
with torch's AdamW applies every step, and one skipped step moves every element off *after*.

Which steps the run skipped, in order: the run's log (`optim/step skipped`, the flight
recorder's `skipped`); else OLMo-core's rule over the logged history before the window and
the replayed losses and grad norms inside it.

`step_increment_bugfix=False` (older OLMo-core configs) never advances Adam's `step`: every
update's bias correction is that of the stored counter + 1 (`adamw_step`), which the replay
keeps by restoring the counter after each update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptforensics.formats.base import Checkpoint

__all__ = ["SkipRule", "skip_rule"]


@dataclass(slots=True)
class SkipRule:
    """SkipStepAdamW's settings and the history its rule looks at.

    Attributes:
        name: the optimizer's class (for the report).
        interval: `rolling_interval_length` (128 by default).
        sigma: `sigma_factor` (6 by default).
        step_increments: `step_increment_bugfix` (True by default).
        logged: step -> the run's own record that it skipped the step (its log).
        losses, grad_norms: step -> the values the rule saw (logged before the window,
            replayed inside it).
        skipped: the window's steps the replay skipped, with why.
    """

    name: str
    interval: int = 128
    sigma: float = 6.0
    step_increments: bool = True
    logged: dict[int, bool] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, str] = field(default_factory=dict)

    def config(self) -> dict[str, str]:
        """The optimizer as the replay's report states it (`replay.config.optimizer`)."""
        return {
            "value": f"{self.name}: AdamW whose update is skipped where the loss or grad norm exceeds the mean of the last {self.interval} steps by {self.sigma:g} std",
            "source": "OLMo-core config.json train_module.optim; the skipped steps from the run's log (optim/step skipped), else from that rule",
        }

    def fresh(self) -> SkipRule:
        """A copy for one replay of the window (the history before it only)."""
        return SkipRule(
            self.name,
            self.interval,
            self.sigma,
            self.step_increments,
            dict(self.logged),
            dict(self.losses),
            dict(self.grad_norms),
        )

    def decide(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether the run's optimizer skipped `step`, given the replayed loss and pre-clip
        grad norm (which join the history the next steps' rule sees)."""
        self.losses[step], self.grad_norms[step] = loss, grad_norm
        if step in self.logged:
            if self.logged[step]:
                self.skipped[step] = "the run's log (optim/step skipped)"
            return self.logged[step]
        if not self._rule(step):
            self.skipped[step] = (
                f"OLMo-core's rule: loss or grad norm over mean + {self.sigma:g} std of the last {self.interval} steps"
            )
            return True
        return False

    def _rule(self, step: int) -> bool:
        """`get_step_factor` > 0 (the update proceeds)."""
        prev = [s for s in range(step - self.interval, step) if s in self.losses]
        if len(prev) + 1 < max(2, self.interval // 2):
            return True
        ok = _within(self.losses[step], [self.losses[s] for s in prev], self.sigma)
        norms = [self.grad_norms[s] for s in prev if s in self.grad_norms]
        if norms and step in self.grad_norms:
            ok = ok and _within(self.grad_norms[step], norms, self.sigma)
        return ok

    def describe(self) -> str:
        shown = ", ".join(f"{s} ({why})" for s, why in sorted(self.skipped.items())) or "none"
        return f"{self.name} (rolling {self.interval}, {self.sigma:g} sigma): skipped steps in the window: {shown}"


def _within(x: float, hist: list[float], sigma: float) -> bool:
    """(x - mean) <= sigma * std, as OLMo-core computes it (float32 `torch.std_mean`)."""
    if not math.isfinite(x):
        return False
    std, mean = torch.std_mean(torch.tensor(hist, dtype=torch.float32))
    return bool((torch.tensor(x, dtype=torch.float32) - mean) <= sigma * std)


def skip_optimizer(ckpt: Checkpoint) -> str | None:
    """The optimizer class of a run that skips outlier steps on its own (OLMo-core's SkipStep
    optimizers, as its config.json names them), for the diff; None for any other run."""
    optim = ckpt.scalars.get("olmo_optim")
    cls = str(optim.get("_CLASS_", "")) if isinstance(optim, dict) else ""
    return cls.rsplit(".", 1)[-1].removesuffix("Config") if "SkipStep" in cls else None


def skip_rule(ckpt: Checkpoint, logged: dict[int, dict[str, float]], first: int) -> SkipRule | None:
    """The rule of a run whose optimizer skips steps (OLMo-core's SkipStep optimizers, as
    its config.json names them), with the logged history before step `first`."""
    optim = ckpt.scalars.get("olmo_optim")
    if not isinstance(optim, dict):
        return None
    cls = str(optim.get("_CLASS_", ""))
    if "SkipStep" not in cls and "skip_step" not in str(optim.get("type", "")):
        return None
    rule = SkipRule(
        name=cls.rsplit(".", 1)[-1].removesuffix("Config") or "SkipStepAdamW",
        interval=int(optim.get("rolling_interval_length", 128) or 128),
        sigma=float(optim.get("sigma_factor", 6) or 6),
        step_increments=optim.get("step_increment_bugfix", True) is not False,
    )
    for s, row in logged.items():
        flag = _flag(row)
        if flag is not None:
            rule.logged[s] = flag
        if s < first and "loss" in row:
            rule.losses[s] = row["loss"]
            if "grad_norm" in row:
                rule.grad_norms[s] = row["grad_norm"]
    return rule


def _flag(row: dict[str, Any]) -> bool | None:
    for k in ("optim/step skipped", "skipped"):
        if k in row:
            return float(row[k]) > 0.5
    return None


def hold_step_counter(opt: torch.optim.Optimizer) -> dict[int, float]:
    """Adam's counters before an update (restored after it: `step_increment_bugfix=False`)."""
    return {id(p): float(st["step"]) for p, st in opt.state.items() if "step" in st}


def restore_step_counter(opt: torch.optim.Optimizer, held: dict[int, float]) -> None:
    for p, st in opt.state.items():
        if id(p) in held and "step" in st:
            st["step"].fill_(held[id(p)])
