"""Optimizer steps that trail the trainer's (`detectors/diff/state.detect_skipped_steps`):
a loss scaler's backoffs where the pair records one; where it records none (nanoGPT saves no
scaler state, so an fp16 run's pair looks the same as an fp32 loop's) the finding says both."""

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


def test_without_a_recorded_scaler_the_message_says_so() -> None:
    (f,) = [
        f
        for f in detect_skipped_steps(_pair(None, None), Thresholds())
        if f.kind == "skipped_steps"
    ]
    assert "neither checkpoint records a scaler" in f.message and "non-finite" in f.message
    assert f.metrics == {"trainer_steps": 10, "optimizer_steps": 6}


def test_under_a_scaler_four_skips_in_ten_steps_are_overflows() -> None:
    found = detect_skipped_steps(_pair(65536.0, 4096.0), Thresholds())
    (f,) = [f for f in found if f.kind == "skipped_steps"]
    assert "fp16_overflow" in f.supports and "under a loss scaler)" in f.message
