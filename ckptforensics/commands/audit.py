"""Audit a run for known instability risks before the next spike (`ckptforensics audit`).

`trace` reads the architecture off one traced forward pass, `evidence` gathers what the run
recorded, `checks` judges each risk (pure), and `run_audit` assembles the report: every
check as a row with its figure, threshold and source, risks first by severity, and a
verdict naming the failure modes the run is exposed to.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import list_checkpoints, open_checkpoint
from ckptforensics.commands.common import (
    Progress,
    Report,
    resolve,
)
from ckptforensics.core.errors import CheckpointNotFound
from ckptforensics.detectors.audit import (
    AREAS,
    CHECKS,
    AuditEvidence,
    Check,
    check_findings,
    run_checks,
)
from ckptforensics.detectors.base import with_id
from ckptforensics.engine.audit import AuditConfig, earlier_checkpoint, gather
from ckptforensics.engine.diff.shard import (
    compute_device,
)
from ckptforensics.engine.trace import (
    PLACEMENTS,
    Architecture,
    AttentionLayer,
    trace_architecture,
    trace_pass,
)
from ckptforensics.report import (
    build_report,
)
from ckptforensics.verdict import decide_audit

__all__ = [
    "AuditConfig",
    "AuditEvidence",
    "Check",
    "CHECKS",
    "AREAS",
    "PLACEMENTS",
    "Architecture",
    "AttentionLayer",
    "trace_architecture",
    "trace_pass",
    "run_checks",
    "run_audit",
    "default_checkpoint",
]


def run_audit(
    cfg: AuditConfig, *, command: str, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """`ckptforensics audit`: the report document (schema `ckptforensics.report/1`, with its
    `architecture` and `audit` sections) and the findings (one per risk).

    Raises:
        ForensicsError: the checkpoint cannot be read.
    """

    with open_checkpoint(cfg.checkpoint) as a:
        ev = gather(cfg, a, progress)
        rows = run_checks(ev)
        findings = [_numbered(f, i) for i, f in enumerate(check_findings(rows), 1)]
        verdict = decide_audit(findings, rows, checkpoint=str(cfg.checkpoint))
        earlier = (
            earlier_checkpoint(cfg, a, cfg.run_dir or cfg.checkpoint.parent)
            if ev.prev is not None
            else None
        )
        arch = (
            ev.arch.as_dict()
            if ev.arch is not None
            else {"norm_placement": None, "qk_norm": None, "note": ev.arch_note}
        )
        section = {
            "checkpoint": str(cfg.checkpoint),
            "step": ev.step,
            "compared_with": {"path": str(earlier), "step": ev.prev_step}
            if earlier is not None
            else None,
            "batch": ev.batch_source,
            "rows": [r.as_dict() for r in rows],
            "counts": {
                s: sum(1 for r in rows if r.status == "risk" and r.severity == s)
                for s in ("critical", "warning", "info")
            },
            "notes": list(ev.notes),
        }
        if earlier is not None:
            with open_checkpoint(earlier) as b:
                doc = build_report(
                    command=command,
                    before=b,
                    after=a,
                    verdict=verdict,
                    findings=findings,
                    sections={"architecture": arch, "audit": section},
                )
        else:
            doc = build_report(
                command=command,
                before=a,
                after=a,
                verdict=verdict,
                findings=findings,
                sections={"architecture": arch, "audit": section},
            )
    return doc, findings


def _numbered(f: Any, i: int) -> Any:

    return with_id(f, i)


def default_checkpoint(run_dir: Path) -> Path:
    """The run's latest checkpoint (what `audit` reads without a STEP)."""

    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointNotFound(
            f"{run_dir}: no checkpoint found (checkpoint-N, iter_N, step_N, global_stepN, *step=N*.ckpt); pass STEP or a path"
        )
    return found[-1][1]


def audit(
    step: str | int | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    compare: str | int | Path | None = None,
    model: str | None = None,
    batch: str | Path | None = None,
    metrics: str | Path | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
    command: str = "ckptforensics.audit",
) -> Report:
    """Audit a checkpoint (a step resolved in `run_dir`, a path, or None: the run's latest)
    for known instability risks: `report.doc["architecture"]` (norm placement, QK-norm, ...)
    and `report.doc["audit"]["rows"]` (each check's figure, threshold and source). `compare`:
    an earlier checkpoint for the rows that compare two (default: the one before; "none": skip).

        rep = cf.api.audit(run_dir="runs/x")
        rep.doc["architecture"]["norm_placement"], [r["id"] for r in rep.doc["audit"]["rows"] if r["status"] == "risk"]
    """

    compute_device(device)  # a GPU torch cannot see: bad input, before any reading
    rd = Path(run_dir) if run_dir is not None else Path(".")
    path = resolve(step, rd) if step is not None else default_checkpoint(rd)
    cmp: Path | bool | None = None
    if compare is not None:
        cmp = False if str(compare).lower() == "none" else resolve(compare, rd)
    cfg = AuditConfig(
        checkpoint=path,
        compare=cmp,
        run_dir=rd if run_dir is not None else path.parent,
        model=model,
        batch=str(batch) if batch is not None else None,
        metrics=Path(metrics) if metrics is not None else None,
        device=device,
    )
    return Report(*run_audit(cfg, command=command, progress=progress))
