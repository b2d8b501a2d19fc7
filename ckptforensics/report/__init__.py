"""The report: one JSON document (schema ckptforensics.report/1) and its renderings.

The package's face: `build_report` assembles a document, `write_report` writes its files;
the document's rules are `document`'s, the files' `files`'; a report's sections are built
once (`sections`, in `blocks`, its lead words in `words`) and rendered by `markdown` and
`html` (over `page`, `text`); `evidence` (evidence.h5), `timeline` (triage) and `inspect`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptforensics import __version__
from ckptforensics.core.errors import ForensicsError
from ckptforensics.detectors import Finding
from ckptforensics.engine.diff.pair import DiffResult
from ckptforensics.formats.base import Checkpoint
from ckptforensics.planner import plan_section
from ckptforensics.report.document import SCHEMA, clean, schema, to_json
from ckptforensics.report.evidence import write_h5
from ckptforensics.report.files import (
    Content,
    atomic_write,
    check_outside,
    current_umask,
    prepare_out,
    remove_made,
    report_inputs,
    write_files,
)
from ckptforensics.report.html import render_html
from ckptforensics.report.markdown import render_markdown
from ckptforensics.verdict import Verdict

__all__ = [
    "SCHEMA",
    "build_report",
    "clean",
    "diff_section",
    "write_report",
    "write_files",
    "atomic_write",
    "check_outside",
    "current_umask",
    "report_inputs",
    "prepare_out",
    "remove_made",
    "to_json",
    "render_markdown",
    "render_html",
    "schema",
]


def _ckpt_info(c: Checkpoint) -> dict[str, Any]:
    return {"path": str(c.path), "step": c.step, "format": c.format}


def diff_section(diff: DiffResult) -> dict[str, Any]:
    """The report's `diff` block: pair info and the per-tensor table."""
    rows = []
    for t in diff.tensors:
        row = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name != "candidates"}
        row["candidates"] = len(t.candidates)
        rows.append(row)
    return {"pair": clean(diff.pair), "tensors": clean(rows)}


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
    `plan`, the resume plan its verdict calls for (`planner.plan_section`)."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "incident": {
            "before": _ckpt_info(before),
            "after": _ckpt_info(after),
            "command": command,
            "tool_version": __version__,
        },
        "verdict": clean(verdict.as_dict()),
        "findings": [clean(dataclasses.asdict(f)) for f in findings],
        "diff": diff_section(diff) if diff is not None else {},
        "replay": {},
        "bisect": {},
        "whatif": {},
    }
    for k, v in (sections or {}).items():
        doc[k] = clean(v)
    if plan:
        doc["plan"] = clean(_plan(doc, before))
    return doc


def _plan(doc: dict[str, Any], before: Checkpoint) -> dict[str, Any]:
    """The resume plan every report carries (`planner.plan_section`). A checkpoint whose files
    the planner cannot read leaves the diagnosis whole: the plan says why it is missing."""
    try:
        return plan_section(doc, before)
    except ForensicsError as e:
        return {"status": "unavailable", "notes": [str(e)]}


def write_report(
    out_dir: Path, doc: dict[str, Any], extra: dict[str, str] | None = None
) -> list[Path]:
    """report.json, report.md, report.html and evidence.h5 (and `extra` files by name, such
    as bisect's skip.json) under `out_dir`, written together (`write_files`). The document
    records `out_dir` as `incident.report_dir`: the plan's recovery command names it."""
    doc["incident"]["report_dir"] = str(out_dir)
    files: dict[Path, Content] = {
        out_dir / "report.json": to_json(doc),
        out_dir / "report.md": render_markdown(doc),
        out_dir / "report.html": render_html(doc),
        out_dir / "evidence.h5": lambda tmp: write_h5(tmp, doc),
    }
    files.update({out_dir / name: text for name, text in (extra or {}).items()})
    return write_files(files)
