"""The commands' library side: run the parts, merge findings, decide, assemble the report.

Over 400 lines: the library side of every command (run, merge, decide, assemble) over shared
assembly helpers, already split off `api`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import ForensicsError, ReplayMismatch, doing
from ckptforensics.detectors import Finding, diff_findings, first_steps_from_state, replay_findings
from ckptforensics.engine.diff.pair import DiffConfig, DiffResult, diff_checkpoints
from ckptforensics.formats import open_checkpoint, open_pair
from ckptforensics.report import build_report
from ckptforensics.verdict import decide, decide_whatif, reattribute

__all__ = [
    "run_diff",
    "run_replay",
    "run_bisect",
    "run_whatif",
    "replay_section",
    "withheld_section",
    "trusted",
    "ReplayMismatch",
]

Progress = Callable[[str], None]


def _number(findings: list[Finding]) -> list[Finding]:
    return [
        Finding(f"F{i}", *[getattr(f, k) for k in Finding.__slots__[1:]])
        for i, f in enumerate(findings, 1)
    ]  # type: ignore[attr-defined]


def _diff(
    a_path: Path,
    b_path: Path,
    fmt: str | None,
    chunk: int,
    progress: Progress | None,
    workers: int = 1,
    device: str = "cpu",
) -> tuple[Any, Any, DiffResult, list[Finding]]:
    a, b = open_pair(a_path, b_path, fmt)
    result = diff_checkpoints(
        a, b, DiffConfig(chunk_elems=chunk, device=device), progress=progress, workers=workers
    )
    assert result is not None
    return a, b, result, diff_findings(result)


def run_diff(
    a_path: Path,
    b_path: Path,
    *,
    command: str,
    fmt: str | None = None,
    chunk: int = 1 << 19,
    progress: Progress | None = None,
    workers: int = 1,
    device: str = "cpu",
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics diff`: the report document and its findings (`device`: where the
    statistics are computed, `shard.compute_device`'s; a GPU is fed by one process).

    Under torchrun (WORLD_SIZE > 1) every rank streams its share of the tensors and
    rank 0 gathers the statistics and returns the report; the other ranks return None.
    """
    from ckptforensics.engine.diff.shard import (
        destroy_process_group,
        dist_world,
        init_process_group,
    )

    rank, world = dist_world()
    if world == 1:
        a, b, result, findings = _diff(a_path, b_path, fmt, chunk, progress, workers, device)
    else:
        import torch.distributed as dist

        own = not dist.is_initialized()
        if own:
            init_process_group("gloo")
        settled = False
        try:
            a, b = open_pair(a_path, b_path, fmt)
            got = diff_checkpoints(
                a,
                b,
                DiffConfig(chunk_elems=chunk, device=device),
                progress=progress,
                workers=workers,
                distributed=True,
            )
            settled = True
        finally:
            if own:
                destroy_process_group(settled=settled)
        if got is None:
            a.close()
            b.close()
            return None
        result, findings = got, diff_findings(got)
    try:
        before_ok = not any(t.nonfinite_a for t in result.tensors)
        verdict = decide(
            findings,
            before=str(a_path),
            after=str(b_path),
            before_healthy=before_ok,
            weights_only=result.pair.weights_only,
        )
        doc = build_report(
            command=command, before=a, after=b, verdict=verdict, findings=findings, diff=result
        )
    finally:
        a.close()
        b.close()
    return doc, findings


_CORE = ("loss", "grad_norm", "lr", "loss_scale")


def _core(row: dict[str, float]) -> dict[str, float]:
    """The logged figures a report keeps (per-parameter columns stay in the log)."""
    return {k: row[k] for k in _CORE if k in row}


def replay_section(rep: Any, suspect: int | None) -> dict[str, Any]:
    """The report's `replay` block: configuration with sources, per-step records, evidence
    (the per-module table of the first bad step `suspect`)."""
    from ckptforensics.engine.replay import precision as mp
    from ckptforensics.engine.replay.probes import BWD_STATS, FWD_STATS

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


def _worst(matches: list[Any]) -> dict[str, Any] | None:
    """The element furthest from *after* relative to its tolerance (< 1: all within)."""
    m = max(matches, key=lambda m: m.worst, default=None)
    return (
        None
        if m is None
        else {"tensor": m.name, "where": m.where, "deviation_over_tolerance": m.worst}
    )


def _window(what: str, cfg: Any) -> str:
    """'replaying ckpt-45 to ckpt-50' (what a fault's one line says was being done)."""
    return f"{what} {cfg.before}" + (f" to {cfg.after}" if cfg.after is not None else "")


