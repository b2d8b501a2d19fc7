"""Lightning `.ckpt` files: a flavour of torch.save file registered with `formats.torchsave`
(`state_dict`, `optimizer_states`, `lr_schedulers`, the precision plugin's scaler state,
`hyper_parameters`), and the classes Lightning pickles into them, admitted by the restricted
unpickler as inert stand-ins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.inert import InertDict, register_safe_globals
from ckptforensics.formats.statedict import (
    add_state_dict,
    attach_optimizer,
    scaler_scalars,
    scheduler_scalars,
    to_plain,
)
from ckptforensics.formats.torchsave import register_flavour

__all__ = ["is_lightning_object", "read_lightning"]

# Lightning's AttributeDict (its `hyper_parameters`), under each package name it has had.
register_safe_globals(
    [
        ("lightning.fabric.utilities.data", "AttributeDict", InertDict),
        ("lightning_fabric.utilities.data", "AttributeDict", InertDict),
        ("pytorch_lightning.utilities.parsing", "AttributeDict", InertDict),
    ]
)


def is_lightning_object(obj: Mapping[str, Any]) -> bool:
    return "state_dict" in obj and (
        "optimizer_states" in obj or "pytorch-lightning_version" in obj or "loops" in obj
    )


def read_lightning(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    add_state_dict(ckpt, obj["state_dict"])
    opts = obj.get("optimizer_states") or []
    if opts:
        attach_optimizer(ckpt, list(opts), f"{ckpt.path}:optimizer_states")
    if "global_step" in obj:
        ckpt.scalars["global_step"] = int(obj["global_step"])
    if "epoch" in obj:
        ckpt.scalars["epoch"] = int(obj["epoch"])
    for key in ("MixedPrecision", "MixedPrecisionPlugin", "native_amp_scaling_state"):
        ckpt.scalars.update(scaler_scalars(obj.get(key)))
    scheds = obj.get("lr_schedulers") or []
    if scheds:
        ckpt.scalars.update(scheduler_scalars(scheds[0]))
    hp = (
        to_plain(dict(obj["hyper_parameters"]))
        if isinstance(obj.get("hyper_parameters"), Mapping)
        else None
    )
    ckpt.config = hp


# Asked first of the flavours: its files may hold any of the others' keys beside `state_dict`.
register_flavour("lightning", is_lightning_object, read_lightning, order=10)
