"""The per-tensor kernel of the diff and its records: statistics of one tensor pair
(weights and Adam moments), streamed in flat chunks so memory stays near a few chunks.

Pure: no process, thread or rank logic (that is `diff` and `shard`, which both import this).
Every statistic is a sum, count or max that composes across chunks; element-level evidence
(bound violations) keeps at most `max_candidates` per tensor.

`records` holds the records, `chunks` the streaming and per-chunk statistics, `bounds` the
element-level evidence, `experts` the per-expert statistics of a fused MoE tensor, `tensor` the
kernel itself (`diff_tensor`).
"""

from __future__ import annotations

from ckptforensics.engine.diff.chunks import load_kernels, prefetch
from ckptforensics.engine.diff.records import (
    Candidate,
    DiffConfig,
    DiffResult,
    ExpertStats,
    PairInfo,
    TensorDiff,
    adam_step,
    scalar,
    tensor_family,
    tensor_role,
)
from ckptforensics.engine.diff.tensor import diff_tensor

__all__ = [
    "DiffConfig",
    "Candidate",
    "TensorDiff",
    "PairInfo",
    "DiffResult",
    "ExpertStats",
    "tensor_role",
    "tensor_family",
    "diff_tensor",
    "prefetch",
    "scalar",
    "adam_step",
    "load_kernels",
]
