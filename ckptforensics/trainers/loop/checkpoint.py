"""LitGPT's `step-N/lit_model.pth`, a flavour of torch.save file registered with
`formats.torchsave`, and its side files: `model_config.yaml` (the litgpt.Config) and
`hyperparameters.yaml` (the run's arguments), read here for the reader and for `recorded`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.statedict import add_state_dict, attach_optimizer
from ckptforensics.formats.torchsave import register_flavour

__all__ = ["is_litgpt_object", "read_litgpt", "hyperparameters"]

log = logging.getLogger(__name__)


def is_litgpt_object(obj: Mapping[str, Any]) -> bool:
    return (
        "model" in obj and "step_count" in obj and ("iter_num" in obj or "train_dataloader" in obj)
    )


def read_litgpt(ckpt: Checkpoint, obj: Mapping[str, Any]) -> None:
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
    hp = hyperparameters(ckpt.path)
    if hp is not None:
        train = hp.get("train") if isinstance(hp.get("train"), dict) else {}
        opt = hp.get("optimizer") if isinstance(hp.get("optimizer"), dict) else {}
        init = opt.get("init_args") if isinstance(opt.get("init_args"), dict) else {}
        tc = {"grad_clip": train.get("max_norm"), "learning_rate": init.get("lr")}
        ckpt.scalars["train_config"] = {k: v for k, v in tc.items() if v is not None}


def hyperparameters(path: Path) -> dict[str, Any] | None:
    """LitGPT's `hyperparameters.yaml` (the run's arguments) in the checkpoint directory
    `path`, or beside the checkpoint file `path`; None when absent, unreadable or not a mapping."""
    doc = _yaml((path if path.is_dir() else path.parent) / "hyperparameters.yaml")
    return doc if isinstance(doc, dict) else None


def _yaml(path: Path) -> Any:
    """A YAML side file read as data (safe_load: no tags, no objects); None if absent or
    unreadable (the settings it holds stay unknown)."""
    if not path.is_file():
        return None
    try:
        import yaml  # PyYAML: optional (it comes with LitGPT, Lightning and transformers)

        return yaml.safe_load(path.read_text())
    except Exception:  # no PyYAML, or a side file it cannot read: its settings stay unknown
        log.debug("%s not read", path, exc_info=True)
        return None


# Asked before nanoGPT's (its files hold `model` and `iter_num` too), after Lightning's.
register_flavour("litgpt", is_litgpt_object, read_litgpt, order=20)
