"""`replay`: the window replayed from *before* with probes, merged with the pair's diff into one
verdict; the report's `replay` block."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ckptforensics.commands.common import (
    Progress,
    Report,
    close_all,
    note_unread_log,
    number_findings,
    rank_zero,
    replay_config,
    window_text,
)
from ckptforensics.commands.diff import NOT_RANK_ZERO, pair_diff
from ckptforensics.core.errors import doing
from ckptforensics.core.options import ReplayOptions, replay_options
from ckptforensics.detectors import Finding, first_steps_from_state, replay_findings, trusted
from ckptforensics.detectors.replay.rows import confirmed
from ckptforensics.detectors.resume import detect_data_restart
from ckptforensics.engine.bisect import confirm_rows
from ckptforensics.engine.diff.pair import DiffResult
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.probes import BWD_STATS, FWD_STATS
from ckptforensics.engine.replay.run import replay as replay_window
from ckptforensics.report import (
    build_report,
)
from ckptforensics.verdict import decide, reattribute


def replay(
    before: str | int | Path,
    after: str | int | Path | None = None,
    *,
    batch: str | Path | None = None,
    step: int | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.replay",
    **option: Any,
) -> Report:
    """Replay the window (before, after] from *before* with probes on every module, merged
    with the pair's diff into one verdict (`after` None: the one step `step`, default
    before + 1). `batch`: a batch log (.h5), batch file or `module:function`, or None with
    the option `data` (the run's training data, its batches rebuilt). The options are an
    `options.ReplayOptions` or its fields by name (`model=`, `precision=`, `clip=`, ...)."""

    cfg = replay_config(before, after, batch, run_dir, replay_options(options, **option), step)
    return Report(*rank_zero(run_replay(cfg, command=command, progress=progress), "replay"))


def run_replay(
    cfg: Any, *, command: str, progress: Progress | None = None
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics replay`: replay (and diff, when *after* is given), merged into one verdict.

    Under torchrun (WORLD_SIZE > 1) the ranks replay the FSDP2-sharded model together
    (`replay.distributed`) and share the diff's tensors; rank 0 returns the report, the
    other ranks None.
    """

    with distributed.joined(cfg.device), doing(window_text("replaying", cfg)):
        rep = replay_window(cfg, progress=progress)
        note_unread_log(rep)  # a log that cannot be read: replayed without it, and said
        rfind = _rows_tested(rep, replay_findings(rep), progress) + _data_restart(cfg, rep)
        a, b, diff, dfind = pair_diff(cfg)
        try:
            return (
                None
                if diff is NOT_RANK_ZERO
                else replay_report(cfg, rep, rfind, a, b, diff, dfind, command)
            )
        finally:
            close_all(a, b)


_CORE = ("loss", "grad_norm", "lr", "loss_scale")


def _core(row: dict[str, float]) -> dict[str, float]:
    """The logged figures a report keeps (per-parameter columns stay in the log)."""
    return {k: row[k] for k in _CORE if k in row}


def replay_section(rep: Any, suspect: int | None) -> dict[str, Any]:
    """The report's `replay` block: configuration with sources, per-step records, evidence
    (the per-module table of the first bad step `suspect`)."""

    per_module = []
    if suspect in rep.passes:
        p = rep.passes[suspect]
        for i, name in enumerate(p.modules):
            row = {"module": name}
            row.update({k: float(v) for k, v in zip(FWD_STATS, p.fwd[i].tolist(), strict=True)})
            row.update({k: float(v) for k, v in zip(BWD_STATS, p.bwd[i].tolist(), strict=True)})
            per_module.append(row)
    mism = [asdict(m) for m in (rep.matches or []) if m.mismatched or m.impossible]
    modules = list(next(iter(rep.passes.values())).modules) if rep.passes else []
    per_step = {
        str(s): {
            "absmax": [float(x) for x in p.fwd[:, FWD_STATS.index("absmax")].tolist()],
            "rms": [float(x) for x in p.fwd[:, FWD_STATS.index("rms")].tolist()],
            "grad_norm": [float(x) for x in p.bwd[:, BWD_STATS.index("grad_norm")].tolist()],
        }
        for s, p in rep.passes.items()
    }
    # Per step, each attention layer's largest pre-softmax logit and its most collapsed head's
    # entropy (the attention-logits probe), and the head's mean logit.
    attention = {
        str(s): {
            "modules": list(p.attn_modules),
            "max_logit": [
                float(x) for x in p.attn[..., 0].nan_to_num(float("-inf")).amax(1).tolist()
            ],
            "entropy": [float(x) for x in p.attn[..., 1].nan_to_num(float("inf")).amin(1).tolist()],
            "head": p.head,
            "logit_mean": p.logit_mean,
        }
        for s, p in rep.passes.items()
        if p.attn is not None and p.attn_modules
    }
    return {
        "config": rep.config,
        "precision": rep.precision,
        "attention": attention,
        "check": rep.check.as_dict(),
        "variants": [v.as_dict() for v in rep.variants],
        "steps": [asdict(r) for r in rep.records],
        "logged": {str(k): _core(v) for k, v in rep.logged.items()},
        "history": {str(k): _core(v) for k, v in rep.baseline.items()},
        "suspect_step": suspect,
        "per_module": per_module,
        "modules": modules,
        "per_module_steps": per_step,
        "row_stats": {str(s): [asdict(x) for x in v] for s, v in rep.row_stats.items()},
        "reproduction": None
        if rep.matches is None
        else {
            "tensors": len(rep.matches),
            "elements": sum(m.numel for m in rep.matches),
            "mismatched": sum(m.mismatched for m in rep.matches),
            "impossible": sum(m.impossible for m in rep.matches),
            "mismatching_tensors": mism[:50],
            "tolerance": mp.tolerance(rep.precision),
            "worst": _worst(rep.matches),
        },
    }


def _rows_tested(rep: Any, rfind: list[Finding], progress: Progress | None) -> list[Finding]:
    """The rows a trusted replay flags in its spiking batch, tested by removing them
    (`engine.bisect.confirm_rows`, one process): culprits only where the spike needs them."""
    f = next((x for x in rfind if x.kind == "anomalous_samples"), None)
    withheld = any(x.kind in ("replay_withheld", "replay_unexplained") for x in rfind)
    if f is None or withheld or distributed.current() is not None:
        return rfind
    check = confirm_rows(rep, f.metrics["step"], list(f.metrics["rows"]), progress)
    return rfind if check is None else [confirmed(x, check) if x is f else x for x in rfind]


def _worst(matches: list[Any]) -> dict[str, Any] | None:
    """The element furthest from *after* relative to its tolerance (< 1: all within)."""
    m = max(matches, key=lambda m: m.worst, default=None)
    return (
        None
        if m is None
        else {"tensor": m.name, "where": m.where, "deviation_over_tolerance": m.worst}
    )


def _data_restart(cfg: Any, rep: Any) -> list[Finding]:
    """The batch log's sample ids against the window (detectors.resume): a data loader that
    restarted at a resume re-reads samples the run already consumed. Only where a batch log
    with `/sample_id` ran (the flight recorder, the zoo's fixtures)."""

    path = Path(cfg.batch) if cfg.batch else None
    if path is None or path.suffix not in (".h5", ".hdf5") or not path.is_file():
        return []

    with h5py.File(path, "r") as h:
        if "sample_id" not in h or "step" not in h:
            return []
        steps, ids = np.asarray(h["step"]), np.asarray(h["sample_id"])
    window = [r.step for r in rep.records]
    return detect_data_restart(
        {int(s): row.tolist() for s, row in zip(steps, ids, strict=False)}, window
    )


def withheld_section(rep: Any, why: Finding) -> dict[str, Any]:
    """The `replay` block of a replay that is not evidence: its configuration and its check
    against the log, nothing it measured."""
    return {
        "config": rep.config,
        "precision": rep.precision,
        "check": rep.check.as_dict(),
        "variants": [v.as_dict() for v in rep.variants],
        "withheld": why.message,
    }


def replay_report(
    cfg: Any,
    rep: Any,
    rfind: list[Finding],
    a: Any,
    b: Any,
    diff: DiffResult | None,
    dfind: list[Finding],
    command: str,
    more: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[Finding]]:
    before_ok = diff is None or not any(t.nonfinite_a for t in diff.tensors)
    after_label = (
        str(cfg.after) if cfg.after is not None else f"the replay of step {rep.records[0].step}"
    )
    why = trusted(cfg, rfind)
    if why is not None:
        findings = number_findings([*dfind, why])
        verdict = decide(
            findings,
            before=str(cfg.before),
            after=after_label,
            before_healthy=before_ok,
            replayed=False,
            extra={"replay_check": {"status": why.metrics["status"], "reason": why.message}},
        )
        doc = build_report(
            command=command,
            before=a,
            after=b,
            verdict=verdict,
            findings=findings,
            diff=diff,
            sections={"replay": withheld_section(rep, why), **(more or {})},
        )
        return doc, findings
    findings = number_findings(reattribute(dfind + rfind))
    verdict = decide(
        findings,
        before=str(cfg.before),
        after=after_label,
        before_healthy=before_ok,
        replayed=True,
        state_steps=first_steps_from_state(dfind, rep),
    )
    doc = build_report(
        command=command,
        before=a,
        after=b,
        verdict=verdict,
        findings=findings,
        diff=diff,
        sections={"replay": replay_section(rep, verdict.first_bad_step)},
    )
    return doc, findings
