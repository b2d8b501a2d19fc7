"""History's detectors: pure functions from a run's trajectories over its checkpoints
(`HistoryEvidence`) to Findings, each dated at the checkpoint where its module left its own
trend (`trend.departure`, docs/signatures.md#history-departure) or, for Adam's steps and a
log Z that grew from the run's first checkpoints, began their climb (`adam`,
`logits.early_growth`); where several causes are named, the one that went wrong first is the
root (`history_findings`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ckptforensics.detectors.base import Finding, Thresholds
from ckptforensics.detectors.history.adam import adam_step_growth
from ckptforensics.detectors.history.evidence import METRICS, HistoryEvidence, Trajectory
from ckptforensics.detectors.history.logits import attention_growth, onset_of, output_drift
from ckptforensics.detectors.history.trend import TREND_WINDOW, Departure, departure

__all__ = [
    "METRICS",
    "TREND_WINDOW",
    "HISTORY_DETECTORS",
    "Departure",
    "HistoryEvidence",
    "Trajectory",
    "departure",
    "departures",
    "history_findings",
    "onset_of",
]

HISTORY_DETECTORS: tuple[Callable[[HistoryEvidence, Thresholds], list[Finding]], ...] = (
    attention_growth,
    output_drift,
    adam_step_growth,
)


def history_findings(ev: HistoryEvidence, th: Thresholds | None = None) -> list[Finding]:
    """Every history detector's findings; within one, the earliest onset first.

    The root of several causes is the one whose earliest onset comes first: what went wrong
    first is what to fix (an Adam instability's growing steps grow the weights, and the
    logits they feed; a layer's grown logits are not undone by a later optimizer fix). A
    finding of another cause whose onset is strictly later is its effect: it stays in the
    report, as context (severity info, not primary), and the verdict ranks the root alone.
    Equal onsets keep both, ranked by their evidence.
    """
    t = th or Thresholds()
    found = [f for det in HISTORY_DETECTORS for f in det(ev, t)]
    first: dict[str, int] = {}
    for f in found:
        on = f.metrics.get("onset_step")
        if on is not None and f.supports:
            first[f.supports[0]] = min(on, first.get(f.supports[0], on))
    if len(first) < 2:
        return found
    root_step = min(first.values())
    roots = sorted(c for c, s in first.items() if s == root_step)
    return [
        f
        if not f.supports or first.get(f.supports[0], root_step) == root_step
        else dataclasses.replace(
            f,
            severity="info",
            primary=False,
            message=f"{f.message} (after {', '.join(roots)} from step {root_step}: its effect, context)",
        )
        for f in found
    ]


def departures(ev: HistoryEvidence, th: Thresholds | None = None) -> list[Departure]:
    """Every trajectory's departure from its own trend, earliest first (the report's table)."""
    t = th or Thresholds()
    found = [d for tr in ev.trajectories if (d := departure(tr, t.attn_growth)) is not None]
    return sorted(found, key=lambda d: (d.step, d.metric, d.module))
