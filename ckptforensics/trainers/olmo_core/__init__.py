"""OLMo-core: experiment config keys (`train_module.max_grad_norm`, `train_module.optim.lr`,
`trainer.load_path`), from the `config.json` its ConfigSaverCallback writes beside every step.

`trainer.load_path` with `load_strategy: always` loads that step's `model_and_optim/` and
`train/` state (data loader position included). The scheduler sets each group's LR from the
group's `initial_lr`, a field the optimizer config keeps fixed (`fixed_fields`), which the
checkpoint's optimizer state restores: check the LR the resumed run logs (`recovery` does).

For a replay: the model is the reference OLMo-core `Transformer` built from `config.json`'s
model section (`trainers/<t>/model.py`), and `--data` rebuilds a NumpyFSLDataset's batches from
the seed and the data loader's state (`trainers/olmo_core/data.py`). Its SkipStepAdamW is followed
by `trainers/olmo_core/skipstep.py` (from the optimizer config the format reader keeps).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptforensics.core.callables import ModelSpecError
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource
from ckptforensics.formats.locate import STEP_N
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Recorded,
    Settings,
    Skip,
    config_clip,
    first_number,
    flatten,
    key_diff,
    lr_fix_edit,
    skip_json,
)
from ckptforensics.trainers.olmo_core import model as reference
from ckptforensics.trainers.olmo_core.data import is_olmo_checkpoint, olmo_batches

if TYPE_CHECKING:
    from torch import nn

NAME = "olmo_core"
TITLE = "OLMo-core"
# The names it gives its checkpoints (`stepN`: the plain name, the step as its one group) and
# their place in `formats.locate`'s listing.
STEP_NAMES = (("OLMo-core", STEP_N, 4.1),)


def _config_file(path: Path) -> Path | None:
    for d in (path, path.parent):
        f = d / "config.json"
        if f.is_file():
            return f
    return None


def owns(ck: Checkpoint) -> bool:
    f = _config_file(Path(ck.path)) if ck.format == "dcp" else None
    return (
        f is not None
        and isinstance(ck.config, dict)
        and str(ck.config.get("_CLASS_", "")).startswith("olmo_core.")
    )


def settings(ck: Checkpoint) -> Settings:
    f = _config_file(Path(ck.path))
    doc: dict[str, Any] = {}
    if f is not None:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            doc = {}
    flat = {
        k: v
        for k, v in flatten(
            {k: doc[k] for k in ("train_module", "trainer") if isinstance(doc.get(k), dict)}
        ).items()
        if not isinstance(v, list)
    }
    return Settings(str(f) if f else None, flat, str(Path(ck.path).parent))


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [
            Edit("train_module.max_grad_norm", v.get("train_module.max_grad_norm"), float(value))
        ]
    if knob == "eps":
        return [Edit("train_module.optim.eps", v.get("train_module.optim.eps"), float(value))]
    if knob == "precision":
        dtype = {"bf16": "bfloat16", "fp32": None, "fp16": "float16"}[str(value)]
        return [
            Edit("train_module.autocast_precision", v.get("train_module.autocast_precision"), dtype)
        ]
    if knob == "lr_scale":
        lr = v.get("train_module.optim.lr")
        return [
            Edit(
                "train_module.optim.lr",
                lr,
                lr * float(value) if isinstance(lr, (int, float)) else None,
                "the restored groups keep their initial_lr: check the logged LR",
            )
        ]
    if knob == "lr_fix":
        return [
            lr_fix_edit(
                value,
                "a group override (optim.group_overrides lr) is the likely source: fix its factor",
            )
        ]
    return []


def render(edits: Sequence[Edit], s: Settings) -> str:
    return key_diff(
        s.source,
        [e for e in edits if not e.key.startswith(LR_FIX_PREFIX)],
        lambda k, val: f'  "{k}": {json.dumps(val)}',
    )


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    return Skip(
        "skip.json",
        skip_json(steps, sample_ids, rows),
        "OLMo-core has no skip list: drop these instance indices from the NumpyFSLDataset order your data loader builds",
    )


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    return [
        Edit("trainer.load_path", s.values.get("trainer.load_path"), str(rollback)),
        Edit("trainer.load_strategy", s.values.get("trainer.load_strategy"), "always"),
    ]


# ----------------------------------------------------------------------------- the replay's hooks
# MetricSaverCallback / its trainer's metric names (per group LR: logs.columns' "optim/LR (group N)").
LOG_NAMES = {"loss": ("train/CE loss",), "grad_norm": ("optim/total grad norm",)}


def model(ck: Checkpoint) -> tuple[nn.Module, str] | None:
    """The reference OLMo-core 3.0 `Transformer` from config.json's model section."""

    if not reference.is_olmo_model_config(ck.config):
        return None
    try:
        return reference.olmo_transformer(ck.config)
    except reference.ReferenceError as e:
        raise ModelSpecError(f"{ck.path}: {e}; pass --model module:factory") from None


def batches(data: str, ck: Checkpoint, collator: str | None) -> list[BatchSource] | None:
    """The epoch's order from the seed and `train/rank0.pt`, as its data loader shuffled."""

    return [olmo_batches(data, ck.path)] if is_olmo_checkpoint(ck.path) else None


def clip(ck: Checkpoint) -> tuple[float | None, str] | None:
    return config_clip(
        ck, ("grad_clip",)
    )  # train_module.max_grad_norm, as its checkpoint.py reads it


def _experiment(path: Path) -> dict[str, Any] | None:
    """The experiment config.json (one with a `train_module`) in `path` or its folder."""
    for d in (path, path.parent):
        f = d / "config.json"
        if d.is_dir() and f.is_file():
            try:
                doc = json.loads(f.read_text())
            except (OSError, ValueError):
                doc = None
            if isinstance(doc, dict) and "train_module" in doc:
                return doc
    return None


def _steps(duration: Any) -> int | None:
    """A `Duration` in steps (`{"unit": "steps", "value": N}`)."""
    if isinstance(duration, dict) and duration.get("unit") == "steps":
        v = duration.get("value")
        return int(v) if isinstance(v, int) else None
    return None


def recorded(ck: Checkpoint) -> Recorded | None:
    """The experiment config.json: `train_module.max_grad_norm`, the scheduler's warm-up,
    `trainer.max_duration` in steps."""

    doc = _experiment(Path(ck.path))
    if doc is None:
        return None
    warm = first_number(
        "olmo",
        doc,
        (("train_module", "scheduler", "warmup"), ("train_module", "scheduler", "warmup_steps")),
    )
    trainer = doc.get("trainer")
    return Recorded(
        "olmo",
        doc,
        clip=first_number("olmo", doc, (("train_module", "max_grad_norm"),)),
        warmup=(int(warm[0]), warm[1]) if warm else None,
        total_steps=_steps(trainer.get("max_duration")) if isinstance(trainer, dict) else None,
    )
