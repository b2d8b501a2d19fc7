"""One exception family, and the one line any failure becomes.

Every `ForensicsError` message names the file, tensor or step, the cause and the fix: bad
input the user can fix (exit 2). Anything else that escapes the library is a fault of the
tool itself (exit 3); `doing()` records what was being read or computed when it happened,
so its one line still names the file, tensor or step.
"""

from __future__ import annotations

import errno as _errno
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

__all__ = [
    "ForensicsError",
    "CheckpointNotFound",
    "UnknownFormat",
    "CorruptCheckpoint",
    "IncompleteCheckpoint",
    "DamagedCheckpoint",
    "UnsafeCheckpoint",
    "IncompatibleCheckpoints",
    "OptimizerMappingError",
    "ReplayMismatch",
    "OutputNotWritable",
    "Failed",
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "doing",
    "one_line",
]

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class ForensicsError(Exception):
    """Bad input the user can fix; the CLI prints it as one line and exits 2."""


class CheckpointNotFound(ForensicsError):
    """A path or step that does not resolve to a checkpoint."""


class UnknownFormat(ForensicsError):
    """A path that no checkpoint reader recognises."""


class CorruptCheckpoint(ForensicsError):
    """A checkpoint file that is truncated or malformed."""


class IncompleteCheckpoint(CorruptCheckpoint):
    """A checkpoint whose save did not finish: a file its format requires is missing or cut short."""


class DamagedCheckpoint(CorruptCheckpoint):
    """A checkpoint file whose bytes fail its own checksum (a zip member's CRC-32): a storage
    fault (disk, copy, transfer) after the save, never evidence about training."""


class UnsafeCheckpoint(ForensicsError):
    """A pickle that asks for code execution; refused, nothing ran."""


class IncompatibleCheckpoints(ForensicsError):
    """Two checkpoints that cannot be compared (parameter sets, shapes, optimizers)."""


class OptimizerMappingError(ForensicsError):
    """Optimizer state whose integer ids cannot be mapped to parameter names unambiguously."""


class ReplayMismatch(ForensicsError):
    """A replay that does not reproduce the run's own log on its first checked step: nothing
    is diagnosed from it (`--allow-mismatch` writes the checkpoint diff's report)."""


class OutputNotWritable(ForensicsError):
    """An --out that cannot be written (read-only, a file in the way, no space)."""


class Failed(Exception):
    """A failure already rendered as its one line (`one_line`), raised where it did not
    happen: on the other torchrun ranks, so that every rank prints the same line and exits
    with the same code."""

    def __init__(self, line: str, exit_code: int) -> None:
        super().__init__(line)
        self.line, self.exit_code = line, exit_code


# What the library is reading or computing now, innermost last ("reading tensor x of a.pt").
_DOING: ContextVar[tuple[str, ...]] = ContextVar("ckptforensics_doing", default=())


@contextmanager
def doing(what: str) -> Iterator[None]:
    """Say what is being read or computed (a file, a tensor, a step) for as long as it runs.

    An exception that is not a ForensicsError leaving the block keeps the innermost such
    description (and a note, shown with --debug), which `one_line` puts in its line."""
    token = _DOING.set((*_DOING.get(), what))
    try:
        yield
    except Exception as e:
        if (
            not isinstance(e, (ForensicsError, Failed))
            and getattr(e, "ckptforensics_doing", None) is None
        ):
            try:
                e.ckptforensics_doing = what  # type: ignore[attr-defined]
                e.add_note(f"(ckptforensics was {what})")
            except (AttributeError, TypeError):  # an exception that takes no attributes
                pass
        raise
    finally:
        _DOING.reset(token)


def _where(e: BaseException) -> str:
    """The innermost frame of this package the exception passed through ('formats/optstate/mapping.py:61')."""
    here = Path(__file__).resolve().parents[1]  # the package's root
    last = ""
    for frame in traceback.extract_tb(e.__traceback__):
        p = Path(frame.filename)
        if p.is_relative_to(here):
            last = f"{p.relative_to(here).as_posix()}:{frame.lineno}"
    return last


def _os_words(e: OSError) -> str:
    """The errno's own words ('Too many levels of symbolic links'), else the message."""
    if e.errno is not None:
        return e.strerror or os.strerror(e.errno)
    return str(e) or type(e).__name__


def one_line(e: BaseException) -> tuple[int, str]:
    """(exit code, the one line for stderr) of any failure.

    ForensicsError: bad input, its message (2). OSError: bad input too, a file the OS would
    not read or write: the path and the errno's words (2). Anything else is the tool's own
    fault (3): what it was doing, the exception's type and message, and where.
    """
    if isinstance(e, Failed):
        return e.exit_code, e.line
    if isinstance(e, ForensicsError):
        return EXIT_BAD_INPUT, f"error: {_flat(str(e))}"
    if isinstance(e, OSError):
        words = _flat(_os_words(e))
        if e.errno == _errno.ELOOP:
            words += " (a symlink loop)"
        if e.filename is not None:
            return EXIT_BAD_INPUT, f"error: {e.filename}: {words}"
        what = getattr(e, "ckptforensics_doing", None)
        return EXIT_BAD_INPUT, f"error: {words}" + (f" (while {what})" if what else "")
    what = getattr(e, "ckptforensics_doing", None)
    where = _where(e)
    msg = _flat(str(e)) or "(no message)"
    line = f"internal error{f' while {what}' if what else ''}: {type(e).__name__}: {msg}"
    if where:
        line += f" [at {where}]"
    return EXIT_INTERNAL, f"error: {line}; run with --debug and report it"


def _flat(text: str, limit: int = 400) -> str:
    """One line: newlines folded, long messages cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
