"""Megatron-LM: command-line flags (`--clip-grad`, `--lr`, `--bf16`, `--load`, `--ckpt-step`,
`--iterations-to-skip`), read from the `args` every checkpoint saves.

Megatron keeps the LR schedule's values in the checkpoint (`opt_param_scheduler`) and uses
them over the command line unless `--override-opt_param-scheduler` is given
(megatron/training/arguments.py), so a new `--lr` needs that flag. `--iterations-to-skip`
takes iteration counts as the training loop checks them, before the step runs
(`if iteration in args.iterations_to_skip`, megatron/training/training.py): the batch the log
prints as iteration S is skipped by S - 1.

For a replay: the model is the reference Megatron GPT built from the `args`
(`trainers/<t>/model.py`), `--data` is the run's indexed dataset read as its GPTDataset does
(`trainers/megatron/data.py`), and `--bf16` is followed as Megatron's precision policy runs it
(bf16 weights computed on, each micro-batch's bf16 gradient summed in fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptforensics.core.callables import ModelSpecError
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Recorded,
    Settings,
    Skip,
    config_clip,
    first_count,
    first_number,
    key_diff,
    lr_fix_edit,
)
from ckptforensics.trainers.megatron import model as reference
from ckptforensics.trainers.megatron.data import megatron_batches

if TYPE_CHECKING:
    from torch import nn

NAME = "megatron"
TITLE = "Megatron-LM"
# The names it gives its checkpoints (the step as the one group) and their place in
# `formats.locate`'s listing.
STEP_NAMES = (("Megatron", r"^iter_(\d+)$", 3),)

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


# ----------------------------------------------------------------------------- the replay's hooks
# training_log()'s TensorBoard / W&B tags and the same names in its printed line
# (megatron/training/training.py); its LR is moved a step later by this package's `logs.py`.
LOG_NAMES = {
    "loss": ("lm loss",),
    "grad_norm": ("grad-norm", "grad norm"),
    "loss_scale": ("loss-scale", "loss scale"),
    "skipped": ("number of skipped iterations", "skipped-iterations"),
    "nan_iterations": ("number of nan iterations",),
}


def model(ck: Checkpoint) -> tuple[nn.Module, str] | None:
    """The reference Megatron GPT (megatron-core's GPTModel forward) from the `args`."""

    if not reference.is_megatron_args(ck.config):
        return None
    try:
        return reference.megatron_gpt(ck.config, ck.names())
    except reference.ReferenceError as e:
        raise ModelSpecError(f"{ck.path}: {e}; pass --model module:factory") from None


def batches(data: str, ck: Checkpoint, collator: str | None) -> list[BatchSource]:
    """Iteration `it`'s global batch: the GPTDataset's samples `it x global_batch_size` on."""

    return [megatron_batches(data, ck.config, Path(ck.path).parent)]


def clip(ck: Checkpoint) -> tuple[float | None, str] | None:
    return config_clip(ck, ("grad_clip",))  # `--clip-grad`, as formats/megatron reads it


def recorded(ck: Checkpoint) -> Recorded | None:
    """The parsed `args` the checkpoint keeps: `--clip-grad`, `--lr-warmup-iters`, `--train-iters`."""

    if not reference.is_megatron_args(ck.config):
        return None
    args = dict(ck.config or {})
    warm = first_number("args", args, (("lr_warmup_iters",),))
    return Recorded(
        "args",
        args,
        clip=first_number("args", args, (("clip_grad",),)),
        warmup=(int(warm[0]), warm[1]) if warm else None,
        total_steps=first_count(args, (("train_iters",),)),
    )


def precision(ck: Checkpoint) -> tuple[str, str] | None:
    """`--bf16`: bf16 parameters on fp32 main params; `--fp16`: a loss-scaled fp16 run."""
    tc = ck.scalars.get("train_config") or {}
    if not tc.get("megatron"):
        return None
    if tc.get("bf16") is True:
        return "bf16-params", _bf16_source(tc, bool(ck.scalars.get("fp32_masters")))
    if tc.get("fp16") is True:
        return "fp16", "Megatron args fp16"
    return None


def fp32_micro_batches(ck: Checkpoint) -> int | None:
    """Megatron `--bf16` with `accumulate_allreduce_grads_in_fp32` (validate_args' default
    for bf16) backpropagates each micro-batch of `micro_batch_size` rows on its own and adds
    its bf16 gradient into the fp32 `main_grad` buffer (DDP's backward hook), so the step's
    gradient is a sum of roundings, not the rounding of one backward over the global batch."""
    tc = ck.scalars.get("train_config") or {}
    policy = tc.get("megatron_precision") or {}
    mbs = tc.get("micro_batch_size")
    if (
        not tc.get("megatron")
        or policy.get("bf16") is not True
        or policy.get("accumulate_allreduce_grads_in_fp32") is not True
    ):
        return None
    return mbs if isinstance(mbs, int) and mbs > 0 else None


def _bf16_source(tc: dict[str, Any], masters: bool) -> str:
    """The source of a `--bf16` run's precision: the args that set its policy, and any part
    of it the replay does not follow (it follows bf16 weights computed on, each micro-batch's
    gradient summed in fp32, an fp32 optimizer stepping fp32 main params)."""
    policy = tc.get("megatron_precision") or {}
    said = ["bf16=True (bf16 params, the fp32 main params' rounding after each step)"]
    said += [f"{k}={policy[k]}" for k in ("main_params_dtype", "main_grads_dtype") if k in policy]
    if policy.get("accumulate_allreduce_grads_in_fp32") is True:
        mbs = tc.get("micro_batch_size")
        per = (
            f"each micro-batch of micro_batch_size={mbs} rows"
            if isinstance(mbs, int)
            else "each micro-batch"
        )
        said.append(
            f"accumulate_allreduce_grads_in_fp32=True ({per} backpropagated in bf16, its gradient summed in fp32)"
        )
    if "use_distributed_optimizer" in policy:
        said.append(f"use_distributed_optimizer={policy['use_distributed_optimizer']}")
    off = []
    if policy.get("accumulate_allreduce_grads_in_fp32") is False or policy.get(
        "grad_reduce_in_bf16"
    ):
        off.append(
            "gradients accumulated in bf16 (the replay takes one bf16 gradient of the whole batch, in fp32)"
        )
    if policy.get("main_params_dtype") not in (None, "torch.float32"):
        off.append(f"main params in {policy['main_params_dtype']}")
    off += [
        f"{k}={policy[k]}"
        for k in ("exp_avg_dtype", "exp_avg_sq_dtype")
        if policy.get(k) not in (None, "torch.float32")
    ]
    if policy.get("fp8"):
        off.append(f"fp8={policy['fp8']}")
    text = "Megatron args " + ", ".join(said)
    text += (
        "; the weights read (and replayed from) are the optimizer's fp32 main params"
        if masters
        else "; the checkpoint's fp32 main params were not read: the weights are its bf16 ones"
    )
    return text + (f"; not modelled: {', '.join(off)}" if off else "")
