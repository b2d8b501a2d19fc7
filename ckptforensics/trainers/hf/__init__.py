"""transformers' Trainer: `TrainingArguments` fields, `resume_from_checkpoint`, dataset indices.

The run's settings are its `training_args.bin` (read through the inert unpickler by the
format reader). On `trainer.train(resume_from_checkpoint=...)` the Trainer restores the
optimizer, the scheduler (its `base_lrs` included), the scaler and the RNG state before any
callback's `on_train_begin` (transformers 5.x `_inner_training_loop` then
`_load_optimizer_and_scheduler`), so a new `learning_rate` alone does not reach a resumed
schedule: the plan scales the restored scheduler in a callback. `max_grad_norm`, `bf16` and
`fp16` are read from the new arguments every step.

For a replay: the model is transformers' own, from `config.json` (the generic path of
`replay.model.build_model`, which any run with a `config.json` takes); `--data` is drawn again
by the Trainer's own sampler with the run's `TrainingArguments` (`trainers/hf/data.py`); the loss
is divided as the Trainer divides it (`num_items_in_batch`, or each micro-batch's mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    LossNorm,
    Settings,
    Skip,
    config_clip,
    key_diff,
    lr_fix_edit,
    skip_json,
)
from ckptforensics.trainers.hf.data import trainer_batches

if TYPE_CHECKING:
    from torch import nn

NAME = "hf"
TITLE = "HF Trainer"
# The names it gives its checkpoints (the step as the one group) and their place in
# `formats.locate`'s listing.
STEP_NAMES = (("HF Trainer", r"^checkpoint-(\d+)$", 1),)
# The conventions the replay cites it for (`trainers.convention_of`): labels are the inputs,
# shifted inside the model's loss.
CONVENTIONS = {"unshifted_labels": "HF"}


def owns(ck: Checkpoint) -> bool:
    return ck.format == "hf-trainer"


def settings(ck: Checkpoint) -> Settings:
    args = ck.scalars.get("training_args")
    src = Path(ck.path) / "training_args.bin"
    return Settings(
        str(src) if isinstance(args, dict) else None, dict(args or {}), str(Path(ck.path).parent)
    )


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("max_grad_norm", v.get("max_grad_norm"), float(value))]
    if knob == "eps":
        return [Edit("adam_epsilon", v.get("adam_epsilon"), float(value))]
    if knob == "precision":
        return [
            Edit("bf16", v.get("bf16"), value == "bf16"),
            Edit("fp16", v.get("fp16"), value == "fp16"),
        ]
    if knob == "lr_scale":
        lr = v.get("learning_rate")
        return [
            Edit(
                "learning_rate",
                lr,
                lr * float(value) if isinstance(lr, (int, float)) else None,
                f"resume_from_checkpoint restores the scheduler's base LR from scheduler.pt: also scale it on resume "
                f"(callback below, x{float(value):g})",
            )
        ]
    if knob == "lr_fix":
        return [
            lr_fix_edit(
                value,
                "the jump is in the optimizer/scheduler the run passed to Trainer(optimizers=...), not in learning_rate: "
                f"fix its per-group factor (x{value['scale']:.3g} from step {value['from_step']})",
            )
        ]
    return []


def _kw(k: str, v: Any) -> str:
    return f"    {k}={v!r},"


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [e for e in edits if not e.key.startswith(LR_FIX_PREFIX)]
    text = key_diff(s.source and f"{s.source} (TrainingArguments)", keys, _kw)
    flags = " ".join(f"--{e.key} {e.after}" for e in keys if e.after is not None)
    out = [text, "", f"# or on the command line of an HfArgumentParser script: {flags}"]
    scale = next(
        (e for e in edits if e.key == "learning_rate" and e.after is not None and e.before), None
    )
    if scale is not None:
        f = scale.after / scale.before
        out += [
            "",
            "class ScaleLR(TrainerCallback):  # after the Trainer restored scheduler.pt",
            "    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):",
            f"        lr_scheduler.base_lrs = [lr * {f:g} for lr in lr_scheduler.base_lrs]",
            "        for g in optimizer.param_groups:",
            f"            g['lr'] *= {f:g}",
        ]
    return "\n".join(out)


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    if sample_ids:
        ids = sorted(set(sample_ids))
        text = (
            f"skip = {set(ids)}  # rows of train_dataset (the dataset indices the Trainer's sampler draws)\n"
            "train_dataset = train_dataset.select([i for i in range(len(train_dataset)) if i not in skip])"
        )
        return Skip("HF dataset indices", ids, text)
    doc = skip_json(steps, sample_ids, rows)
    return Skip(
        "skip.json",
        doc,
        f"no dataset indices known: drop the rows of steps {doc['steps']} listed in skip.json from train_dataset",
    )


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    return [
        Edit(
            "resume_from_checkpoint",
            s.values.get("resume_from_checkpoint"),
            str(rollback),
            "trainer.train(resume_from_checkpoint=...) takes the same",
        )
    ]


# ----------------------------------------------------------------------------- the replay's hooks
# Its TensorBoard / W&B / MLflow callbacks prefix "train/"; trainer_state.json has "loss",
# "grad_norm", "learning_rate".
LOG_NAMES = {
    "loss": ("train/loss",),
    "grad_norm": ("train/grad_norm",),
    "lr": ("train/learning_rate", "learning_rate"),
    "loss_scale": ("train/loss_scale",),
}


def batches(data: str, ck: Checkpoint, collator: str | None) -> list[BatchSource]:
    """The Trainer's own sampler over `data` with the run's settings: one candidate per
    collator the run may have used (`--collator`, else the usual ones in turn)."""

    # The Trainer saves one RNG state per process.
    world = len(list(Path(ck.path).glob("rng_state_*.pth"))) or 1
    return trainer_batches(
        data, ck.scalars.get("training_args"), ck.config, world, collator, ck.path
    )


def clip(ck: Checkpoint) -> tuple[float | None, str] | None:
    return config_clip(ck, ("grad_clip", "max_grad_norm"))  # max_grad_norm, 0 = none


def precision(ck: Checkpoint) -> tuple[str, str] | None:
    """TrainingArguments `bf16` / `fp16`: autocast over fp32 weights."""
    tc = ck.scalars.get("train_config") or {}
    for flag in ("bf16", "fp16"):
        if tc.get(flag) is True:
            return flag, f"training_args.bin {flag}=True"
    return None


def loss_norm(model: nn.Module, ck: Checkpoint) -> LossNorm:
    """What transformers' Trainer does with this model (`Trainer.__init__` /
    `get_batch_samples` / `compute_loss`, 5.x)."""
    import inspect

    if hasattr(model, "accepts_loss_kwargs"):
        accepts = bool(model.accepts_loss_kwargs)
    else:
        accepts = any(
            p.kind is inspect.Parameter.VAR_KEYWORD
            for p in inspect.signature(model.forward).parameters.values()
        )
    if not accepts:
        return LossNorm(
            "micro",
            "HF Trainer: the model takes no loss kwargs, so each micro-batch's mean / gradient_accumulation_steps",
        )
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return LossNorm(
            "targets",
            "HF Trainer num_items_in_batch (transformers not importable: assumed shifted)",
        )
    loss_type = getattr(model, "loss_type", None)
    enc_dec = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if LOSS_MAPPING.get(loss_type) is ForCausalLMLoss and not enc_dec:
        return LossNorm(
            "targets",
            f"HF Trainer: sum / num_items_in_batch, counted over labels[..., 1:] (loss_type {loss_type!r})",
        )
    return LossNorm(
        "labels",
        f"HF Trainer: sum / num_items_in_batch, counted over every label != -100 before the shift (loss_type {loss_type!r}: "
        "Trainer._loss_shifts_labels is False), so the logged loss is (T-1)/T of the mean",
    )
