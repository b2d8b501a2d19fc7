"""torch.save files: plain state dicts, nanoGPT `ckpt.pt` and Lightning `.ckpt`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import UnknownFormat
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.statedict import (
    add_state_dict,
    attach_optimizer,
    scaler_scalars,
    scheduler_scalars,
    to_plain,
)
from ckptforensics.formats.torchfile import load_torch_file

__all__ = ["open_torch_file", "sniff_torch_object"]

_MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")
_OPTIM_KEYS = ("optimizer", "optimizer_state_dict", "optim", "opt")
# Several optimizers saved as a list (modded-nanogpt's Muon runs: `optimizers=[...]`).
_OPTIMS_KEYS = ("optimizers", "optimizer_states", "optimizer_state_dicts")
_STEP_KEYS = ("global_step", "step", "iteration", "iter_num", "steps")


def sniff_torch_object(obj: Any) -> str:
    """Which flavour of torch.save file this is, from its top-level keys."""
    if not isinstance(obj, Mapping):
        return "unknown"
    if "state_dict" in obj and (
        "optimizer_states" in obj or "pytorch-lightning_version" in obj or "loops" in obj
    ):
        return "lightning"
    if "model" in obj and "step_count" in obj and ("iter_num" in obj or "train_dataloader" in obj):
        return "litgpt"
    if "model" in obj and ("model_args" in obj or "iter_num" in obj):
        return "nanogpt"
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
    {"lightning": _lightning, "nanogpt": _nanogpt, "litgpt": _litgpt, "torch": _plain}[kind](
        ckpt, obj
    )
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


def _nanogpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
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


def _lightning(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
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


def _litgpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
    """LitGPT `step-N/lit_model.pth`: `model`, `optimizer` (torch AdamW, int ids),
    `iter_num` (micro-batches), `step_count` (optimizer steps); beside it
    `model_config.yaml` (the litgpt.Config) and `hyperparameters.yaml` (the run's arguments)."""
    add_state_dict(ckpt, obj["model"])
    if isinstance(obj.get("optimizer"), Mapping):
        attach_optimizer(ckpt, obj["optimizer"], f"{ckpt.path}:optimizer")
    ckpt.scalars["global_step"] = int(obj["step_count"])
    if isinstance(obj.get("iter_num"), int):
        ckpt.scalars["iter_num"] = int(obj["iter_num"])
    cfg = _yaml(ckpt.path.parent / "model_config.yaml")
    if isinstance(cfg, dict):
        ckpt.config = cfg
    hp = _yaml(ckpt.path.parent / "hyperparameters.yaml")
    if isinstance(hp, dict):
        train = hp.get("train") if isinstance(hp.get("train"), dict) else {}
        opt = hp.get("optimizer") if isinstance(hp.get("optimizer"), dict) else {}
        init = opt.get("init_args") if isinstance(opt.get("init_args"), dict) else {}
        tc = {"grad_clip": train.get("max_norm"), "learning_rate": init.get("lr")}
        ckpt.scalars["train_config"] = {k: v for k, v in tc.items() if v is not None}


def _yaml(path: Path) -> Any:
    """A YAML side file read as data (safe_load: no tags, no objects); None if absent."""
    if not path.is_file():
        return None
    try:
        import yaml
    except ImportError:  # PyYAML comes with lightning/transformers; without it, say so
        return None
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return None
