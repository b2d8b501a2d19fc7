"""An LR scheduler rebuilt at a resume (`detectors/diff/state.detect_scheduler_restart`): its
`last_epoch` ran backwards, or, stepped once per step, fell behind the optimizer steps applied
since (the states come from torch's own LambdaLR, stepped as a trainer steps it)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.diff.state import detect_scheduler_restart


def _state(steps: int) -> dict[str, Any]:
    """A per-step LambdaLR's state after `steps` optimizer steps (warm-up over 10)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10))
    for _ in range(steps):
        opt.step()
        sched.step()
    return sched.state_dict()


def _diff(a: dict[str, Any], b: dict[str, Any], applied: int = 25) -> Any:
    pair = SimpleNamespace(
        scheduler_a=a, scheduler_b=b, step_a=25, step_b=50, adam_step_a=25,
        adam_step_b=25 + applied, lr_a=[], lr_b=[],
    )  # fmt: skip
    return SimpleNamespace(pair=pair)


def test_a_scheduler_that_ran_on_is_no_restart() -> None:
    assert detect_scheduler_restart(_diff(_state(25), _state(50)), Thresholds()) == []


def test_a_scheduler_rebuilt_as_many_steps_before_after_as_before_had_is_a_restart() -> None:
    """Held-out draws 9860, 9886: rebuilt at step 25 and stepped 25 times by step 50, its
    last_epoch is 25 at both ends: not gone back, but 25 optimizer steps behind."""
    (f,) = detect_scheduler_restart(_diff(_state(25), _state(25)), Thresholds())
    assert f.kind == "lr_scheduler_restarted" and f.metrics["resume_step"] == 25
    assert "plus 25 optimizer steps would make 50" in f.message


def test_an_epoch_scheduler_that_stood_still_within_an_epoch_is_no_restart() -> None:
    """last_epoch 1 at step 25 counts epochs, not steps: still 1 at step 50 is one epoch."""
    assert detect_scheduler_restart(_diff(_state(1), _state(1)), Thresholds()) == []


def test_steps_a_loss_scaler_skipped_are_not_a_lag() -> None:
    """The HF Trainer steps its scheduler only where the optimizer stepped: 3 skipped steps
    leave last_epoch 3 short of the trainer's step, as the optimizer's counter is."""
    assert detect_scheduler_restart(_diff(_state(25), _state(47), applied=22), Thresholds()) == []
