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
framework that wrote `ck`, or None), never by testing `ck.format`. Optional data: `LOG_NAMES`,
the trainer's metric names (registered with `logs.columns` in `LOG_ORDER`; `log_aliases` merges
them); `STEP_NAMES` and `CHECKPOINT_DIRS`, the names it gives its checkpoints and the folders it
keeps them in (registered with `formats.locate`, which resolves steps against them).

`framework_for(ck)` is the one place that picks: the first module of `PLANNERS` that owns the
checkpoint; the plain loop (`loop`) owns what nobody else does. `planner_for` is the same
function under the plan's older name. docs/frameworks.md walks through adding a trainer.

The registry: each trainer package imported here, in the order `framework_for` asks them;
a trainer's checkpoint layout registers its reader with `formats` when its package loads
(`checkpoint.py`), its log formats, log places and loggers' step conventions with `logs`
(`logs.py`). Code that opens checkpoints, resolves steps or reads logs imports this package
first (`checkpoints` does). What a spec is made of is `trainers/base.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.locate import register_checkpoint_dirs, register_step_names
from ckptforensics.logs.columns import register_log_names
from ckptforensics.trainers import (
    deepspeed,
    hf,
    lightning,
    loop,
    megatron,
    nanogpt,
    olmo_core,
    torchtitan,
)
from ckptforensics.trainers.base import (
    HOOKS,
    LR_FIX_PREFIX,
    Edit,
    Framework,
    LossNorm,
    Planner,
    Recorded,
    Settings,
    Skip,
    config_clip,
    flatten,
    key_diff,
    lr_fix_edit,
    require_rebuilt_match,
    skip_json,
    value_text,
)

# Each trainer's checkpoint layout registers its reader with `formats` (`checkpoint.py`; its
# `order` places it among the sniffers), its log formats, log places and loggers' step
# conventions with `logs` (`logs.py`; each its `order` among the generic ones), as they load.
from ckptforensics.trainers.deepspeed import checkpoint as _deepspeed_checkpoint  # noqa: F401
from ckptforensics.trainers.hf import checkpoint as _hf_checkpoint  # noqa: F401
from ckptforensics.trainers.hf import fsdp as _hf_fsdp  # noqa: F401
from ckptforensics.trainers.hf import logs as _hf_logs  # noqa: F401
from ckptforensics.trainers.hf.config_model import config_model
from ckptforensics.trainers.hf.data import open_dataset
from ckptforensics.trainers.lightning import checkpoint as _lightning_checkpoint  # noqa: F401
from ckptforensics.trainers.lightning import logs as _lightning_logs  # noqa: F401
from ckptforensics.trainers.loop import checkpoint as _loop_checkpoint  # noqa: F401
from ckptforensics.trainers.loop import logs as _loop_logs  # noqa: F401
from ckptforensics.trainers.megatron import checkpoint as _megatron_checkpoint  # noqa: F401
from ckptforensics.trainers.megatron import logs as _megatron_logs  # noqa: F401
from ckptforensics.trainers.megatron import saves as _megatron_saves  # noqa: F401
from ckptforensics.trainers.nanogpt import checkpoint as _nanogpt_checkpoint  # noqa: F401
from ckptforensics.trainers.olmo_core import checkpoint as _olmo_checkpoint  # noqa: F401
from ckptforensics.trainers.olmo_core import logs as _olmo_logs  # noqa: F401
from ckptforensics.trainers.olmo_core.skipstep import (
    SkipRule,
    hold_step_counter,
    restore_step_counter,
    skip_optimizer,
    skip_rule,
)
from ckptforensics.trainers.torchtitan import checkpoint as _torchtitan_checkpoint  # noqa: F401

# Besides the registry, what the replay and the diff call that one trainer's module implements,
# exported here so that the engine names no trainer: `open_dataset` (a dataset on disk that a
# batch log's sample ids index: HF `datasets`), `config_model` (a model transformers builds from
# a config.json), `require_rebuilt_match` (rebuilt batches checked against the logged loss),
# `SkipRule`, `skip_rule`, `skip_optimizer`, `hold_step_counter` and `restore_step_counter` (an
# optimizer that skips outlier steps on its own: OLMo-core's SkipStep).
__all__ = [
    "Settings",
    "Recorded",
    "Edit",
    "Skip",
    "Planner",
    "Framework",
    "HOOKS",
    "framework_for",
    "frameworks",
    "planner_for",
    "hook",
    "log_aliases",
    "convention_of",
    "config_clip",
    "PLANNERS",
    "LOG_ORDER",
    "key_diff",
    "value_text",
    "skip_json",
    "flatten",
    "lr_fix_edit",
    "LR_FIX_PREFIX",
    "LossNorm",
    "require_rebuilt_match",
    "open_dataset",
    "SkipRule",
    "skip_rule",
    "skip_optimizer",
    "hold_step_counter",
    "restore_step_counter",
    "config_model",
]

# The trainer packages by name: one line a trainer.
_MODULES: dict[str, Any] = {
    "hf": hf,
    "lightning": lightning,
    "megatron": megatron,
    "deepspeed": deepspeed,
    "olmo_core": olmo_core,
    "torchtitan": torchtitan,
    "nanogpt": nanogpt,
    "loop": loop,
}


def _planners() -> tuple[Any, ...]:
    return tuple(_MODULES[n] for n in PLANNERS)


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


def frameworks() -> tuple[Any, ...]:
    """Every trainer module, in the order `framework_for` asks them."""
    return _planners()


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


def convention_of(name: str) -> str:
    """Whom the replay's messages cite for the convention `name` (each trainer's `CONVENTIONS`,
    in `PLANNERS` order, joined): the trainers that follow it, in their own words."""
    return ", ".join(
        m.CONVENTIONS[name] for m in _planners() if name in getattr(m, "CONVENTIONS", {})
    )


def log_aliases(ours: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each of our metric names -> the names trainers log it under, every trainer's
    `LOG_NAMES` merged in `LOG_ORDER` (the first match wins where a log holds several)."""
    mods = [_MODULES[n] for n in LOG_ORDER]
    return {k: tuple(n for m in mods for n in m.LOG_NAMES.get(k, ())) for k in ours}


def _register() -> None:
    """Every trainer's metric names with `logs` (in `LOG_ORDER`), its checkpoint names and
    folders with `formats.locate` (each name in its own `order`)."""
    for name in LOG_ORDER:
        register_log_names(_MODULES[name].LOG_NAMES)
    for mod in _MODULES.values():
        for who, pattern, order in getattr(mod, "STEP_NAMES", ()):
            register_step_names(who, pattern, order=order)
        for pattern in getattr(mod, "CHECKPOINT_DIRS", ()):
            register_checkpoint_dirs(pattern)


_register()
