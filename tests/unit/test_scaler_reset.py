"""A loss scaler rebuilt at a resume (`detectors/diff/state.detect_scaler_reset`), judged by
GradScaler's own rule: the states here are written by torch's GradScaler itself, run on a
tiny parameter with the overflows planted (an inf gradient skips the step and backs off)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.diff.state import detect_scaler_reset

INTERVAL = 20


def _scaler(state: dict[str, Any] | None = None) -> torch.amp.GradScaler:
    s = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=INTERVAL)
    if state is not None:
        s.load_state_dict(state)
    return s


def _steps(scaler: torch.amp.GradScaler, n: int, overflow: set[int] = frozenset()) -> int:
    """n steps through the scaler; returns how many updates it applied."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    applied = 0
    for i in range(n):
        opt.zero_grad()
        scaler.scale((p * 1e-3).sum()).backward()
        if i in overflow:
            p.grad.fill_(float("inf"))
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        applied += i not in overflow
        assert (scaler.get_scale() < before) == (i in overflow)
    return applied


def _diff(a: dict[str, Any], b: dict[str, Any], applied: int, steps: int = 25) -> Any:
    pair = SimpleNamespace(
        step_a=25, step_b=25 + steps, scaler_a=a, scaler_b=b, loss_scale_a=a["scale"],
        loss_scale_b=b["scale"], adam_step_a=25, adam_step_b=25 + applied,
    )  # fmt: skip
    return SimpleNamespace(pair=pair)


def _before() -> dict[str, Any]:
    s = _scaler()
    _steps(s, 25)  # 2^16, one growth at 20 clean steps: 2^17, tracker 5
    return s.state_dict()


def test_a_scaler_that_ran_on_is_no_reset_with_or_without_overflows() -> None:
    a = _before()
    for overflow in (set(), {3}, {3, 12}):
        s = _scaler(a)
        applied = _steps(s, 25, overflow)
        assert detect_scaler_reset(_diff(a, s.state_dict(), applied), Thresholds()) == []


def test_a_scaler_rebuilt_at_the_resume_that_grew_back_to_the_same_scale_is_a_reset() -> None:
    """Held-out draws 9948, 9972: rebuilt at 2^16 at the resume, it grew once in 25 clean
    steps to *before*'s 2^17 with tracker 5, where *before*'s would be at 2^18, tracker 10."""
    a = _before()
    s = _scaler()
    applied = _steps(s, 25)
    assert s.state_dict()["scale"] == a["scale"]
    (f,) = detect_scaler_reset(_diff(a, s.state_dict(), applied), Thresholds())
    assert f.kind == "loss_scaler_reset" and f.metrics["resume_step"] == 25
    assert "tracker 10" in f.message


def test_a_scale_fallen_further_than_its_skips_halve_it_is_a_reset() -> None:
    a = _before()
    s = _scaler({**a, "scale": 2.0**14, "_growth_tracker": 0})  # rebuilt lower, then ran on
    applied = _steps(s, 10, {4})
    (f,) = detect_scaler_reset(_diff(a, s.state_dict(), applied, steps=10), Thresholds())
    assert "1 step(s) were skipped" in f.message
