"""`history`'s engine: every checkpoint of a run measured on one fixed batch (`forward`,
`batch`) and every consecutive pair diffed by the diff's kernel, streamed in one walk
(`follow.walk`), as per-module trajectories (`detectors.history.HistoryEvidence`)."""

from __future__ import annotations

from ckptforensics.engine.history.batch import FixedBatch, fixed_batch
from ckptforensics.engine.history.follow import HistoryConfig, HistoryResult, evidence, select, walk
from ckptforensics.engine.history.forward import CheckpointPass, Forward

__all__ = [
    "CheckpointPass",
    "FixedBatch",
    "Forward",
    "HistoryConfig",
    "HistoryResult",
    "evidence",
    "fixed_batch",
    "select",
    "walk",
]
