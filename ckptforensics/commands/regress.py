"""`regress`: one state and one batch under two versions of the code (another model factory,
or another interpreter: a venv with another torch or transformers), compared module by
module against the reference's own run-to-run noise; the report's `regress` block."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.commands.common import (
    Progress,
    Report,
    number_findings,
    rank_zero,
    replay_config,
)
from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.core.options import ReplayOptions, replay_options
from ckptforensics.detectors import Finding
from ckptforensics.detectors.causes import lookup
from ckptforensics.detectors.regress import regress_findings
from ckptforensics.engine.regress import RegressOptions, RegressResult
from ckptforensics.engine.regress import regress as regress_engine
from ckptforensics.engine.replay import distributed
from ckptforensics.report import build_report
from ckptforensics.verdict import Verdict


def regress(
    step: str | int | Path,
    *,
    against_model: str | None = None,
    against_python: str | Path | None = None,
    against_env: dict[str, str] | None = None,
    steps: int = 1,
    batch: str | Path | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.regress",
    **option: Any,
) -> Report:
    """Step `steps` steps from the checkpoint of `step` (a step resolved in `run_dir`, or a
    path) under side A (the option `model`) twice and under side B (`against_model`, or A's
    model in the interpreter `against_python` with `against_env` set), and say where B parts
    from A: `report.doc["regress"]["status"]` is 'identical', 'equivalent' or 'parted', the
    verdict's `first_anomalous_module` names where. Other options as for `replay`. Under
    torchrun the ranks step the FSDP2-sharded model on their rows (`run_regress`); rank 0
    returns the report, the others raise `NotRankZero`.

    Example:
        >>> rep = cf.regress(30, run_dir="runs/x", batch="runs/x/batches.h5",
        ...                  model="train.py:model", against_model="train_new.py:model")
        >>> rep.doc["regress"]["status"], rep.verdict["first_anomalous_module"]
    """
    opts = RegressOptions(
        against_model=against_model,
        against_python=Path(against_python) if against_python is not None else None,
        against_env=dict(against_env or {}),
        steps=steps,
    )
    if opts.against_python is not None and not opts.against_python.is_file():
        raise ForensicsError(f"--against-python {against_python}: no such interpreter")
    cfg = replay_config(step, None, batch, run_dir, replay_options(options, **option))
    return Report(*rank_zero(run_regress(cfg, opts, command=command, progress=progress), "regress"))


def run_regress(
    cfg: Any, opts: RegressOptions, *, command: str, progress: Progress | None = None
) -> tuple[dict[str, Any], list[Finding]] | None:
    """The regression, its findings, verdict and report document.

    Under torchrun (WORLD_SIZE > 1) the ranks run both sides together, each on its rows and
    its FSDP2 shards (`engine.regress.run`), and reach the same figures; rank 0 returns the
    report, the other ranks None (they write nothing).
    """
    if cfg.after is not None:
        raise ForensicsError("regress steps forward from one checkpoint: pass --step, not --after")
    with distributed.joined(cfg.device) as ranks, doing(f"regressing from {cfg.before}"):
        res = regress_engine(cfg, opts, progress)
    if ranks is not None and ranks.rank != 0:
        return None
    findings = number_findings(regress_findings(res))
    verdict = _verdict(res, str(cfg.before), findings)
    with open_checkpoint(cfg.before) as a:
        doc = build_report(
            command=command,
            before=a,
            after=a,
            verdict=verdict,
            findings=findings,
            sections={"regress": regress_section(res, cfg)},
            plan=False,
        )
    return doc, findings


def _size(d: Any) -> str:
    if not math.isfinite(d.max_abs):
        return "non-finite or mis-shaped values"
    return f"{d.max_abs:.3g} max abs, {d.max_rel:.3g} relative, {d.max_ulps:.0f} ulps"


def _verdict(res: RegressResult, before: str, findings: list[Finding]) -> Verdict:
    """Identical, equivalent (cause none) or parted (cause code_change, the module named)."""
    a, b = res.sides["a"], res.sides["b"]
    first = res.steps[0].step
    head = f"Regress from {Path(before).name}, step {first}" + (
        f" and {len(res.steps) - 1} more" if len(res.steps) > 1 else ""
    )
    names = f"B ({_side(b)}) against A ({_side(a)})"
    off = next((f for f in findings if f.kind == "regress_off_track"), None)
    if res.status == "parted":
        p = res.parting
        where = (
            f"parts in the {p.direction} at `{p.module or 'the model'}` ({p.where}): {_size(p.delta)}"
            if p is not None
            else "parts on the loss or grad norm while every tensor agrees within A's noise"
        )
        track = f" {off.message[0].upper()}{off.message[1:]}." if off is not None else ""
        v = Verdict(
            summary=f"{head}: {names} {where}.{track}",
            causes=[
                {
                    "cause": "code_change",
                    "confidence": 1.0,
                    "evidence": [f.id for f in findings if "code_change" in f.supports],
                }
            ],  # fmt: skip
            rollback_checkpoint=None,
        )
        if p is not None and p.direction != "update":
            v.first_anomalous_module = p.module or None
            v.exploding_layers = [p.module] if p.module else []
        v.recommended_actions = list(lookup("code_change").actions)
        return v
    said = (
        "is bitwise identical on every module's tensors and gradients and every parameter"
        if res.status == "identical"
        else f"is equivalent: it differs only within A's own run-to-run noise ({res.noise_floor:.3g} relative)"
    )
    return Verdict(
        summary=f"{head}: {names} {said}.",
        causes=[{"cause": "none", "confidence": 1.0, "evidence": []}],
        rollback_checkpoint=None,
    )


def _side(s: dict[str, Any]) -> str:
    """'--model x.py:f' or 'python /venv/bin/python, ATEN_CPU_CAPABILITY=default'."""
    out = f"--model {s['model']}" if s.get("model") else "the run's model"
    if s.get("python") and s["python"] != "this process":
        out += f" in {s['python']}"
    env = s.get("env") or {}
    if env:
        out += " with " + ", ".join(f"{k}={v}" for k, v in env.items())
    return out


def _delta(d: Any) -> dict[str, Any]:
    return {
        "max_abs": d.max_abs,
        "max_rel": d.max_rel,
        "max_ulps": d.max_ulps,
        "differing": d.differing,
        "numel": d.numel,
        "nonfinite": d.nonfinite,
        "bitwise_equal": d.identical,
    }


def regress_section(res: RegressResult, cfg: Any) -> dict[str, Any]:
    """The report's `regress` block: status, where it parts, each side, the first step's
    tensors (A's order), the parameters and each step after the K steps, the noise."""
    p = res.parting
    return {
        "status": res.status,
        "parting": None
        if p is None
        else {
            "module": p.module,
            "direction": p.direction,
            "where": p.where,
            "tensor": p.key,
            "max_abs": p.delta.max_abs,
            "max_rel": p.delta.max_rel,
            "max_ulps": p.delta.max_ulps,
            "noise_max_abs": p.noise.max_abs,
        },
        "sides": res.sides,
        "before": str(cfg.before),
        "modules": [
            {
                "tensor": m.event.key,
                "module": m.event.module,
                "caller": m.event.caller,
                "phase": m.event.phase,
                "side": m.event.side,
                "dtype": m.dtype,
                "shape": list(m.shape),
                **_delta(m.delta),
                "noise_max_abs": m.noise.max_abs,
                "noise_max_rel": m.noise.max_rel,
                "exceeds": m.exceeds,
            }
            for m in res.modules
        ],
        "params": [
            {
                "name": x.name,
                **_delta(x.delta),
                "noise_max_abs": x.noise.max_abs,
                "exceeds": x.exceeds,
            }
            for x in res.params
        ],  # fmt: skip
        "steps": [
            {
                "step": s.step,
                "loss_a": s.loss_a,
                "loss_b": s.loss_b,
                "loss_a2": s.loss_a2,
                "grad_norm_a": s.grad_norm_a,
                "grad_norm_b": s.grad_norm_b,
                "grad_norm_a2": s.grad_norm_a2,
                "exceeds": s.exceeds(res.noise_floor),
            }
            for s in res.steps
        ],
        "unmatched": res.unmatched,
        "noise": {"floor": res.noise_floor, "factor": res.noise_factor},
        "check": {"a": res.check_a.as_dict(), "b": res.check_b.as_dict()},
        "config": res.config,
    }
