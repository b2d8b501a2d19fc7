"""The report: one JSON document (schema ckptforensics.report/1) and its renderings."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptforensics import __version__
from ckptforensics.core.errors import OutputNotWritable
from ckptforensics.detectors import Finding
from ckptforensics.engine.diff.pair import DiffResult
from ckptforensics.formats.base import Checkpoint
from ckptforensics.report.markdown import render_markdown
from ckptforensics.verdict import Verdict

__all__ = [
    "SCHEMA",
    "build_report",
    "clean",
    "write_report",
    "write_files",
    "atomic_write",
    "check_outside",
    "report_inputs",
    "prepare_out",
    "remove_made",
    "to_json",
    "render_markdown",
    "schema",
]

SCHEMA = "ckptforensics.report/1"


def _ckpt_info(c: Checkpoint) -> dict[str, Any]:
    return {"path": str(c.path), "step": c.step, "format": c.format}


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats -> None (strict JSON has no NaN), tuples -> lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _clean({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    return x


clean = _clean  # public: a section built outside `build_report` (api.plan's) is made JSON-safe the same way


def diff_section(diff: DiffResult) -> dict[str, Any]:
    """The report's `diff` block: pair info and the per-tensor table."""
    rows = []
    for t in diff.tensors:
        row = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "candidates"}
        row["candidates"] = len(t.candidates)
        rows.append(row)
    return {"pair": _clean(diff.pair), "tensors": _clean(rows)}


def build_report(
    *,
    command: str,
    before: Checkpoint,
    after: Checkpoint,
    verdict: Verdict,
    findings: Sequence[Finding],
    diff: DiffResult | None = None,
    sections: dict[str, Any] | None = None,
    plan: bool = True,
) -> dict[str, Any]:
    """Assemble the report document with its stable keys (schema: report/schema.json); with
    `plan`, the resume plan its verdict calls for (`plan.plan_section`)."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "incident": {
            "before": _ckpt_info(before),
            "after": _ckpt_info(after),
            "command": command,
            "tool_version": __version__,
        },
        "verdict": _clean(verdict.as_dict()),
        "findings": [_clean(dataclasses.asdict(f)) for f in findings],
        "diff": diff_section(diff) if diff is not None else {},
        "replay": {},
        "bisect": {},
        "whatif": {},
    }
    for k, v in (sections or {}).items():
        doc[k] = _clean(v)
    if plan:
        doc["plan"] = _clean(_plan(doc, before))
    return doc


def _plan(doc: dict[str, Any], before: Checkpoint) -> dict[str, Any]:
    """The resume plan every report carries (`plan.plan_section`). A checkpoint whose files
    the planner cannot read leaves the diagnosis whole: the plan says why it is missing."""
    from ckptforensics.core.errors import ForensicsError
    from ckptforensics.planner import plan_section

    try:
        return plan_section(doc, before)
    except ForensicsError as e:
        return {"status": "unavailable", "notes": [str(e)]}


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


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
    """Refuse an output path inside an input checkpoint directory (a report never writes
    into what it reads: a checkpoint directory may be a trainer's live output, or
    read-only evidence). Checked by the CLI before any work and by `Report.save`."""
    o = Path(os.path.realpath(out))  # realpath: a symlink loop is bad input, said by the reader
    for p in inputs:
        d = Path(os.path.realpath(p))
        if Path(p).is_dir() and (o == d or d in o.parents):
            raise OutputNotWritable(
                f"--out {out} is inside the input checkpoint {p}; choose a directory outside it"
            )


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


def write_report(
    out_dir: Path, doc: dict[str, Any], extra: dict[str, str] | None = None
) -> list[Path]:
    """report.json, report.md, report.html and evidence.h5 (and `extra` files by name, such
    as bisect's skip.json) under `out_dir`, written together (`write_files`)."""
    from ckptforensics.report.evidence import write_h5
    from ckptforensics.report.html import render_html

    files: dict[Path, Content] = {
        out_dir / "report.json": to_json(doc),
        out_dir / "report.md": render_markdown(doc),
        out_dir / "report.html": render_html(doc),
        out_dir / "evidence.h5": lambda tmp: write_h5(tmp, doc),
    }
    files.update({out_dir / name: text for name, text in (extra or {}).items()})
    return write_files(files)


def schema() -> dict[str, Any]:
    """The JSON Schema of report.json (shipped in the package)."""
    return json.loads((Path(__file__).with_name("schema.json")).read_text())
