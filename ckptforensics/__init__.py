"""ckptforensics: post-mortem forensics for loss spikes in large-model pre-training.

The library API is `ckptforensics.api` (the commands as functions, each returning a
`Report`); it is loaded on first use, so that importing the package and
`ckptforensics --help` stay fast:

    from ckptforensics.api import diff, replay, bisect, whatif, triage
    rep = diff(30, 40, run_dir="runs/x")
    print(rep.to_markdown())

The functions live in `api`, not at the package's top level, because `diff`, `replay`,
`bisect`, `whatif` and `triage` are also the package's submodules: importing one would
replace a top-level function of the same name.

The training side is `ckptforensics.record` (`Recorder`: the flight recorder a loop
attaches so that the next incident is replayable).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {"api": None, "Report": "api", "open_checkpoint": "formats", "open_pair": "formats", "completeness": "formats", "record": None, "Recorder": "record"}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ckptforensics' has no attribute {name!r}")
    import importlib

    mod = importlib.import_module(f"{__name__}.{_LAZY[name] or name}")
    return mod if _LAZY[name] is None else getattr(mod, name)
