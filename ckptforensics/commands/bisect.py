"""`bisect`: the first bad step of the window and the rows of its batch that make it so."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ckptforensics.commands.common import (
    Progress,
    Report,
    close_all,
    number_findings,
    rank_zero,
    replay_config,
    window_text,
)
from ckptforensics.commands.diff import NOT_RANK_ZERO, pair_diff
from ckptforensics.commands.replay import replay_report, replay_section
from ckptforensics.core.errors import doing
from ckptforensics.core.options import ReplayOptions, replay_options
from ckptforensics.detectors import Finding, first_steps_from_state, replay_findings, trusted
from ckptforensics.engine.bisect import bisect as bisect_window
from ckptforensics.engine.diff.pair import DiffResult
from ckptforensics.engine.replay import distributed
from ckptforensics.report import (
    build_report,
)
from ckptforensics.verdict import decide, reattribute


def bisect(
    before: str | int | Path,
    after: str | int | Path,
    *,
    batch: str | Path | None = None,
    tokenizer: str | Path | None = None,
    run_dir: str | Path | None = None,
    options: ReplayOptions | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.bisect",
    **option: Any,
) -> Report:
    """The first bad step of the window and the rows of its batch that cause it; the
    skip list for the trainer is `report.extra["skip"]`. Options as for `replay`."""

    cfg = replay_config(before, after, batch, run_dir, replay_options(options, **option))
    doc, findings, skip = rank_zero(
        run_bisect(
            cfg,
            command=command,
            progress=progress,
            tokenizer=Path(tokenizer) if tokenizer else None,
        ),
        "bisect",
    )
    return Report(doc, findings, {"skip": skip})


def run_bisect(
    cfg: Any, *, command: str, progress: Progress | None = None, tokenizer: Path | None = None
) -> tuple[dict[str, Any], list[Finding], dict[str, Any]] | None:
    """`ckptforensics bisect`: replay + step and sample bisection; returns (doc, findings,
    skip list); under torchrun, on ranks other than 0, None (see `run_replay`)."""

    with distributed.joined(cfg.device) as ranks, doing(window_text("bisecting", cfg)):
        # The pair's state evidence pins bad steps that do not spike (an LR already off
        # schedule in *before*, a collapsed second moment), as in `replay`.
        a, b, diff, dfind = pair_diff(cfg)
        if diff is NOT_RANK_ZERO:  # rank 0 holds the diff's findings: every rank needs them
            diff, dfind = None, []
        if ranks is not None:
            dfind = ranks.objects(dfind)[0]
        try:
            got = _bisect_report(cfg, a, b, diff, dfind, command, progress, tokenizer)
            return got if ranks is None or ranks.rank == 0 else None
        finally:
            close_all(a, b)


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

    res, rep = bisect_window(cfg, progress, tokenizer=tokenizer, state_findings=dfind)
    rfind = replay_findings(rep)
    why = trusted(cfg, rfind)
    if why is not None:  # withheld (allowed): the diff's verdict, the bisection's note
        doc, findings = replay_report(
            cfg, rep, rfind, a, b, diff, dfind, command, {"bisect": asdict(res)}
        )
        return doc, findings, {"steps": [], "sample_ids": [], "rows": {}}
    findings = number_findings(reattribute(dfind + rfind))
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
        extra["unusual_samples"] = [
            {
                "index": i,
                "sample_id": (res.unusual_ids[k] if res.unusual_ids else None),
                "score": 0.0,
                "why": res.evidence.get(i, "flagged") + "; the spike does not need it",
            }
            for k, i in enumerate(res.unusual)
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
