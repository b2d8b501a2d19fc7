"""Detectors over a checkpoint diff (weights and Adam moments of a pair): each a pure
function `(DiffResult, Thresholds) -> list[Finding]`, registered in `DIFF_DETECTORS`.

One module per kind of evidence: `elements` (elements past the optimizer's bound, non-finite,
at their dtype's range), `magnitude` (how far the step moved each tensor), `experts` (each
expert of a fused MoE tensor: dead, standing out, back sign-like), `state` (the optimizer's and
trainer's state across the pair)."""

from __future__ import annotations

from collections.abc import Callable

from ckptforensics.detectors.base import Finding, Thresholds, with_id
from ckptforensics.detectors.diff.elements import (
    detect_corruption,
    detect_dtype_range,
    detect_nonfinite,
)
from ckptforensics.detectors.diff.experts import (
    detect_dead_experts,
    detect_expert_return,
    detect_expert_update_outlier,
)
from ckptforensics.detectors.diff.magnitude import (
    detect_gradient_burst,
    detect_lr,
    detect_sign_like,
    detect_update_ratio,
    detect_vanished_burst,
)
from ckptforensics.detectors.diff.state import (
    detect_optimizer_state_lost,
    detect_scaler_reset,
    detect_scheduler_restart,
    detect_skipped_steps,
)
from ckptforensics.engine.diff.pair import DiffResult

__all__ = ["DIFF_DETECTORS", "diff_findings"]


def diff_findings(diff: DiffResult, th: Thresholds | None = None) -> list[Finding]:
    """Every detector that needs no replay, over one diff; ids assigned in order."""
    th = th or Thresholds()
    raw: list[Finding] = []
    for det in DIFF_DETECTORS:
        raw.extend(det(diff, th))
    if diff.pair.weights_only:
        raw.append(
            Finding(
                "",
                "weights_only",
                "run",
                1.0,
                "info",
                {},
                "no optimizer state in the pair: weights compared among peers only, no update checked against the optimizer's bounds",
                "docs/signatures.md#adam-update-bound",
                (),
            )
        )
    return [with_id(f, i + 1) for i, f in enumerate(raw)]


DiffDetector = Callable[[DiffResult, Thresholds], list[Finding]]
# Every detector over a diff, in the order its findings are numbered.
DIFF_DETECTORS: tuple[DiffDetector, ...] = (
    detect_corruption,
    detect_nonfinite,
    detect_dtype_range,
    detect_skipped_steps,
    detect_lr,
    detect_update_ratio,
    detect_gradient_burst,
    detect_vanished_burst,
    detect_sign_like,
    detect_dead_experts,
    detect_expert_update_outlier,
    detect_expert_return,
    detect_optimizer_state_lost,
    detect_scheduler_restart,
    detect_scaler_reset,
)
