"""torch.save files: plain state dicts, and the flavours trainers register (`register_flavour`:
a test on the file's top-level keys and a reader; each trainer's `checkpoint.py` registers its
own, which the format registry then knows by the flavour's name)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import UnknownFormat
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.registry import register
from ckptforensics.formats.statedict import (
    add_state_dict,
    attach_optimizer,
    scaler_scalars,
    scheduler_scalars,
    to_plain,
)
from ckptforensics.formats.torchfile import load_torch_file, torch_file_completeness

__all__ = ["open_torch_file", "sniff_torch_object", "register_flavour", "torch_flavours"]

_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt")
# Several optimizers saved as a list (modded-nanogpt's Muon runs: `optimizers=[...]`).
_OPTIMS_KEYS = ("optimizers", "optimizer_states", "optimizer_state_dicts")
_STEP_KEYS = ("global_step", "step", "iteration", "iter_num", "steps")


# A flavour's test (the loaded object, a Mapping -> is it this flavour) and its reader
# (fills the Checkpoint from the object).
FlavourTest = Callable[[Mapping[str, Any]], bool]
FlavourReader = Callable[[Checkpoint, Mapping[str, Any]], None]

# name -> (its place among the flavours' tests, lower asked first; test; reader).
_FLAVOURS: dict[str, tuple[float, FlavourTest, FlavourReader]] = {}


def register_flavour(name: str, test: FlavourTest, read: FlavourReader, *, order: float) -> None:
    """Add a trainer's flavour of torch.save file: `test(obj)` on the loaded top-level mapping
    (asked in `order`, before the plain state-dict checks), `read(ckpt, obj)` to fill the view;
    and a format of the same name (`--format name`) that opens and checks such a file."""
    if name in _FLAVOURS or name == "torch":
        raise ValueError(f"torch.save flavour {name!r} is already registered")
    _FLAVOURS[name] = (order, test, read)
    register(
        name,
        lambda p: open_torch_file(p, name),
        complete=lambda p: torch_file_completeness(p, name),
    )


def torch_flavours() -> tuple[str, ...]:
    """The names of the torch.save readers: plain `torch` and every registered flavour."""
    return ("torch", *_FLAVOURS)


def sniff_torch_object(obj: Any) -> str:
    """Which flavour of torch.save file this is, from its top-level keys."""
    if not isinstance(obj, Mapping):
        return "unknown"
    for name, (_, test, _read) in sorted(_FLAVOURS.items(), key=lambda kv: kv[1][0]):
        if test(obj):
            return name
    if any(isinstance(obj.get(k), Mapping) for k in _MODEL_KEYS):
        return "torch"
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return "torch"
    return "unknown"


def open_torch_file(path: Path, want: str | None = None) -> Checkpoint:
    """Open a torch.save checkpoint file of any supported flavour."""
    obj, mapped = load_torch_file(path)
    kind = sniff_torch_object(obj)
    if want is not None and want != kind and not (want == "torch" and kind != "unknown"):
        raise UnknownFormat(f"{path}: looks like a {kind!r} file, not {want!r}")
    if kind == "unknown":
        raise UnknownFormat(
            f"{path}: a torch file without a recognisable state dict (keys: {_keys(obj)}); "
            "expected model/state_dict tensors"
        )
    ckpt = Checkpoint(path=path, format=kind, file_backed=mapped)
    read = _FLAVOURS[kind][2] if kind in _FLAVOURS else _plain
    read(ckpt, obj)
    if ckpt.optimizer is None:
        ckpt.notes.append("no optimizer state in this checkpoint: weights only")
    return ckpt


def _keys(obj: Any) -> str:
    if isinstance(obj, Mapping):
        return ", ".join(map(str, list(obj)[:8])) or "none"
    return type(obj).__name__


def _plain(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    model = next((obj[k] for k in _MODEL_KEYS if isinstance(obj.get(k), Mapping)), obj)
    add_state_dict(ckpt, model)
    osd = next((obj[k] for k in _OPTIM_KEYS if isinstance(obj.get(k), Mapping)), None)
    if osd is None:
        key = next(
            (k for k in _OPTIMS_KEYS if isinstance(obj.get(k), (list, tuple)) and obj[k]), None
        )
        osd = obj[key] if key is not None else None
    if osd is not None:
        attach_optimizer(ckpt, osd, f"{ckpt.path}:optimizer")
    for k in _STEP_KEYS:
        if isinstance(obj.get(k), (int, float)) and not isinstance(obj.get(k), bool):
            ckpt.scalars["global_step"] = int(obj[k])
            break
    for k in ("scaler", "grad_scaler", "scaler_state_dict"):
        ckpt.scalars.update(scaler_scalars(obj.get(k)))
    for k in ("scheduler", "lr_scheduler", "scheduler_state_dict"):
        ckpt.scalars.update(scheduler_scalars(obj.get(k)))
    for k in ("model_config", "model_args", "config"):
        cfg = to_plain(obj.get(k)) if isinstance(obj.get(k), Mapping) else None
        if isinstance(cfg, dict):
            ckpt.config = cfg
            break
