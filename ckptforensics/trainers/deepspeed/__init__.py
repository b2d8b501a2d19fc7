"""DeepSpeed: `ds_config` keys (`gradient_clipping`, `optimizer.params.lr`, `bf16.enabled`) and
`engine.load_checkpoint(save_dir, tag)`.

The config is the one every checkpoint saves in its model states (`ds_config`). On
`load_checkpoint` the engine restores the optimizer (unless `load_optimizer_states=False`,
which loses it) and, with `load_lr_scheduler_states=True` (the default), the scheduler, whose
state then wins over a new `optimizer.params.lr`.

A replay of a model built with DeepSpeed-MoE asks this module for hooks on its gates
(`router_gates`, `moe_gate.py`): the load-balancing losses the model adds to its loss, and
the tokens each expert kept and dropped past its capacity.
"""

from __future__ import annotations

import json
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
    flatten,
    key_diff,
    lr_fix_edit,
    skip_json,
)

# The replay asks every trainer module for `router_gates(model)` (a `HOOKS` entry).
from ckptforensics.trainers.deepspeed.moe_gate import router_gates  # noqa: F401

NAME = "deepspeed"
TITLE = "DeepSpeed"
# The names it gives its checkpoints (the step as the one group) and their place in
# `formats.locate`'s listing.
STEP_NAMES = (("DeepSpeed", r"^global_step(\d+)$", 2),)


def owns(ck: Checkpoint) -> bool:
    return ck.format == "deepspeed"


def settings(ck: Checkpoint) -> Settings:
    cfg = ck.scalars.get("ds_config")
    path = Path(ck.path)
    save = path.parent if path.name.startswith("global_step") else path
    return Settings(
        f"{ck.path} (ds_config)" if isinstance(cfg, dict) else None,
        flatten(cfg) if isinstance(cfg, dict) else {},
        str(save),
    )


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("gradient_clipping", v.get("gradient_clipping"), float(value))]
    if knob == "eps":
        return [Edit("optimizer.params.eps", v.get("optimizer.params.eps"), float(value))]
    if knob == "precision":
        return [
            Edit("bf16.enabled", v.get("bf16.enabled"), value == "bf16"),
            Edit("fp16.enabled", v.get("fp16.enabled"), value == "fp16"),
        ]
    if knob == "lr_scale":
        f = float(value)
        keys = [
            k
            for k in v
            if k
            in (
                "optimizer.params.lr",
                "scheduler.params.warmup_max_lr",
                "scheduler.params.warmup_min_lr",
            )
            and isinstance(v[k], (int, float))
        ]
        note = "load_checkpoint(..., load_lr_scheduler_states=False) or the saved scheduler keeps the old LR"
        return [Edit(k, v[k], v[k] * f, note) for k in keys] or [
            Edit("optimizer.params.lr", None, f"x{f:g}", note)
        ]
    if knob == "lr_fix":
        return [lr_fix_edit(value, "the per-group LR the client optimizer sets: fix its factor")]
    return []


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [e for e in edits if not e.key.startswith(LR_FIX_PREFIX) and e.key != "load_checkpoint"]
    return key_diff(s.source, keys, lambda k, val: f'  "{k}": {json.dumps(val)}')


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    return Skip(
        "skip.json",
        skip_json(steps, sample_ids, rows),
        "DeepSpeed has no skip list: filter the sample ids of skip.json in your data loader",
    )


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    tag = rollback.name if rollback.name.startswith("global_step") else f"global_step{step}"
    return [
        Edit(
            "load_checkpoint",
            None,
            f"engine.load_checkpoint({str(s.save_dir)!r}, tag={tag!r})",
            "keep load_optimizer_states=True",
        )
    ]


# ----------------------------------------------------------------------------- the replay's hooks
def clip(ck: Checkpoint) -> tuple[float | None, str] | None:
    return config_clip(ck, ("grad_clip", "gradient_clipping"))  # ds_config gradient_clipping


def _flag(v: Any) -> bool:
    """A ds_config section `{"enabled": true}` (or a bare flag)."""
    if isinstance(v, dict):
        return v.get("enabled") is True or str(v.get("enabled")).lower() == "true"
    return v is True


def precision(ck: Checkpoint) -> tuple[str, str] | None:
    """ds_config `bf16.enabled`: bf16 weights on the fp32 partitions the optimizer keeps;
    `fp16.enabled`: a loss-scaled fp16 run."""
    tc = ck.scalars.get("train_config") or {}
    ds = tc.get("ds_config") if isinstance(tc.get("ds_config"), dict) else None
    if ds is not None:
        if _flag(ds.get("bf16")) or _flag(ds.get("bfloat16")):
            return (
                "bf16-params",
                "ds_config bf16.enabled (bf16 weights, fp32 partitions in the optimizer)",
            )
        if _flag(ds.get("fp16")):
            return "fp16", "ds_config fp16.enabled"
    # A section whose `enabled` is truthy but not true (`1`; formats/deepspeed sets the flag
    # on any truthy value): autocast, as the replay has always read it.
    for flag in ("bf16", "fp16"):
        if tc.get(flag) is True:
            return flag, f"ds_config {flag}.enabled (truthy, not true: autocast assumed)"
    return None
