"""Open any checkpoint a run wrote: `formats`' generic readers with every trainer's layout
registered (importing `trainers` registers them). Code above the trainers opens checkpoints
through here, so that no reader is missing whichever module loads first."""

from __future__ import annotations

from ckptforensics import trainers  # noqa: F401  (registers every trainer's checkpoint layout)
from ckptforensics.formats import (
    FORMATS,
    SNIFFERS,
    completeness,
    first_complete,
    format_names,
    is_builtin,
    load_plugins,
    open_checkpoint,
    open_pair,
    require_complete,
    settle_pair,
    single_file,
    sniff,
)

__all__ = [
    "FORMATS",
    "SNIFFERS",
    "completeness",
    "first_complete",
    "format_names",
    "is_builtin",
    "load_plugins",
    "open_checkpoint",
    "open_pair",
    "require_complete",
    "settle_pair",
    "single_file",
    "sniff",
]
