"""Per-trainer resume knowledge: how each trainer states its settings, takes a change, skips
data and resumes from a checkpoint (the plan's half of a trainer's knowledge; one module per
trainer, so each can join a wider `Framework` protocol later).

A planner is a module with `NAME`, `TITLE` and five functions (`Planner`): it reads the run's
own settings from the checkpoint (`settings`), turns a mitigation into edits of those settings
in the trainer's own keys (`edits`), renders them as a diff of the run's own file or command
line (`render`), puts a skip list in the trainer's skip format (`skip`) and says how the
trainer resumes from the rollback checkpoint (`resume`). `planner_for(ck)` picks one; the
plain loop (`loop`) takes what nobody else owns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..formats.base import Checkpoint

__all__ = [
    "Settings",
    "Edit",
    "Skip",
    "Planner",
    "planner_for",
    "PLANNERS",
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


def _planners() -> tuple[Any, ...]:
    from . import deepspeed, hf, lightning, loop, megatron, nanogpt, olmo_core, torchtitan

    # Order matters only where two could own a checkpoint: OLMo-core's DCP before torchtitan's.
    return (hf, lightning, megatron, deepspeed, olmo_core, torchtitan, nanogpt, loop)


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


def planner_for(ck: Checkpoint) -> Any:
    """The planner of the trainer that wrote `ck` (the plain loop when no other owns it)."""
    return next(p for p in _planners() if p.owns(ck))