def run_replay(
    cfg: Any, *, command: str, progress: Progress | None = None
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics replay`: replay (and diff, when *after* is given), merged into one verdict.

    Under torchrun (WORLD_SIZE > 1) the ranks replay the FSDP2-sharded model together
    (`replay.distributed`) and share the diff's tensors; rank 0 returns the report, the
    other ranks None.
    """
    from ckptforensics.engine.replay import distributed, replay

    with distributed.joined(cfg.device), doing(_window("replaying", cfg)):
        rep = replay(cfg, progress=progress)
        rfind = replay_findings(rep) + _data_restart(cfg, rep)
        a, b, diff, dfind = _pair_diff(cfg)
        try:
            return (
                None
                if diff is _NOT_RANK_ZERO
                else _replay_report(cfg, rep, rfind, a, b, diff, dfind, command)
            )
        finally:
            _close(a, b)


def _data_restart(cfg: Any, rep: Any) -> list[Finding]:
    """The batch log's sample ids against the window (detectors.resume): a data loader that
    restarted at a resume re-reads samples the run already consumed. Only where a batch log
    with `/sample_id` ran (the flight recorder, the zoo's fixtures)."""
    from ckptforensics.detectors.resume import detect_data_restart

    path = Path(cfg.batch) if cfg.batch else None
    if path is None or path.suffix not in (".h5", ".hdf5") or not path.is_file():
        return []
    import h5py
    import numpy as np

    with h5py.File(path, "r") as h:
        if "sample_id" not in h or "step" not in h:
            return []
        steps, ids = np.asarray(h["step"]), np.asarray(h["sample_id"])
    window = [r.step for r in rep.records]
    return detect_data_restart(
        {int(s): row.tolist() for s, row in zip(steps, ids, strict=False)}, window
    )


# The pair's diff under torchrun on ranks other than 0, which gather nothing.
_NOT_RANK_ZERO: Any = object()


def _pair_diff(cfg: Any) -> tuple[Any, Any, Any, list[Finding]]:
    """The window's checkpoints, open, and their diff (None without *after*; under
    torchrun the ranks share its tensors and the others than rank 0 get `_NOT_RANK_ZERO`)."""
    from ckptforensics.engine.replay import distributed

    if cfg.after is None:
        a = open_checkpoint(cfg.before)
        return a, a, None, []
    if distributed.current() is None:
        return _diff(cfg.before, cfg.after, None, 1 << 19, None)
    a, b = open_pair(cfg.before, cfg.after)
    got = diff_checkpoints(a, b, DiffConfig(chunk_elems=1 << 19), distributed=True)
    return (a, b, _NOT_RANK_ZERO, []) if got is None else (a, b, got, diff_findings(got))


def _close(*cks: Any) -> None:
    for i, c in enumerate(cks):
        if all(c is not d for d in cks[:i]):  # a and b are one object without *after*
            c.close()


def trusted(cfg: Any, rfind: list[Finding]) -> Finding | None:
    """None when the replay is evidence; else the finding that withholds it (its evidence is
    dropped and the report says why). A replay that misses the log on its first checked step
    is refused outright unless `cfg.allow_mismatch`.

    Raises:
        ReplayMismatch: the first checked step misses and the mismatch is not allowed.
    """
    bad = next((f for f in rfind if f.kind == "replay_withheld"), None)
    if bad is None:
        return None
    if bad.metrics["status"] == "missed_first" and not cfg.allow_mismatch:
        raise ReplayMismatch(
            f"{bad.message}; pass --allow-mismatch to write the report from the checkpoint diff alone"
        )
    return bad


def withheld_section(rep: Any, why: Finding) -> dict[str, Any]:
    """The `replay` block of a replay that is not evidence: its configuration and its check
    against the log, nothing it measured."""
    return {
        "config": rep.config,
        "precision": rep.precision,
        "check": rep.check.as_dict(),
        "withheld": why.message,
    }


def _replay_report(
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
        findings = _number([*dfind, why])
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
    findings = _number(reattribute(dfind + rfind))
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


def run_bisect(
    cfg: Any, *, command: str, progress: Progress | None = None, tokenizer: Path | None = None
) -> tuple[dict[str, Any], list[Finding], dict[str, Any]] | None:
    """`ckptforensics bisect`: replay + step and sample bisection; returns (doc, findings,
    skip list); under torchrun, on ranks other than 0, None (see `run_replay`)."""
    from ckptforensics.engine.replay import distributed

    with distributed.joined(cfg.device) as ranks, doing(_window("bisecting", cfg)):
        # The pair's state evidence pins bad steps that do not spike (an LR already off
        # schedule in *before*, a collapsed second moment), as in `replay`.
        a, b, diff, dfind = _pair_diff(cfg)
        if diff is _NOT_RANK_ZERO:  # rank 0 holds the diff's findings: every rank needs them
            diff, dfind = None, []
        if ranks is not None:
            dfind = ranks.objects(dfind)[0]
        try:
            got = _bisect_report(cfg, a, b, diff, dfind, command, progress, tokenizer)
            return got if ranks is None or ranks.rank == 0 else None
        finally:
            _close(a, b)


def _bisect_report(
    cfg: Any,
    a: Any,
    b: Any,
    diff: DiffResult | None,
    dfind: list[Finding],
    command: str,
    progress: Progress | None,
    tokenizer: Path | None,
) -> tuple[dict[str, Any], list[Finding], dict[str, Any]]:
    from ckptforensics.engine.bisect import bisect

    res, rep = bisect(cfg, progress, tokenizer=tokenizer, state_findings=dfind)
    rfind = replay_findings(rep)
    why = trusted(cfg, rfind)
    if why is not None:  # withheld (allowed): the diff's verdict, the bisection's note
        doc, findings = _replay_report(
            cfg, rep, rfind, a, b, diff, dfind, command, {"bisect": asdict(res)}
        )
        return doc, findings, {"steps": [], "sample_ids": [], "rows": {}}
    findings = _number(reattribute(dfind + rfind))
    # The bisection's step and rows are what it proved by replaying; they override the
    # replay's single-pass reading.
    extra: dict[str, Any] = {}
    if res.first_bad_step is not None:
        extra["first_bad_step"] = res.first_bad_step
    if res.rows:
        extra["anomalous_samples"] = [
            {
                "index": i,
                "sample_id": (res.sample_ids[k] if res.sample_ids else None),
                "score": 1.0,
                "why": res.evidence.get(i, "needed to reproduce the spike"),
            }
            for k, i in enumerate(res.rows)
        ]
    before_ok = diff is None or not any(t.nonfinite_a for t in diff.tensors)
    verdict = decide(
        findings,
        before=str(cfg.before),
        after=str(cfg.after or cfg.before),
        before_healthy=before_ok,
        extra=extra,
        replayed=True,
        state_steps=first_steps_from_state(dfind, rep),
    )
    skip = {
        "steps": [res.first_bad_step] if res.first_bad_step is not None and res.rows else [],
        "sample_ids": res.sample_ids,
        "rows": {str(res.first_bad_step): res.rows} if res.rows else {},
    }
    section = asdict(res)
    section["skip"] = skip
    doc = build_report(
        command=command,
        before=a,
        after=b,
        verdict=verdict,
        findings=findings,
        diff=diff,
        sections={"replay": replay_section(rep, verdict.first_bad_step), "bisect": section},
    )
    return doc, findings, skip


def run_whatif(
    cfg: Any,
    n_steps: int,
    tries: list[str],
    skip_rows: dict[int, list[int]] | None,
    *,
    command: str,
    progress: Progress | None = None,
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics whatif`: the baseline and each mitigation replayed from *before*
    (under torchrun: by every rank together; ranks other than 0 return None)."""
    from ckptforensics.engine.replay import distributed

    with (
        distributed.joined(cfg.device) as ranks,
        doing(f"replaying {n_steps} steps from {cfg.before} under each mitigation"),
    ):
        got = _whatif(cfg, n_steps, tries, skip_rows, command, progress)
        return got if ranks is None or ranks.rank == 0 else None


def _whatif(
    cfg: Any,
    n_steps: int,
    tries: list[str],
    skip_rows: dict[int, list[int]] | None,
    command: str,
    progress: Progress | None,
) -> tuple[dict[str, Any], list[Finding]]:
    from ckptforensics.engine.whatif import parse_mitigation, whatif

    mitigations = [parse_mitigation(t) for t in tries]
    auto = skip_rows
    auto_ids: dict[int, list[int]] = {}
    if (
        any(k == "skip_samples" and v == "auto" for m in mitigations for k, v in m.knobs)
        and not auto
    ):
        from ckptforensics.engine.bisect import bisect

        first = _step_of(cfg.before) + 1
        res, _ = bisect(cfg, progress, steps=list(range(first, first + n_steps)))
        auto = {res.first_bad_step: res.rows} if res.rows else {}
        auto_ids = {res.first_bad_step: res.sample_ids} if res.rows and res.sample_ids else {}
    outcomes, best, info = whatif(cfg, n_steps, mitigations, auto, progress)
    msg = (
        f"{best} keeps the run on track over {n_steps} steps (least invasive that does)"
        if best
        else (
            "the baseline stays on track: no mitigation needed"
            if info["baseline_on_track"]
            else "no mitigation tried keeps the run on track"
        )
    )
    finding = Finding(
        "F1",
        "whatif",
        best or "run",
        1.0,
        "info",
        {"recommended": best, **info},
        msg,
        "docs/signatures.md#what-if",
        (),
    )
    verdict = decide_whatif(
        before=str(cfg.before),
        n_steps=n_steps,
        outcome=msg,
        recommended=best,
        baseline_on_track=bool(info["baseline_on_track"]),
    )
    section = {
        "outcomes": [asdict(o) for o in outcomes],
        "recommended": best,
        **info,
        "auto_rows": {str(k): v for k, v in (auto or {}).items()},
        "auto_sample_ids": {str(k): v for k, v in auto_ids.items()},
    }
    with open_checkpoint(cfg.before) as a:
        doc = build_report(
            command=command,
            before=a,
            after=a,
            verdict=verdict,
            findings=[finding],
            sections={"whatif": section},
        )
    return doc, [finding]


def _step_of(path: Path) -> int:
    with open_checkpoint(path) as c:
        if c.step is None:
            raise ForensicsError(f"{path}: the checkpoint does not record its step")
        return c.step
