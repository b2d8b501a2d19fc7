"""Per-trainer knowledge, one module per trainer behind one `Framework` protocol (the way
torchtitan bundles a model's pieces in one spec): which runs the trainer wrote, how it states
its settings and resumes (the plan's half), and what a replay needs from it (the model its
recorded config describes, its batches rebuilt from `--data`, its loss normalisation, the
precision and clip its config records, its log's metric names).

A framework is a module. Required (`Planner`, the plan's half): `NAME`, `TITLE` and six
functions: `owns` (did this trainer write the checkpoint), `settings` (the run's own settings
read from it), `edits` (a mitigation as edits of those settings in the trainer's own keys),
`render` (them as a diff of the run's own file or command line), `skip` (a skip list in the
trainer's skip format) and `resume` (how the trainer resumes from the rollback checkpoint).

Optional (the replay's half, `HOOKS`): a module that lacks one, or whose hook returns None for
a checkpoint, leaves that question to the generic behaviour, which `HOOKS` names and the
caller in `replay/` implements. Callers ask through `hook(ck, name)` (the hook of the
framework that wrote `ck`, or None), never by testing `ck.format`. `LOG_NAMES` (optional data)
is the trainer's metric names; `log_aliases` merges every trainer's into the table
`logs.columns.ALIASES` reads.

`framework_for(ck)` is the one place that picks: the first module of `PLANNERS` that owns the
checkpoint; the plain loop (`loop`) owns what nobody else does. `planner_for` is the same
function under the plan's older name. docs/frameworks.md walks through adding a trainer.

Nothing here imports torch: the hooks import what they need when called.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from ckptforensics.engine.replay.model import LossNorm
    from ckptforensics.formats.base import Checkpoint
    from ckptforensics.formats.batches import BatchSource

__all__ = [
    "Settings",
    "Edit",
    "Skip",
    "Planner",
    "Framework",
    "HOOKS",
    "framework_for",
    "planner_for",
    "hook",
    "log_aliases",
    "config_clip",
    "PLANNERS",
    "LOG_ORDER",
    "key_diff",
    "value_text",
    "skip_json",
    "flatten",
    "lr_fix_edit",
    "LR_FIX_PREFIX",
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
    """

    LOG_NAMES: dict[str, tuple[str, ...]]

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


# Each optional hook -> what the replay does where a framework has none (or it returns None).
HOOKS: dict[str, str] = {
    "model": "replay.model.build_model: transformers from the checkpoint's config.json, else --model",
    "batches": "replay.window: refused, naming the format (pass --batch)",
    "loss_norm": "replay.model.trainer_loss_norm: the mean over the step's target tokens",
    "precision": "replay.precision.candidates: the weights' dtypes decide (candidates checked against the log)",
    "clip": "replay.window: the checkpoint's train_config (grad_clip, max_grad_norm, gradient_clipping, "
    "clip_grad), else the batch log's grad_clip, else calibrated",
    "fp32_micro_batches": "replay.precision.fp32_micro_batches: None (one backward over the global batch)",
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


def _planners() -> tuple[Any, ...]:
    import importlib

    return tuple(importlib.import_module(f"{__name__}.{n}") for n in PLANNERS)


# The trainer modules, in the order `framework_for` asks them. Order matters only where two
# could own a checkpoint: OLMo-core's DCP before torchtitan's; the loop, which owns any, last.
PLANNERS: tuple[str, ...] = (
    "hf",
    "lightning",
    "megatron",
    "deepspeed",
    "olmo_core",
    "torchtitan",
    "nanogpt",
    "loop",
)


# Whose metric names come first where a log holds several of one metric's (`log_aliases`):
# the most specific names first (OLMo-core's and Megatron's are theirs alone; `train_loss`
# may be anybody's).
LOG_ORDER: tuple[str, ...] = ("olmo_core", "megatron", "hf", "torchtitan", "lightning")


def framework_for(ck: Checkpoint) -> Any:
    """The framework (module) of the trainer that wrote `ck`: the first of `PLANNERS` that
    owns it (the plain loop when no other does)."""
    return next(p for p in _planners() if p.owns(ck))


planner_for = framework_for  # the plan's name for it


def hook(ck: Checkpoint, name: str) -> Callable[..., Any] | None:
    """The optional hook `name` (one of `HOOKS`) of the framework that wrote `ck`, or None
    where that framework has none: the caller then does the generic thing `HOOKS` names."""
    if name not in HOOKS:
        raise KeyError(f"{name!r} is not a framework hook ({', '.join(HOOKS)})")
    return getattr(framework_for(ck), name, None)


def log_aliases(ours: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each of our metric names -> the names trainers log it under, every trainer's
    `LOG_NAMES` merged in `LOG_ORDER` (the first match wins where a log holds several)."""
    import importlib

    mods = [importlib.import_module(f"{__name__}.{n}") for n in LOG_ORDER]
    return {k: tuple(n for m in mods for n in m.LOG_NAMES.get(k, ())) for k in ours}
