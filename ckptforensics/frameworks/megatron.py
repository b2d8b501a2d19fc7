"""Megatron-LM: command-line flags (`--clip-grad`, `--lr`, `--bf16`, `--load`, `--ckpt-step`,
`--iterations-to-skip`), read from the `args` every checkpoint saves.

Megatron keeps the LR schedule's values in the checkpoint (`opt_param_scheduler`) and uses
them over the command line unless `--override-opt_param-scheduler` is given
(megatron/training/arguments.py), so a new `--lr` needs that flag. `--iterations-to-skip`
takes iteration counts as the training loop checks them, before the step runs
(`if iteration in args.iterations_to_skip`, megatron/training/training.py): the batch the log
prints as iteration S is skipped by S - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..formats.base import Checkpoint
from . import LR_FIX_PREFIX, Edit, Settings, Skip, key_diff, lr_fix_edit

NAME = "megatron"
TITLE = "Megatron-LM"

_FLAG = {
    "clip_grad": "--clip-grad",
    "lr": "--lr",
    "min_lr": "--min-lr",
    "adam_eps": "--adam-eps",
    "bf16": "--bf16",
    "fp16": "--fp16",
}


def owns(ck: Checkpoint) -> bool:
    return ck.format in ("megatron", "megatron-dist")


def settings(ck: Checkpoint) -> Settings:
    args = dict(ck.config or {}) if isinstance(ck.config, dict) and "clip_grad" in ck.config else {}
    save = args.get("save") or str(Path(ck.path).parent)
    return Settings(f"{ck.path} (args)" if args else None, args, str(save))


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("clip_grad", v.get("clip_grad"), float(value))]
    if knob == "eps":
        return [Edit("adam_eps", v.get("adam_eps"), float(value))]
    if knob == "precision":
        return [
            Edit("bf16", v.get("bf16"), value == "bf16"),
            Edit("fp16", v.get("fp16"), value == "fp16"),
        ]
    if knob == "lr_scale":
        f = float(value)
        out = [
            Edit(
                "lr",
                v.get("lr"),
                v["lr"] * f if isinstance(v.get("lr"), (int, float)) else None,
                "with --override-opt_param-scheduler",
            )
        ]
        if isinstance(v.get("min_lr"), (int, float)) and v["min_lr"]:
            out.append(Edit("min_lr", v["min_lr"], v["min_lr"] * f))
        out.append(
            Edit(
                "override_opt_param_scheduler",
                v.get("override_opt_param_scheduler"),
                True,
                "the checkpoint's schedule wins over --lr without it",
            )
        )
        return out
    if knob == "lr_fix":
        return [
            lr_fix_edit(
                value,
                "a per-group LR multiplier (--decoupled-lr, a param-group override) gives these groups "
                f"x{1 / value['scale']:.3g} from iteration {value['from_step']}: fix it",
            )
        ]
    return []


def _flag(key: str, v: Any) -> str:
    flag = _FLAG.get(key, "--" + key.replace("_", "-"))
    if isinstance(v, bool):
        return f" {flag}" if v else f" (no {flag})"
    if isinstance(v, list):
        return f" {flag} {' '.join(map(str, v))}"
    return f" {flag} {v}"


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [e for e in edits if not e.key.startswith(LR_FIX_PREFIX)]
    return key_diff(s.source, keys, _flag)


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    its = sorted({int(x) - 1 for x in steps})
    text = (
        f"--iterations-to-skip {' '.join(map(str, its))}  # the loop checks the completed-iteration count before each "
        f"step: {its} skips the batches logged as iteration {', '.join(str(i + 1) for i in its)}; Megatron skips whole "
        "global batches (the rows alone cannot be dropped)"
    )
    return Skip("megatron --iterations-to-skip", its, text)


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    v = s.values
    out = [
        Edit("load", v.get("load"), str(s.save_dir)),
        Edit(
            "ckpt_step",
            v.get("ckpt_step"),
            int(step),
            "load this iteration, not the tracker's latest",
        ),
    ]
    for k in ("no_load_optim", "no_load_rng", "finetune"):
        if v.get(k):
            out.append(
                Edit(k, True, False, "it drops the optimizer state or the iteration count on load")
            )
    return out
