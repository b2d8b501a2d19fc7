"""One checkpoint at a glance (for `inspect`): sizes, dtypes, optimizer, scaler, headroom."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptforensics.core.tensors import dtype_limits, dtype_name
from ckptforensics.formats.base import Checkpoint

__all__ = ["TensorSummary", "CheckpointSummary", "summarize"]


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """Per-tensor facts: non-finite count and max|x| against the dtype's max."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nonfinite: int
    max_abs: float
    headroom: float  # dtype max / max|x|


@dataclass(slots=True)
class CheckpointSummary:
    path: str
    format: str
    step: int | None
    parameters: int
    tensors: int
    dtypes: dict[str, int]
    optimizer: dict[str, Any] | None
    scalars: dict[str, Any]
    notes: list[str]
    per_tensor: list[TensorSummary] = field(default_factory=list)


def _scan(ckpt: Checkpoint, name: str, chunk: int) -> TensorSummary:
    meta = ckpt.meta(name)
    lim = dtype_limits(meta.dtype)
    nonfinite, mx = 0, 0.0
    if lim is not None and meta.numel:
        flat = ckpt.tensor(name).reshape(-1)
        for lo in range(0, flat.numel(), chunk):
            part = flat[lo : lo + chunk]
            a = part.float().abs()
            fin = torch.isfinite(a)
            nonfinite += int((~fin).sum())
            mx = max(mx, float(torch.where(fin, a, 0).max()))
            ckpt.release(part)
    head = (lim.max / mx) if lim and mx > 0 else math.inf
    return TensorSummary(name, meta.shape, dtype_name(meta.dtype), nonfinite, mx, head)


def summarize(
    ckpt: Checkpoint, chunk: int = 1 << 22, progress: Callable[[str], None] | None = None
) -> CheckpointSummary:
    """Read every tensor once (streamed) and summarise the checkpoint."""
    names = ckpt.names()
    per = []
    for n in names:
        if progress is not None:
            progress(n)
        per.append(_scan(ckpt, n, chunk))
    opt = None
    if ckpt.optimizer is not None:
        o = ckpt.optimizer
        steps = [
            float(s["step"])
            for s in o.state.values()
            if isinstance(s.get("step"), (torch.Tensor, int, float))
        ]
        opt = {
            "kind": o.kind,
            "mapping": o.mapping,
            "step": int(max(steps)) if steps else None,
            "params_with_state": len(o.state),
            "groups": [
                {
                    "family": g.family,
                    "implementation": g.options.get("implementation") or None,
                    "optimizer": g.optimizer,
                    "lr": g.lr,
                    "betas": list(g.betas) if g.betas else None,
                    "eps": g.eps,
                    "weight_decay": g.weight_decay,
                    "initial_lr": g.initial_lr,
                    "params": sum(1 for h in o.hyper.values() if h.index == g.index),
                }
                for g in o.groups
            ],
        }
    scalars = {k: v for k, v in ckpt.scalars.items() if k != "log_history_tail"}
    return CheckpointSummary(
        path=str(ckpt.path),
        format=ckpt.format,
        step=ckpt.step,
        parameters=sum(ckpt.meta(n).numel for n in names if ckpt.meta(n).dtype.is_floating_point),
        tensors=len(names),
        dtypes=dict(Counter(dtype_name(ckpt.meta(n).dtype) for n in names)),
        optimizer=opt,
        scalars=scalars,
        notes=list(ckpt.notes),
        per_tensor=per,
    )
