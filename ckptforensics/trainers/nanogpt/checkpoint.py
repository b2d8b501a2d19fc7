"""nanoGPT's `ckpt.pt`: `model` (keys under `_orig_mod.` when torch.compile'd), `optimizer`,
`model_args`, `iter_num` and `config` (train.py's globals); and modded-nanogpt's
`state_stepNNNNNN.pt`: `step`, `code` (train_gpt.py's own source), `model` (compiled: keys
under `_orig_mod.`) and `optimizers` (Muon's and Adam's state_dicts, each with its own ids
0..n-1); flavours of torch.save file registered with `formats.torchsave`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.statedict import add_state_dict, attach_optimizer, to_plain
from ckptforensics.formats.torchsave import register_flavour

__all__ = [
    "is_nanogpt_object",
    "read_nanogpt",
    "is_modded_nanogpt_object",
    "read_modded_nanogpt",
]

# What torch.compile's wrapper puts before every key of the model it wraps.
_COMPILED = "_orig_mod."


def is_nanogpt_object(obj: Mapping[str, Any]) -> bool:
    return "model" in obj and ("model_args" in obj or "iter_num" in obj)


def read_nanogpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    # torch.compile'd models save their keys under `_orig_mod.`.
    add_state_dict(ckpt, obj["model"], strip=_COMPILED)
    if isinstance(obj.get("optimizer"), Mapping):
        attach_optimizer(ckpt, obj["optimizer"], f"{ckpt.path}:optimizer")
    elif isinstance(obj.get("optimizers"), (list, tuple)) and obj["optimizers"]:
        attach_optimizer(ckpt, list(obj["optimizers"]), f"{ckpt.path}:optimizers")
    if "iter_num" in obj:
        ckpt.scalars["global_step"] = int(obj["iter_num"])
    cfg = to_plain(obj.get("model_args"))
    ckpt.config = cfg if isinstance(cfg, dict) else None
    train_cfg = to_plain(obj.get("config"))
    if isinstance(train_cfg, dict):
        ckpt.scalars["train_config"] = train_cfg


def is_modded_nanogpt_object(obj: Mapping[str, Any]) -> bool:
    """modded-nanogpt's train_gpt.py saves `dict(step=step, code=code, model=...,
    optimizers=[...])`: the script's source beside the weights is its mark."""
    return (
        isinstance(obj.get("model"), Mapping) and isinstance(obj.get("code"), str) and "step" in obj
    )


def read_modded_nanogpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    """The weights under their module names, every optimizer's state mapped to them (each
    state_dict's ids are positions in its own param groups: `attach_optimizer` merges the
    list), the step; the code is not read (it is the run's script, never run here)."""
    add_state_dict(ckpt, obj["model"], strip=_COMPILED)
    opts = obj.get("optimizers")
    if isinstance(opts, (list, tuple)) and opts:
        attach_optimizer(ckpt, list(opts), f"{ckpt.path}:optimizers")
    elif isinstance(obj.get("optimizer"), Mapping):
        attach_optimizer(ckpt, obj["optimizer"], f"{ckpt.path}:optimizer")
    step = obj["step"]
    if isinstance(step, (int, float)) and not isinstance(step, bool):
        ckpt.scalars["global_step"] = int(step)
    if isinstance(obj.get("training_time_ms"), (int, float)):
        ckpt.scalars["training_time_ms"] = float(obj["training_time_ms"])


# Asked after LitGPT's (whose files hold `model` and `iter_num` too).
register_flavour("nanogpt", is_nanogpt_object, read_nanogpt, order=30)
# Asked before the plain torch.save file (its `model` and `step` would read as one, its keys
# under `_orig_mod.`).
register_flavour("modded_nanogpt", is_modded_nanogpt_object, read_modded_nanogpt, order=31)
