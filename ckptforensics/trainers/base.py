"""What every trainer's spec is made of: the run's settings (`Settings`), an edit of them in the
trainer's own keys (`Edit`), a skip list in its format (`Skip`), the `Planner` and `Framework`
protocols a trainer package satisfies, the replay's optional `HOOKS`, and the helpers the
trainers share (key diffs, skip.json, a config's clip). The registry is `trainers/__init__`.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ckptforensics.core.errors import ForensicsError
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "Settings",
    "Recorded",
    "Edit",
    "Skip",
    "Planner",
    "Framework",
    "HOOKS",
    "config_clip",
    "value_at",
    "first_number",
    "first_count",
    "key_diff",
    "value_text",
    "skip_json",
    "flatten",
    "lr_fix_edit",
    "LR_FIX_PREFIX",
    "LossNorm",
    "require_rebuilt_match",
    "REBUILT_LOSS_RTOL",
    "REBUILT_GRAD_RTOL",
]


@dataclass(frozen=True, slots=True)
class Settings:
    """What the run's own files say about how it trained.

    Attributes:
        source: the file the values come from (`checkpoint-45/training_args.bin`), or None
            when the checkpoint records none (the edits then say the run's value is unknown).
        values: the trainer's own keys -> the run's values (`max_grad_norm: 1.0`).
        save_dir: where the trainer writes its checkpoints (the run directory).
        extra: what a planner keeps for itself (OLMo-core's whole config, say).
    """

    source: str | None
    values: dict[str, Any]
    save_dir: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What one trainer's own configuration file beside the checkpoint states (its `recorded`
    hook): the file's content under its section name, and the settings read from it, each with
    the key it is read from (`trainers/settings.run_settings` merges every trainer's).

    Attributes:
        section: the file's name in the run's configuration (the first key of each source).
        config: the file's content.
        clip: the clip norm (0: clipping off) and its key.
        warmup: the warm-up steps and their key.
        total_steps: the schedule's length in steps.
        precision: the precision the file states ('bf16', 'fp16') and its key.
    """

    section: str
    config: dict[str, Any]
    clip: tuple[float, str] | None = None
    warmup: tuple[int, str] | None = None
    total_steps: int | None = None
    precision: tuple[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Edit:
    """One setting in the trainer's own terms: its key, the run's value (None: not recorded,
    or not set), the planned value, and a note where the trainer needs more than the key."""

    key: str
    before: Any
    after: Any
    note: str = ""


@dataclass(frozen=True, slots=True)
class Skip:
    """A skip list as the trainer takes it.

    Attributes:
        format: what `value` is ('megatron --iterations-to-skip', 'HF dataset indices', 'skip.json').
        value: what the trainer is given (iterations, dataset indices, the skip.json document).
        text: how to apply it, in the trainer's own code or flags.
    """

    format: str
    value: Any
    text: str


class Planner(Protocol):
    """One trainer's resume knowledge (a module satisfies it with module-level names)."""

    NAME: str
    TITLE: str

    def owns(self, ck: Checkpoint) -> bool: ...

    def settings(self, ck: Checkpoint) -> Settings: ...

    def edits(self, knob: str, value: Any, s: Settings) -> list[Edit]: ...

    def render(self, edits: Sequence[Edit], s: Settings) -> str: ...

    def skip(
        self,
        steps: Sequence[int],
        sample_ids: Sequence[int],
        rows: dict[int, list[int]],
        s: Settings,
    ) -> Skip: ...

    def resume(self, rollback: Path, step: int, s: Settings) -> list[Edit]: ...


class Framework(Planner, Protocol):
    """One trainer's knowledge: the plan's half (`Planner`, required) and the replay's
    hooks, each optional (`HOOKS`: a module may lack any; its answer None means the same).

    Attributes:
        LOG_NAMES: our metric name (`loss`, `grad_norm`, `lr`, `loss_scale`, `skipped`,
            `nan_iterations`) -> the names the trainer logs it under (optional).
        STEP_NAMES: the names the trainer gives its checkpoints, each (who writes it, a regex
            with the step as its one group, its place in `formats.locate`'s listing) (optional).
        CHECKPOINT_DIRS: globs in the run directory of the folders the trainer keeps its
            checkpoints in, beside `checkpoints/` (optional).
        CONVENTIONS: a convention the replay measures or tries (`unshifted_labels`: labels are
            the inputs, shifted inside the loss; `last_micro_batch_loss`: the logged loss is
            the step's last micro-batch's) -> how its messages cite the trainer for it
            (optional; `trainers.convention_of`).
    """

    LOG_NAMES: dict[str, tuple[str, ...]]
    STEP_NAMES: tuple[tuple[str, str, float], ...]
    CHECKPOINT_DIRS: tuple[str, ...]
    CONVENTIONS: dict[str, str]

    def model(self, ck: Checkpoint) -> tuple[nn.Module, str] | None:
        """The model the run's recorded config describes, and how it was built."""
        ...

    def batches(self, data: str, ck: Checkpoint, collator: str | None) -> list[BatchSource] | None:
        """The run's batches rebuilt from its training data (`--data`): one source, or one
        candidate per collator the run may have used (the replay keeps the one that lands)."""
        ...

    def loss_norm(self, model: nn.Module, ck: Checkpoint) -> LossNorm | None:
        """What the trainer divides a step's summed token losses by."""
        ...

    def precision(self, ck: Checkpoint) -> tuple[str, str] | None:
        """The precision the run's config states (a mode of `replay.precision.PRECISIONS`),
        with the key it is read from."""
        ...

    def clip(self, ck: Checkpoint) -> tuple[float | None, str] | None:
        """The run's gradient clip (None: it did not clip) and the key it is read from."""
        ...

    def fp32_micro_batches(self, ck: Checkpoint) -> int | None:
        """Rows per micro-batch whose low-precision gradients the run summed in fp32 (each
        micro-batch backpropagated on its own), where the run did so."""
        ...

    def recorded(self, ck: Checkpoint) -> Recorded | None:
        """The settings the trainer's own configuration file beside `ck` states (asked of
        every trainer, not only the one that wrote `ck`: a file is evidence wherever it lies)."""
        ...

    def router_gates(self, model: nn.Module) -> Any | None:
        """Hooks on the model's own MoE gates where they are this trainer's (DeepSpeed's
        `TopKGate`): each call's load-balancing loss and routing under its capacity (asked of
        every trainer: the model's classes say whose they are)."""
        ...


# Each optional hook -> what the replay does where a framework has none (or it returns None).
HOOKS: dict[str, str] = {
    "model": "replay.model.build_model: transformers from the checkpoint's config.json, else --model",
    "batches": "replay.window: refused, naming the format (pass --batch)",
    "loss_norm": "replay.model.trainer_loss_norm: the mean over the step's target tokens",
    "precision": "replay.precision.candidates: the weights' dtypes decide (candidates checked against the log)",
    "clip": "trainers.settings.run_settings: the checkpoint's train_config (grad_clip, max_grad_norm, "
    "gradient_clipping, clip_grad), else the batch log's grad_clip, else the trainers' `recorded` files "
    "(replay calibrates where none records one)",
    "fp32_micro_batches": "replay.precision.fp32_micro_batches: None (one backward over the global batch)",
    "recorded": "trainers.settings.run_settings: the checkpoint's train_config and model config alone",
    "router_gates": "replay.routers: the model's own aux loss and router logits where it returns "
    "them (transformers' MoE models), else no aux term and no routing figures",
}


# The key of a per-group LR fix: not a setting of any trainer (renderers leave it out of
# their key diffs), its note says where the factor lives in that trainer.
LR_FIX_PREFIX = "LR of param groups"


def lr_fix_edit(value: dict[str, Any], note: str) -> Edit:
    """The edit of a per-group LR fix (`lr_fix`): those groups' LR from the jump back to before it."""
    return Edit(
        f"{LR_FIX_PREFIX} {value['groups']} from step {value['from_step']}",
        value["lr"],
        value["lr_before"],
        note,
    )


def value_text(v: Any) -> str:
    """A value as JSON writes it (`true`, `0.5`, `"bf16-mixed"`), None as `(not set)`."""
    return "(not set)" if v is None else json.dumps(v)


def key_diff(source: str | None, edits: Sequence[Edit], line: Any = None) -> str:
    """A unified-diff-like rendering: `-key value` (as the run trained) / `+key value`
    (planned), one pair per edit; `line(key, value)` formats one line in the trainer's own
    syntax (default `key: value`)."""
    fmt = line or (lambda k, v: f"{k}: {value_text(v)}")
    out = [
        f"--- {source or 'the run (settings not recorded in the checkpoint)'}",
        "+++ planned resume",
    ]
    for e in edits:
        if e.before is not None:
            out.append("-" + fmt(e.key, e.before))
        out.append("+" + fmt(e.key, e.after))
    return "\n".join(out)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys (`optimizer.params.lr`)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def skip_json(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]]
) -> dict[str, Any]:
    """bisect's skip.json document: the steps, the sample ids, the rows of each step."""
    return {
        "steps": sorted(set(steps)),
        "sample_ids": sorted(set(sample_ids)),
        "rows": {str(k): list(v) for k, v in sorted(rows.items())},
    }


def config_clip(ck: Checkpoint, keys: Sequence[str]) -> tuple[float | None, str] | None:
    """The clip the run's `train_config` records under the first of `keys` holding a number
    (0 or less: no clipping), with the key as its source; None where none does."""
    tc = ck.scalars.get("train_config") or {}
    for key in keys:
        if isinstance(tc.get(key), (int, float)):
            v = float(tc[key])
            return (v if v > 0 else None), f"checkpoint config {key}"
    return None


def value_at(config: Any, path: Sequence[str]) -> Any:
    """The value at `path` in a nested config (None where the path stops)."""
    for k in path:
        if not isinstance(config, dict):
            return None
        config = config.get(k)
    return config


def first_number(
    section: str, config: Any, paths: Sequence[Sequence[str]]
) -> tuple[float, str] | None:
    """The first number (booleans are not) at one of `paths` in `config`, with its key as
    `section.path`; None where none holds one."""
    for path in paths:
        v = value_at(config, path)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v), ".".join((section, *path))
    return None


