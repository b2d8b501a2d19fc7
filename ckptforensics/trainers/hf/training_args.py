"""HF Trainer's `training_args.bin` (the TrainingArguments dataclass, pickled) read through the
inert unpickler, and the classes it pickles, registered with that unpickler's allowlist."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import UnsafeCheckpoint
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.inert import InertRecord, register_safe_globals
from ckptforensics.formats.torchfile import load_torch_file

__all__ = ["read_training_args"]

# HF Trainer's training_args.bin: the TrainingArguments dataclass, its str enums, and the
# accelerate state records it holds (transformers 4.4x-5.x), admitted as inert records.
register_safe_globals(
    [
        ("transformers.training_args", "TrainingArguments", InertRecord),
        ("transformers.training_args", "OptimizerNames", InertRecord),
        ("transformers.training_args", "ParallelMode", InertRecord),
        ("transformers.trainer_utils", "SchedulerType", InertRecord),
        ("transformers.trainer_utils", "IntervalStrategy", InertRecord),
        ("transformers.trainer_utils", "SaveStrategy", InertRecord),
        ("transformers.trainer_utils", "HubStrategy", InertRecord),
        ("transformers.trainer_utils", "FSDPOption", InertRecord),
        ("transformers.debug_utils", "DebugOption", InertRecord),
        ("transformers.trainer_pt_utils", "AcceleratorConfig", InertRecord),
        ("accelerate.state", "PartialState", InertRecord),
        ("accelerate.utils.dataclasses", "DistributedType", InertRecord),
    ]
)


# What a replay needs from TrainingArguments (transformers' own field names).
_TRAINING_ARGS = (
    "max_grad_norm",
    "learning_rate",
    "gradient_accumulation_steps",
    "per_device_train_batch_size",
    "seed",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "bf16",
    "fp16",
    "warmup_steps",
    "warmup_ratio",
    "max_steps",
)


def read_training_args(ckpt: Checkpoint, f: Path) -> None:
    """training_args.bin through the inert unpickler: the clip (`max_grad_norm`) and the
    batch settings. A class outside the allowlist is refused: said, and the rest is read."""
    try:
        obj, _ = load_torch_file(f)
    except UnsafeCheckpoint as e:
        ckpt.notes.append(f"training_args.bin not read: {e}")
        return
    fields = obj.as_dict() if hasattr(obj, "as_dict") else (obj if isinstance(obj, dict) else {})
    # Every plain field, for rebuilding the Trainer's dataloader (`replay.hfdata`).
    plain = {k: _plain_value(v) for k, v in fields.items()}
    ckpt.scalars["training_args"] = {k: v for k, v in plain.items() if v is not _NOT_PLAIN}
    tc = {k: fields[k] for k in _TRAINING_ARGS if isinstance(fields.get(k), (int, float, bool))}
    if "max_grad_norm" in tc:
        tc["grad_clip"] = float(tc["max_grad_norm"]) if tc["max_grad_norm"] > 0 else None
    # The Trainer's warmup: warmup_steps, else warmup_ratio of max_steps (its get_warmup_steps).
    if tc.get("warmup_steps"):
        tc["warmup_iters"] = int(tc["warmup_steps"])
    elif tc.get("warmup_ratio") and tc.get("max_steps", 0) > 0:
        tc["warmup_iters"] = math.ceil(tc["max_steps"] * tc["warmup_ratio"])
    ckpt.scalars["train_config"] = {**ckpt.scalars.get("train_config", {}), **tc}


_NOT_PLAIN = object()


def _plain_value(v: Any) -> Any:
    """A TrainingArguments field as plain data: scalars, strings, lists of them; str enums
    (pickled as a call with their value, an inert record here) by their value; else _NOT_PLAIN."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    args = getattr(v, "_args", None) if not isinstance(v, dict) else None  # an enum: its value
    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], str):
        return args[0]
    return _NOT_PLAIN
