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

`diff`, `replay`, `bisect`, `whatif`, `triage`, `plan`, `recovery` and `audit` are also the
names of the package's submodules; the package keeps the command under each name (the
submodule stays importable: `from ckptforensics.engine.replay.run import plan`, or
`from ckptforensics.engine.replay import engine`; `import ckptforensics.engine.replay.run as engine`
reads the name `replay` off the package and finds the command, so it fails). The training
side is `Recorder` (the flight recorder a loop attaches so that the next incident is
replayable).
"""

from __future__ import annotations

import sys
import types
from typing import Any

__version__ = "0.1.0"

COMMANDS = ("inspect", "diff", "replay", "bisect", "whatif", "triage", "plan", "recovery", "audit")
_LAZY = {
    **dict.fromkeys(COMMANDS, "commands.api"),
    "Report": "commands.api",
    "ReplayOptions": "core.options",
    "resolve": "commands.api",
    "open_checkpoint": "formats",
    "open_pair": "formats",
    "completeness": "formats",
    "record": None,
    "Recorder": "record",
}

__all__ = ["__version__", *_LAZY]


class _Package(types.ModuleType):
    """The package module. Importing a submodule binds it on its package under its name;
    for the command names that binding is skipped, so `cf.replay` stays the command
    whatever has been imported (the submodule is in sys.modules, where imports find it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in COMMANDS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptforensics' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return mod if _LAZY[name] is None else getattr(mod, name)
