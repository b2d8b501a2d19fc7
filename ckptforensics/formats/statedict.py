"""Building a Checkpoint view from an in-memory (memory-mapped) torch state dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.formats.base import Checkpoint, TensorMeta
from ckptforensics.formats.optstate import (
    AmbiguousMapping,
    map_optimizer,
    merge_optimizers,
    trainable_order,
)

__all__ = [
    "add_state_dict",
    "attach_optimizer",
    "map_in_order",
    "scaler_scalars",
    "scheduler_scalars",
    "to_plain",
]


def add_state_dict(ckpt: Checkpoint, sd: Mapping[str, Any], strip: str = "") -> None:
    """Expose the tensors of `sd`; tied tensors (same storage, same view) appear once."""
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for raw_name, t in sd.items():
        if not isinstance(t, torch.Tensor):
            continue
        name = raw_name[len(strip) :] if strip and raw_name.startswith(strip) else raw_name
        if t.numel() > 0:
            key = (
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
            )
            if key in seen:
                ckpt.aliases[name] = seen[key]
                continue
            seen[key] = name
        ckpt.add_tensor(name, TensorMeta(tuple(t.shape), t.dtype), _const(t))


def _const(t: torch.Tensor) -> Any:
    return lambda: t


def attach_optimizer(ckpt: Checkpoint, osd: Any, source: str) -> None:
    """Map an integer-id optimizer state_dict onto the checkpoint's own parameter order.

    A list of state_dicts is several optimizers over disjoint parameters (a Muon run's
    Muon for the hidden matrices and AdamW for the rest, saved as `optimizers=[...]`;
    Lightning's `optimizer_states`): read as one, each group keeping its optimizer's index.
    """
    if isinstance(osd, (list, tuple)):
        osd = (
            osd[0]
            if len(osd) == 1
            else merge_optimizers([dict(o) if isinstance(o, Mapping) else o for o in osd], source)
        )
    if not isinstance(osd, Mapping):
        raise CorruptCheckpoint(f"{source}: optimizer state is not a state_dict")
    names = ckpt.names() + list(ckpt.aliases)
    map_in_order(ckpt, osd, [n for n in names if ckpt.has(n)], source)


def map_in_order(ckpt: Checkpoint, osd: Mapping[str, Any], names: list[str], source: str) -> None:
    """Map an integer-id optimizer state_dict onto `names`, the parameters in the order the
    trainer handed them to its optimizer; a mapping the shapes leave ambiguous is kept
    pending (and said) for a model to settle."""
    order = trainable_order(names, lambda n: (ckpt.meta(n).shape, ckpt.meta(n).dtype), {})
    try:
        ckpt.optimizer = map_optimizer(dict(osd), order, source)
    except AmbiguousMapping as e:
        ckpt.pending_optimizer = e.pending
        ckpt.notes.append(f"{e}")


def to_plain(x: Any) -> Any:
    """Tensors of one element -> Python numbers, recursively; for scalars in reports."""
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else None
    if isinstance(x, Mapping):
        return {str(k): to_plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_plain(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(type(x).__name__)


def scaler_scalars(state: Any) -> dict[str, Any]:
    """GradScaler.state_dict() -> loss_scale and the scaler's settings."""
    if not isinstance(state, Mapping) or "scale" not in state:
        return {}
    plain = to_plain(dict(state))
    return {"loss_scale": plain.get("scale"), "scaler": plain}


def scheduler_scalars(state: Any) -> dict[str, Any]:
    """LR scheduler state: last step and last LRs (lambdas are not serialisable, so absent)."""
    if not isinstance(state, Mapping):
        return {}
    keep = {
        k: to_plain(state[k])
        for k in ("last_epoch", "base_lrs", "_last_lr", "_step_count")
        if k in state
    }
    return {"scheduler": keep} if keep else {}
