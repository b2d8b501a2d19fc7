"""Which settings a run trained with, answered in one place: the clip, the warm-up, the
schedule's length and the precision a configuration file states, each with its source.

`run_settings(ck, batches)` asks the trainer that wrote `ck` (its `clip` hook), then the keys
any reader may normalise a run's clip to in `train_config`, then the batch log, then every
trainer's `recorded` hook (its own configuration file beside the checkpoint), in the
registry's order. `audit` and the replay (`engine/replay/window.py`) both read it, so they
state the same clip for the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource
from ckptforensics.trainers import Recorded, config_clip, frameworks, hook
from ckptforensics.trainers.base import first_count, first_number

__all__ = ["RunSettings", "run_settings", "CLIP_KEYS"]

# Where a run's config may record its clip, as the format readers keep it (`train_config`).
CLIP_KEYS = ("grad_clip", "max_grad_norm", "gradient_clipping", "clip_grad")
# The generic sections' keys: what the format readers normalise a run's settings to
# (`train`: the reader's `train_config`; `model`: the model config; `training_args`: the
# arguments a reader kept whole).
_OFF_KEYS = (("train", "grad_clip"), ("train", "max_grad_norm"))
_WARMUP_KEYS = (("warmup_iters",),)  # in `train`
_TOTAL_KEYS = (
    ("train", "max_steps"),
    ("training_args", "max_steps"),
    ("model", "max_iters"),
    ("train", "max_iters"),
)


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What the run's own files say it trained with.

    Attributes:
        clip: the clip norm; None: no clipping (`clip_source` says where that is read) or
            not recorded (`clip_source` None).
        clip_source: where the clip is read; None: no file records one.
        warmup: warm-up steps, with `warmup_source` (None: not recorded).
        total_steps: the schedule's length in steps, when recorded.
        precision: the precision a trainer's configuration file states ('bf16', 'fp16'), with
            `precision_source` (the replay's precision resolver reads the checkpoint first).
        config: every configuration the run recorded, as sections (`train`, `model`, the
            arguments a reader kept whole, and each trainer's `recorded` file under its
            section name): for keys no trainer names (a z-loss coefficient).
    """

    clip: float | None = None
    clip_source: str | None = None
    warmup: int | None = None
    warmup_source: str | None = None
    total_steps: int | None = None
    precision: str | None = None
    precision_source: str | None = None
    config: dict[str, Any] = field(default_factory=dict)


def _recorded(ck: Checkpoint) -> list[Recorded]:
    """Every trainer's `recorded` file beside `ck`, in the registry's order."""
    out = []
    for mod in frameworks():
        fn = getattr(mod, "recorded", None)
        rec = fn(ck) if fn is not None else None
        if rec is not None:
            out.append(rec)
    return out


def _sections(ck: Checkpoint, recs: Sequence[Recorded]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "train": dict(ck.scalars.get("train_config") or {}),
        "model": dict(ck.config or {}),
    }
    if isinstance(ck.scalars.get("training_args"), dict):
        out["training_args"] = ck.scalars["training_args"]
    for rec in recs:
        out.setdefault(rec.section, rec.config)
    return out


def _clip(
    ck: Checkpoint,
    batches: BatchSource | None,
    sections: dict[str, Any],
    recs: Sequence[Recorded],
) -> tuple[float | None, str] | None:
    """The run's clip (None: off) and its source, first found: the trainer's `clip` hook, any
    clip key of `train_config`, the batch log's `grad_clip`, a clip key `train_config` holds
    as None (the reader found the setting unset: off), a trainer's recorded file."""
    fn = hook(ck, "clip")
    found = (fn(ck) if fn is not None else None) or config_clip(ck, CLIP_KEYS)
    if found is not None:
        return found
    if batches is not None and batches.grad_clip is not None:
        return (
            batches.grad_clip if batches.grad_clip > 0 else None
        ), "batch log attribute grad_clip"
    train = sections["train"]
    for sec, key in _OFF_KEYS:
        if key in train and train[key] is None:
            return None, f"{sec}.{key}"
    for rec in recs:
        if rec.clip is not None:
            return (rec.clip[0] if rec.clip[0] > 0 else None), rec.clip[1]
    return None


def _warmup(sections: dict[str, Any], recs: Sequence[Recorded]) -> tuple[int, str] | None:
    found = first_number("train", sections["train"], _WARMUP_KEYS)
    if found is not None:
        return int(found[0]), found[1]
    return next((r.warmup for r in recs if r.warmup is not None), None)


def _total(sections: dict[str, Any], recs: Sequence[Recorded]) -> int | None:
    found = first_count(sections, _TOTAL_KEYS)
    return found or next((r.total_steps for r in recs if r.total_steps is not None), None)


def run_settings(ck: Checkpoint, batches: BatchSource | None = None) -> RunSettings:
    """The settings the run recorded for `ck` (its files beside it, and `batches`, the batch
    log, where one is open)."""
    recs = _recorded(ck)
    sections = _sections(ck, recs)
    clip = _clip(ck, batches, sections, recs)
    warm = _warmup(sections, recs)
    prec = next((r.precision for r in recs if r.precision is not None), None)
    return RunSettings(
        clip=clip[0] if clip else None,
        clip_source=clip[1] if clip else None,
        warmup=warm[0] if warm else None,
        warmup_source=warm[1] if warm else None,
        total_steps=_total(sections, recs),
        precision=prec[0] if prec else None,
        precision_source=prec[1] if prec else None,
        config=sections,
    )
