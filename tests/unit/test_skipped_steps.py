"""Optimizer steps that trail the trainer's (`detectors/diff/state.detect_skipped_steps`):
read as a loss scaler's backoffs only where the run has a loss scaler."""

from __future__ import annotations

from types import SimpleNamespace

from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.diff.state import detect_skipped_steps


def _pair(scale_a: float | None, scale_b: float | None) -> SimpleNamespace:
    pair = SimpleNamespace(
        step_a=50, step_b=60, adam_step_a=50, adam_step_b=56, skip_optimizer=None,
        loss_scale_a=scale_a, loss_scale_b=scale_b,
    )  # fmt: skip
    return SimpleNamespace(pair=pair)


def test_without_a_scaler_the_trail_is_no_fp16_overflow() -> None:
    (f,) = [
        f
        for f in detect_skipped_steps(_pair(None, None), Thresholds())
        if f.kind == "skipped_steps"
    ]
    assert f.supports == () and "no loss scaler" in f.message
    assert f.metrics == {"trainer_steps": 10, "optimizer_steps": 6}


def test_under_a_scaler_four_skips_in_ten_steps_are_overflows() -> None:
    found = detect_skipped_steps(_pair(65536.0, 4096.0), Thresholds())
    (f,) = [f for f in found if f.kind == "skipped_steps"]
    assert "fp16_overflow" in f.supports and "under a loss scaler" in f.message
