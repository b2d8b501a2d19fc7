"""`recovery`: did the resumed run recover? The engine's judgement (`engine.recovery`) made a
report: its findings (a failed check, a relapse), the document and the actions it recommends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import list_checkpoints, open_checkpoint
from ckptforensics.commands.common import (
    Report,
    resolve,
    step_of,
)
from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.tensors import CURVE_SHORT
from ckptforensics.detectors import Finding
from ckptforensics.engine.recovery import recovery as _recovery
from ckptforensics.engine.recovery.assess import RecoveryResult
from ckptforensics.engine.recovery.trajectory import Z_BAND
from ckptforensics.report import (
    build_report,
)
from ckptforensics.report.evidence import load_report
from ckptforensics.verdict import Verdict

__all__ = ["recovery", "recovery_findings", "recovery_report"]


_CRITICAL_CHECKS = ("optimizer_state", "skipped_samples")


def recovery_findings(res: RecoveryResult) -> list[Any]:
    """The verdict as a finding (info when recovered, warning while recovering, critical when
    not recovered or relapsed), and one per failed check (critical for a lost optimizer state
    and for skipped samples seen again, warning for a setting the plan changed that the
    resumed run does not run with)."""

    sev = {
        "recovered": "info",
        "recovering": "warning",
        "not recovered": "critical",
        "relapsed": "critical",
    }[res.status]
    out = [
        Finding(
            "F1", "recovery", "run", 1.0, sev,
            {"status": res.status, "step": res.step, "resumed_from": res.resumed_from, "windows": len(res.windows), "band_z": Z_BAND},
            res.summary, "docs/signatures.md#recovery", (),
        )
    ]  # fmt: skip
    for c in res.checks:
        if c.status == "failed":
            out.append(
                Finding(
                    f"F{len(out) + 1}", f"resume_{c.name}", "run", 1.0, "critical" if c.name in _CRITICAL_CHECKS else "warning",
                    {"expected": c.expected, "observed": c.observed, "step": c.step}, c.message, "docs/signatures.md#recovery-checks", (),
                )
            )  # fmt: skip
    return out


def recovery_report(res: RecoveryResult, command: str) -> tuple[dict[str, Any], list[Any]]:
    """The `recovery` report document (schema `ckptforensics.report/1`, section `recovery`):
    *before* is the checkpoint the run resumed from, *after* the first the resumed leg wrote."""

    findings = recovery_findings(res)
    causes = (
        [{"cause": "none", "confidence": 1.0, "evidence": []}]
        if res.status == "recovered"
        else [{"cause": "undiagnosed", "confidence": 0.0, "evidence": [f.id for f in findings]}]
    )
    v = Verdict(
        summary=res.summary,
        causes=causes,
        first_bad_step=res.step if res.status == "relapsed" else None,
    )
    v.recommended_actions = _actions(res)
    run = Path(res.run_dir or ".")
    back = next(
        (p for s, p in (list_checkpoints(run) if run.is_dir() else []) if s == res.resumed_from),
        None,
    )
    paths = [
        p
        for p in (back, Path(res.checkpoint_after) if res.checkpoint_after else None)
        if p is not None
    ]
    opened = [open_checkpoint(p, check=False) for p in paths]
    try:
        a = opened[0] if opened else _Nowhere(res.resumed_from)
        b = opened[-1] if opened else a
        doc = build_report(
            command=command,
            before=a,
            after=b,
            verdict=v,
            findings=findings,
            sections={"recovery": res.as_dict()},
            plan=False,
        )
    finally:
        for c in opened:
            c.close()
    return doc, findings


@dataclass
class _Nowhere:
    """The report's *before* where the rollback checkpoint is not in the run directory."""

    step: int
    path: str = "(not in the run directory)"
    format: str = "unknown"


def _actions(res: RecoveryResult) -> list[str]:
    out = []
    failed = {c.name: c for c in res.checks if c.status == "failed"}
    if "optimizer_state" in failed:
        out.append(
            f"Resume again from step {res.resumed_from} with the optimizer state loaded (see the plan's resume keys)."
        )
    if "skipped_samples" in failed:
        out.append(
            "The skip list did not reach the data loader: apply it as the plan's skip section says, then resume again."
        )
    for name in ("lr", "clip", "precision", "loss_scale"):
        if name in failed:
            out.append(f"Set {name.replace('_', ' ')} as the plan says: {failed[name].message}.")
    if res.status == "relapsed":
        out.append(
            f"The mitigation did not hold: run `ckptforensics replay` on the window around step {res.step} of the resumed leg."
        )
    elif res.status == "not recovered":
        out.append("Roll back further, or try a stronger mitigation (`ckptforensics whatif`).")
    elif res.status == "recovering":
        out.append("Run `ckptforensics recovery` again after more steps.")
    return out


def recovery(
    run_dir: str | Path,
    resumed_from: int,
    *,
    metrics: str | Path | None = None,
    plan: str | Path | dict[str, Any] | None = None,
    flight: str | Path | None = None,
    checkpoint: str | int | Path | None = None,
    window: int | None = None,
    command: str = "ckptforensics.recovery",
) -> Report:
    """Whether the run resumed at step `resumed_from` recovered: its log against the
    pre-incident trajectory (`recovered` at step S, `recovering`, `not recovered`, `relapsed`
    at step S) and the checks that the resume was the plan (`plan`: a plan report, its
    directory, or its `plan` section), in the `recovery` section."""

    rd = Path(run_dir)
    section, source = None, None
    if isinstance(plan, dict):
        section = plan.get("plan", plan)
    elif plan is not None:
        pp = Path(plan)
        pp = pp / "report.json" if pp.is_dir() else pp
        section, source = load_report(pp).get("plan") or {}, str(pp)
    ck = resolve(checkpoint, rd) if checkpoint is not None else None
    at = step_of(ck) if ck is not None else None
    if at is not None and at <= int(resumed_from):  # the window (resumed_from, at] is empty
        raise ForensicsError(
            f"--checkpoint {ck} (step {at}) is not after --resumed-from {resumed_from}: pass a "
            "checkpoint the resumed run wrote, or none (the first complete one after the resume)"
        )
    res = _recovery(rd, int(resumed_from), metrics=Path(metrics) if metrics else None, plan=section, plan_source=source,
                    flight=Path(flight) if flight else None, checkpoint=ck, width=window or CURVE_SHORT)  # fmt: skip
    doc, findings = recovery_report(res, command)
    return Report(doc, findings)
