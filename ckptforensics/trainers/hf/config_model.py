"""A model built with transformers from an HF `config.json`: the checkpoint's own (its `config`,
when it has a `model_type`) or the one `--model` names (a file, or a directory holding one). The
replay builds it for any run whose model it cannot otherwise build (`engine/replay/model.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ckptforensics.core.callables import ModelSpecError
from ckptforensics.formats.base import Checkpoint

if TYPE_CHECKING:
    from torch import nn

__all__ = ["config_model"]


def config_model(spec: str | None, ckpt: Checkpoint) -> nn.Module:
    if spec is not None:
        path = Path(spec)
        cfg = json.loads((path if path.is_file() else path / "config.json").read_text())
    elif ckpt.config and "model_type" in ckpt.config:
        cfg = ckpt.config
    else:
        raise ModelSpecError(
            f"{ckpt.path}: no config.json to build the model from; pass --model module:factory"
        )
    try:
        import transformers
    except ImportError:
        raise ModelSpecError(
            "building the model from config.json needs transformers: pip install 'ckptforensics[hf]'"
        ) from None
    try:
        config = transformers.AutoConfig.for_model(**cfg)
        archs = cfg.get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs else None
        return (
            cls(config)
            if cls is not None
            else transformers.AutoModelForCausalLM.from_config(config)
        )
    except Exception as e:  # a config transformers cannot build
        raise ModelSpecError(
            f"cannot build the model from config.json ({type(e).__name__}: {e})"
        ) from None
