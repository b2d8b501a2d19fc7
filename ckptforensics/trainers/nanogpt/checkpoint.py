"""nanoGPT's `ckpt.pt`: `model` (keys under `_orig_mod.` when torch.compile'd), `optimizer`,
`model_args`, `iter_num` and `config` (train.py's globals), a flavour of torch.save file
registered with `formats.torchsave`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.statedict import add_state_dict, attach_optimizer, to_plain
from ckptforensics.formats.torchsave import register_flavour

__all__ = ["is_nanogpt_object", "read_nanogpt"]


def is_nanogpt_object(obj: Mapping[str, Any]) -> bool:
    return "model" in obj and ("model_args" in obj or "iter_num" in obj)


def read_nanogpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    # torch.compile'd models save their keys under `_orig_mod.`.
    add_state_dict(ckpt, obj["model"], strip="_orig_mod.")
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


# Asked after LitGPT's (whose files hold `model` and `iter_num` too).
register_flavour("nanogpt", is_nanogpt_object, read_nanogpt, order=30)
