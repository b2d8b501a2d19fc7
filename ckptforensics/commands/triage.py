"""`triage`: the first bad step of a training log and the checkpoint to roll back to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptforensics.commands.common import (
    TRIAGE_SCHEMA,
    Report,
)
from ckptforensics.engine.triage import as_dict
from ckptforensics.engine.triage import triage as _triage
from ckptforensics.logs import discover_metrics, skipped_note
from ckptforensics.report import (
    clean,
)


def triage(
    metrics: str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    config: Any = None,
    keys: dict[str, str] | None = None,
) -> Report:
    """The first bad step in a training log and the checkpoint to roll back to; the log is
    discovered in `run_dir` when not given. `config`: a `triage.TriageConfig`; `keys`: the
    log's column names for loss / grad_norm / lr. The report's `result` is the
    `triage.TriageResult`; `first_bad_step` and `rollback` read it. What was passed over
    (the document's `skipped`, shown in the report) leads with the log's lines that were
    not read, one line per file (each leg's `skipped` lists them), then the incomplete
    checkpoints."""

    rd = Path(run_dir) if run_dir is not None else None
    log = Path(metrics) if metrics is not None else discover_metrics(rd or Path("."))
    res = _triage(log, rd, config, keys)
    doc = {"schema": TRIAGE_SCHEMA, **clean(as_dict(res))}
    lines = [skipped_note(leg["source"], leg["skipped"]) for leg in res.legs if leg.get("skipped")]
    doc["skipped"] = [*dict.fromkeys(lines), *doc.get("skipped", [])]  # one note per file
    return Report(doc, result=res)
