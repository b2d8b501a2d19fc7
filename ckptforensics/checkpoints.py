"""Open any checkpoint a run wrote, and find it by its step: `formats`' generic readers with
every trainer's layout registered, and `formats.locate` with every trainer's checkpoint names
(importing `trainers` registers them). Code above the trainers opens checkpoints and resolves
steps through here, so that no reader or name is missing whichever module loads first."""

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
from ckptforensics.formats.locate import list_checkpoints, resolve_checkpoint

__all__ = [
    "FORMATS",
    "SNIFFERS",
    "completeness",
    "first_complete",
    "format_names",
    "is_builtin",
    "list_checkpoints",
    "load_plugins",
    "open_checkpoint",
    "open_pair",
    "require_complete",
    "resolve_checkpoint",
    "settle_pair",
    "single_file",
    "sniff",
]
