"""nanoGPT's train.py: its config globals (`grad_clip`, `learning_rate`, `dtype`,
`init_from = 'resume'`), as the checkpoint's `config` dict records them.

train.py resumes from `out_dir/ckpt.pt` only (`init_from = 'resume'`), restoring the model,
the optimizer and `iter_num`; its `get_lr(iter_num)` recomputes the LR from the config every
step, so a new `learning_rate` takes effect at once.

For a replay its config says the clip (`grad_clip`) and the precision (`dtype`: autocast, with
a GradScaler for float16); the model comes from `--model` (called with `model_args`), the
batches from a batch log or the flight recorder (`get_batch` draws random offsets).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Settings,
    Skip,
    config_clip,
    key_diff,
    lr_fix_edit,
    skip_json,
)

NAME = "nanogpt"
TITLE = "nanoGPT train.py"
# The conventions the replay cites it for (`trainers.convention_of`): train.py logs `lossf`,
# the last micro-batch's loss.
CONVENTIONS = {"last_micro_batch_loss": "nanoGPT's lossf"}

_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def owns(ck: Checkpoint) -> bool:
    return ck.format == "nanogpt" and isinstance(ck.scalars.get("train_config"), dict)


def settings(ck: Checkpoint) -> Settings:
    return Settings(
        f"{ck.path} (config)", dict(ck.scalars.get("train_config") or {}), str(Path(ck.path).parent)
    )


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("grad_clip", v.get("grad_clip"), float(value))]
    if knob == "precision":
        return [Edit("dtype", v.get("dtype"), _DTYPE[str(value)])]
    if knob == "lr_scale":
        f = float(value)
        out = [
            Edit(
                "learning_rate",
                v.get("learning_rate"),
                v["learning_rate"] * f
                if isinstance(v.get("learning_rate"), (int, float))
                else f"x{f:g}",
            )
        ]
        if isinstance(v.get("min_lr"), (int, float)):
            out.append(Edit("min_lr", v["min_lr"], v["min_lr"] * f))
        return out
    if knob == "eps":
        return [
            Edit(
                "configure_optimizers: eps",
                None,
                float(value),
                "model.configure_optimizers builds AdamW without eps: pass it there",
            )
        ]
    if knob == "lr_fix":
        return [lr_fix_edit(value, "fix the per-group LR your loop sets")]
    return []


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [e for e in edits if ":" not in e.key and not e.key.startswith(LR_FIX_PREFIX)]
    return key_diff(s.source, keys, lambda k, val: f"{k} = {val!r}")


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    return Skip(
        "skip.json",
        skip_json(steps, sample_ids, rows),
        "nanoGPT's get_batch draws random offsets: skip the steps of skip.json (draw, do not train)",
    )


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    return [
        Edit(
            "init_from",
            s.values.get("init_from"),
            "resume",
            f"train.py reads out_dir/ckpt.pt: copy {rollback.name} there first",
        ),
    ]


# ----------------------------------------------------------------------------- the replay's hooks
def clip(ck: Checkpoint) -> tuple[float | None, str] | None:
    return config_clip(ck, ("grad_clip",))


def precision(ck: Checkpoint) -> tuple[str, str] | None:
    """`dtype`: torch.amp.autocast(dtype=...), and a GradScaler for float16."""
    dtype = (ck.scalars.get("train_config") or {}).get("dtype")
    name = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}.get(dtype)
    return (name, f"checkpoint config dtype={dtype!r}") if name else None