def first_count(config: Any, paths: Sequence[Sequence[str]]) -> int | None:
    """The first positive integer at one of `paths` in `config`."""
    for path in paths:
        v = value_at(config, path)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


@dataclass(frozen=True, slots=True)
class LossNorm:
    """What the trainer divides the summed token losses of a step by.

    kind: 'targets' (the step's next-token targets: the mean every framework's own loop
    takes), 'labels' (every label != -100 before the causal shift: HF Trainer's
    num_items_in_batch for a model whose loss_type it does not know to shift, GPT-2),
    'micro' (each micro-batch's mean, averaged: Trainer without loss kwargs).
    """

    kind: str
    source: str


# The first replayed step's loss (and pre-clip grad norm, where logged) from a rebuilt
# batch against the log. The same batch from the same weights lands within float noise
# (fixtures/hf_data_run.py: 2e-7 relative, every step of the window); the fixture's data
# shuffled differently gives another batch 1.1% off in loss: batch-to-batch spread is
# about a percent, so the loss bar is a tenth of it in fp32, and half of it in bf16/fp16,
# whose kernels differ across devices by a few 1e-4. Grad norms spread far more between
# batches (tens of percent) and less across devices: 1%.
REBUILT_LOSS_RTOL = {"fp32": 1e-3, "bf16": 5e-3, "fp16": 5e-3}
REBUILT_GRAD_RTOL = 1e-2


def require_rebuilt_match(
    step: int, replayed: tuple[float, float], logged: dict[str, float] | None, precision: str
) -> None:
    """The rebuilt batch of the first replayed step must give the loss (and the grad norm,
    where logged) the log recorded; else a one-line error and nothing is diagnosed."""
    loss, grad = replayed
    if not logged or "loss" not in logged:
        raise ForensicsError(
            f"the rebuilt batches cannot be checked: the log has no loss for step {step}; pass --batch"
        )
    checks = [("loss", loss, logged["loss"], REBUILT_LOSS_RTOL.get(precision, 5e-3))]
    if "grad_norm" in logged:
        checks.append(("grad norm", grad, logged["grad_norm"], REBUILT_GRAD_RTOL))
    for what, mine, theirs, tol in checks:
        if not abs(mine - theirs) <= tol * abs(theirs):
            raise ForensicsError(
                f"the rebuilt batch of step {step} gives {what} {mine:.5g}, the log says {theirs:.5g} (tolerance {tol:.1%}): "
                "the data pipeline differs (dataset, collator, seed or sampler); pass --batch with the batches the run consumed"
            )
