"""One exception family: every message names the file, tensor or step, the cause and the fix."""

from __future__ import annotations

__all__ = [
    "ForensicsError",
    "CheckpointNotFound",
    "UnknownFormat",
    "CorruptCheckpoint",
    "UnsafeCheckpoint",
    "IncompatibleCheckpoints",
    "OptimizerMappingError",
    "ReplayMismatch",
]


class ForensicsError(Exception):
    """Bad input the user can fix; the CLI prints it as one line and exits 2."""


class CheckpointNotFound(ForensicsError):
    """A path or step that does not resolve to a checkpoint."""


class UnknownFormat(ForensicsError):
    """A path that no checkpoint reader recognises."""


class CorruptCheckpoint(ForensicsError):
    """A checkpoint file that is truncated or malformed."""


class UnsafeCheckpoint(ForensicsError):
    """A pickle that asks for code execution; refused, nothing ran."""


class IncompatibleCheckpoints(ForensicsError):
    """Two checkpoints that cannot be compared (parameter sets, shapes, optimizers)."""


class OptimizerMappingError(ForensicsError):
    """Optimizer state whose integer ids cannot be mapped to parameter names unambiguously."""


class ReplayMismatch(ForensicsError):
    """A replay that does not reproduce the run's own log on its first checked step: nothing
    is diagnosed from it (`--allow-mismatch` writes the checkpoint diff's report)."""
