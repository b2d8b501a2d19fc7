"""A report's files on disk: written together and atomically, and --out checked before any work.

Every file a command writes (report.json/.md/.html, evidence.h5, triage's, bisect's skip
list) goes through `write_files`: all of them or none, never a half-written report.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import list_checkpoints, sniff
from ckptforensics.core.errors import ForensicsError, OutputNotWritable, UnknownFormat
from ckptforensics.formats.locate import STEP_PATTERNS

__all__ = [
    "Content",
    "atomic_write",
    "write_files",
    "current_umask",
    "check_outside",
    "report_inputs",
    "prepare_out",
    "remove_made",
]


def atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: never a half-written report."""
    write_files({path: text})


Content = str | Callable[[Path], None]


def write_files(files: dict[Path, Content]) -> list[Path]:
    """Write a report's files together: each to a temp file beside it (text, or a writer
    given the temp path), flushed to disk, then all renamed into place. A failure on the
    way (no space, a file-size limit, an interrupt) removes the temp files and leaves every
    file of the previous report as it was; only the renames, which cannot run out of
    space, make the new report visible. Returns the paths, in order."""
    staged: list[tuple[Path, Path]] = []
    try:
        for final, content in files.items():
            final.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
            staged.append((Path(tmp), final))
            if isinstance(content, str):
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(content)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                os.close(fd)
                content(Path(tmp))
                _fsync(Path(tmp))
    except BaseException as e:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            where = staged[-1][1] if staged else next(iter(files))
            raise OutputNotWritable(
                f"{where}: cannot be written ({e.strerror or e}); every file already in {where.parent} is as it was"
            ) from None
        raise
    mode = 0o666 & ~current_umask()  # mkstemp makes 0600; a report is for sharing
    for tmp, final in staged:
        os.chmod(tmp, mode)
        os.replace(tmp, final)
    return list(files)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_outside(out: Path, inputs: Sequence[Path]) -> None:
    """Refuse an output path among what a command reads (a report never writes into its
    inputs: a checkpoint may be a trainer's live output, or read-only evidence). Checked by
    the CLI before any work and by `Report.save`. An input is:

    - a checkpoint file: --out may not be the folder it sits in (the report's files would
      land among the run's checkpoints); a folder below it is fine;
    - a checkpoint directory (a layout a reader recognises, or a trainer's checkpoint name):
      --out may not be it or inside it;
    - a run directory (the checkpoints it holds are what is read): --out may not be it, nor
      inside one of its checkpoint directories; a folder of its own below it is fine;
    - a directory that holds no checkpoint (the current one, where a log lies): no input.
    """
    o = Path(os.path.realpath(out))  # realpath: a symlink loop is bad input, said by the reader
    for p in inputs:
        d = Path(os.path.realpath(p))
        if not Path(p).is_dir():
            if Path(p).exists() and o == d.parent:
                raise OutputNotWritable(
                    f"--out {out} is the folder of the input checkpoint {p}: the report's files "
                    f"would land among the checkpoints; pass a directory of its own (e.g. "
                    f"{Path(out) / 'incident'})"
                )
            continue
        try:
            one = _is_checkpoint(Path(p))
            held = [] if one else list_checkpoints(Path(p))
        except OSError:  # a folder that cannot be listed: the command that reads it says so
            continue
        if one:
            if o == d or d in o.parents:
                raise OutputNotWritable(
                    f"--out {out} is inside the input checkpoint {p}; choose a directory outside it"
                )
            continue
        if held and o == d:
            raise OutputNotWritable(
                f"--out {out} is the run directory {p}, which holds the checkpoints read: the "
                f"report's files would land among them; pass a directory of its own (e.g. "
                f"{Path(out) / 'incident'})"
            )
        for _, c in held:
            c_real = Path(os.path.realpath(c))
            if c.is_dir() and (o == c_real or c_real in o.parents):
                raise OutputNotWritable(
                    f"--out {out} is inside the input checkpoint {c}; choose a directory outside it"
                )


def _is_checkpoint(path: Path) -> bool:
    """A directory that is one checkpoint: a trainer's checkpoint name (`checkpoint-30`,
    `global_step30`) or a layout a reader recognises; not a run directory that holds
    several, nor a folder that holds none."""
    if any(pattern.match(path.name) for _, pattern in STEP_PATTERNS):
        return True
    try:
        sniff(path)
    except UnknownFormat:
        return False
    except ForensicsError:  # recognised, but damaged (a link to nothing): still a checkpoint
        return True
    return True


def report_inputs(doc: dict[str, Any]) -> list[Path]:
    """The checkpoints a report read (its incident's before and after)."""
    inc = doc.get("incident") or {}
    return [
        Path(str(inc[k]["path"]))
        for k in ("before", "after")
        if isinstance(inc.get(k), dict) and inc[k].get("path")
    ]


def prepare_out(out: Path, *, file: bool = False) -> list[Path]:
    """Make sure --out can take a report before any work is done.

    `out` is a directory (a file with `file`). Refused, with the reason: a file in the
    way, a file where a parent directory should be, a directory that cannot be created or
    written (read-only, permissions), a filesystem with no room for a first block (a probe
    file is written and removed). Creates the missing directories.

    Returns:
        The directories it created, outermost first (for the caller to remove again if
        the command then fails).

    Raises:
        OutputNotWritable: one line naming --out and the reason.
    """
    target = out.parent if file else out
    if file and out.is_dir():
        raise OutputNotWritable(f"--out {out} is a directory; pass a file name")
    if not file and (out.exists() or out.is_symlink()) and not out.is_dir():
        raise OutputNotWritable(
            f"--out {out}: a file is in the way (--out is a directory for the report's files); pass another path"
        )
    missing: list[Path] = []
    anchor = target
    while not (anchor.exists() or anchor.is_symlink()) and anchor != anchor.parent:
        missing.append(anchor)
        anchor = anchor.parent
    if not anchor.is_dir():
        raise OutputNotWritable(f"--out {out}: {anchor} is not a directory; pass another path")
    made: list[Path] = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except OSError as e:
                raise OutputNotWritable(
                    f"--out {out}: cannot create {d} ({e.strerror or e})"
                ) from None
            made.append(d)
        try:
            fd, probe = tempfile.mkstemp(prefix=".ckptforensics-probe-", dir=target)
        except OSError as e:
            raise OutputNotWritable(
                f"--out {out}: cannot write in {target} ({e.strerror or e})"
            ) from None
        try:
            left = memoryview(b"\0" * _PROBE_BYTES)
            while left:  # a write near a size limit is short; the next one fails
                left = left[os.write(fd, left) :]
            os.fsync(fd)
        except OSError as e:
            raise OutputNotWritable(
                f"--out {out}: cannot write in {target} ({e.strerror or e})"
            ) from None
        finally:
            os.close(fd)
            Path(probe).unlink(missing_ok=True)
    except BaseException:
        remove_made(made)
        raise
    return made


# One filesystem block: a full disk (or a file-size limit of less) is refused before any work.
_PROBE_BYTES = 4096


def remove_made(made: list[Path]) -> None:
    """Remove directories `prepare_out` created, innermost first, if they are still empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return
