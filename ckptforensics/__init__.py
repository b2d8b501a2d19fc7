"""ckptforensics: post-mortem forensics for loss spikes in large-model pre-training.

The commands are functions of the package, each returning a `Report` (the report document,
its findings, renderings); they load on first use, so that importing the package and
`ckptforensics --help` stay fast:

    import ckptforensics as cf
    rep = cf.replay("runs/x/step_30.pt", "runs/x/step_40.pt", batch="runs/x/batches.h5")
    rep.cause, rep.first_bad_step
    print(rep.to_markdown())

Every command takes its window first, `(before, after)`, then keywords; the replay's options
are the fields of `ReplayOptions`, by name or as one record (`options=`). `inspect` and
`triage` return a `Report` too (its `kind` says which document it holds).

Each command is one module of `ckptforensics.commands` (`commands/replay.py` holds `replay`);
the package's names are those functions. The training side is `Recorder` (the flight recorder
a loop attaches so that the next incident is replayable).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

COMMANDS = (
    "inspect", "diff", "replay", "bisect", "whatif", "triage", "plan", "recovery", "audit", "regress",
    "history",
)  # fmt: skip
# The façade's names -> the module that holds each (loaded on first use).
_LAZY = {
    **{c: f"commands.{c}" for c in COMMANDS},
    "plan_from": "commands.plan",
    "Report": "commands.common",
    "NotRankZero": "commands.common",
    "ReplayOptions": "core.options",
    "resolve": "commands.common",
    "open_checkpoint": "checkpoints",
    "open_pair": "checkpoints",
    "completeness": "checkpoints",
    "record": None,
    "Recorder": "record",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptforensics' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return mod if _LAZY[name] is None else getattr(mod, name)
