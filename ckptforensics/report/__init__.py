"""The report: one JSON document (schema ckptforensics.report/1) and its renderings."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..detectors import Finding
from ..diff import DiffResult
from ..formats.base import Checkpoint
from ..verdict import Verdict
from .markdown import render_markdown

__all__ = ["SCHEMA", "build_report", "write_report", "atomic_write", "to_json", "render_markdown", "schema"]

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
) -> dict[str, Any]:
    """Assemble the report document with its stable keys (schema: report/schema.json)."""
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
    return doc


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: never a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600; a report is for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_report(out_dir: Path, doc: dict[str, Any]) -> list[Path]:
    """report.json, report.md, report.html and evidence.h5 under `out_dir`, each atomically."""
    from .evidence import write_evidence
    from .html import render_html

    out = [out_dir / "report.json", out_dir / "report.md", out_dir / "report.html", out_dir / "evidence.h5"]
    atomic_write(out[0], to_json(doc))
    atomic_write(out[1], render_markdown(doc))
    atomic_write(out[2], render_html(doc))
    write_evidence(out[3], doc)
    return out


def schema() -> dict[str, Any]:
    """The JSON Schema of report.json (shipped in the package)."""
    return json.loads((Path(__file__).with_name("schema.json")).read_text())
