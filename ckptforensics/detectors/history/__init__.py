"""History's detectors: pure functions from a run's trajectories over its checkpoints
(`HistoryEvidence`) to Findings, each dated at the checkpoint where its module left its own
trend (`trend.departure`, docs/signatures.md#history-departure)."""

from __future__ import annotations

from collections.abc import Callable

from ckptforensics.detectors.base import Finding, Thresholds
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
)


def history_findings(ev: HistoryEvidence, th: Thresholds | None = None) -> list[Finding]:
    """Every history detector's findings; within one, the earliest onset first."""
    t = th or Thresholds()
    return [f for det in HISTORY_DETECTORS for f in det(ev, t)]


def departures(ev: HistoryEvidence, th: Thresholds | None = None) -> list[Departure]:
    """Every trajectory's departure from its own trend, earliest first (the report's table)."""
    t = th or Thresholds()
    found = [d for tr in ev.trajectories if (d := departure(tr, t.attn_growth)) is not None]
    return sorted(found, key=lambda d: (d.step, d.metric, d.module))
