"""Follow every checkpoint of a run (`ckptforensics history`): since when has it been going wrong?

`engine.history.walk` measures each checkpoint on one fixed batch of the run and diffs each
consecutive pair with the diff's kernel, `detectors.history` dates every module's departure
from its own trend and names the logit causes and Adam's instability, `verdict.decide` ranks
them, and the report carries the trajectories (`history`), the verdict's
`first_anomalous_module` and `history.onset_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.commands.common import Progress, Report, number_findings
from ckptforensics.detectors import Finding, Thresholds
from ckptforensics.detectors.history import TREND_WINDOW, departures, history_findings
from ckptforensics.engine.diff.shard import compute_device
from ckptforensics.engine.history import HistoryConfig, HistoryResult, walk
from ckptforensics.report import build_report
from ckptforensics.verdict import decide, rank_causes

__all__ = ["HistoryConfig", "run_history", "history"]

RULE = (
    f"a checkpoint departs when it stands past the Theil-Sen line through its module's own previous {TREND_WINDOW} "
    "checkpoints (log10) by more than x{factor:g} in the metric's bad direction, and stays past that line's level at "
    "every later checkpoint (docs/signatures.md#history-departure)"
)


def run_history(
    cfg: HistoryConfig, *, command: str, progress: Callable[[str], None] | None = None
) -> tuple[dict[str, Any], list[Finding]]:
    """`ckptforensics history`: the report document (schema `ckptforensics.report/1`, with
    its `history` section) and the findings.

    Raises:
        ForensicsError: no checkpoints in the range, no batch, a model that cannot be built.
    """
    th = Thresholds()
    res = walk(cfg, progress)
    findings = number_findings(history_findings(res.evidence, th))
    lead = _lead(findings)
    onset = lead.metrics.get("onset_step") if lead is not None else None
    steps = [s for s, _ in res.checkpoints]
    # The rollback: the last checkpoint before the first onset (still on its trend).
    before_i = max(0, steps.index(onset) - 1) if onset in steps else 0
    before, after = res.checkpoints[before_i][1], res.checkpoints[-1][1]
    verdict = decide(findings, before=str(before), after=str(after))
    if lead is None:  # nothing left its trend: say what was followed, not a pair's diff
        verdict.summary = (
            f"Over {len(steps)} checkpoints (steps {steps[0]}-{steps[-1]}), no module left its own trend: "
            "attention logits, log Z, activations and updates followed their trajectories "
            "(docs/signatures.md#history-departure)."
        )
    section = _section(cfg, res, lead, onset, th)
    with open_checkpoint(before) as b, open_checkpoint(after) as a:
        doc = build_report(
            command=command,
            before=b,
            after=a,
            verdict=verdict,
            findings=findings,
            sections={"history": section},
        )
    return doc, findings


def _lead(findings: list[Finding]) -> Finding | None:
    """The finding that names the verdict's first anomalous module: the first one of the top
    cause, as `decide` takes it (the detectors order theirs earliest onset first)."""
    top = rank_causes(findings)[0]["cause"]
    return next((f for f in findings if top in f.supports), None)


def _section(
    cfg: HistoryConfig,
    res: HistoryResult,
    lead: Finding | None,
    onset: int | None,
    th: Thresholds,
) -> dict[str, Any]:
    ev = res.evidence
    trajectories: dict[str, dict[str, list[float]]] = {}
    for t in ev.trajectories:
        trajectories.setdefault(t.metric, {})[t.module] = list(t.values)
    n = len(res.checkpoints)
    return {
        "run_dir": str(cfg.run_dir),
        "range": {"from": cfg.start, "to": cfg.stop},
        "checkpoints": [{"step": s, "path": str(p)} for s, p in res.checkpoints],
        "steps": list(ev.steps),
        "batch": res.batch_source,
        "onset_step": onset,
        "onset_module": lead.subject if lead is not None else None,
        "rule": RULE.format(factor=th.attn_growth),
        "attn_modules": list(ev.attn_modules),
        "head": ev.head,
        "departures": [dataclasses.asdict(d) for d in departures(ev, th)],
        "trajectories": trajectories,
        "log": {str(s): r for s, r in res.log.items()},
        "cost": {
            "checkpoints": n,
            "pairs": n - 1,
            **{f"seconds_{k}": round(v, 4) for k, v in res.seconds.items()},
        },
    }


def history(
    *,
    run_dir: str | Path = ".",
    start: int | None = None,
    stop: int | None = None,
    batch: str | Path | None = None,
    data: str | Path | None = None,
    model: str | None = None,
    device: str = "cpu",
    progress: Progress | None = None,
    command: str = "ckptforensics.history",
) -> Report:
    """Follow every checkpoint of a run (or of steps `start`..`stop`): per-module trajectories
    on one fixed batch of the run and across consecutive diffs, each module's departure from
    its own trend, and a verdict naming what grew first, where, since when.

        rep = cf.history(run_dir="runs/x", model="fixtures/tinygpt.py:factory")
        rep.doc["verdict"]["first_anomalous_module"], rep.doc["history"]["onset_step"]
    """
    compute_device(device)  # a GPU torch cannot see: bad input, before any reading
    cfg = HistoryConfig(
        run_dir=Path(run_dir),
        start=start,
        stop=stop,
        batch=str(batch) if batch is not None else None,
        data=str(data) if data is not None else None,
        model=model,
        device=device,
    )
    return Report(*run_history(cfg, command=command, progress=progress))
