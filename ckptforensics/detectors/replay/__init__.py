"""Detectors over a replay of the window (replay.ReplayResult): the spiking step, the module
that leaves its range first, overflow, the rows that carry the spike, reproduction.

Three stages, each a tuple of detectors behind one protocol (`evidence.ReplayDetector`), one
module per stage: `onset` finds the step that went bad, `examine` and `rows` read that step,
`state` reads the whole window. The tuples' order is the order findings come in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptforensics.detectors.base import Finding, Thresholds
from ckptforensics.detectors.replay.agreement import WITHHELD, log_agreement, replay_variant
from ckptforensics.detectors.replay.evidence import ReplayDetector, ReplayEvidence, step_z
from ckptforensics.detectors.replay.examine import attention, localise, overflow
from ckptforensics.detectors.replay.onset import first_steps_from_state, log_onset, lr_steps, spike
from ckptforensics.detectors.replay.routing import routing
from ckptforensics.detectors.replay.rows import samples
from ckptforensics.detectors.replay.state import output_logits, reproduction, rms_t
from ckptforensics.detectors.replay.trust import trusted

__all__ = [
    "trusted",
    "ReplayEvidence",
    "ReplayDetector",
    "ONSET_DETECTORS",
    "EXAMINE_DETECTORS",
    "STATE_DETECTORS",
    "ONSET_KINDS",
    "WITHHELD",
    "replay_findings",
    "first_steps_from_state",
    "step_z",
    "log_onset",
]


def replay_findings(rep: Any, th: Thresholds | None = None) -> list[Finding]:
    """Findings from a replay (replay.ReplayResult), without ids.

    Three stages, each a list of pure detectors behind one protocol: the onset detectors
    find the step that went bad; the examination detectors read that step; the state
    detectors read the whole window. `verdict.replay_fields` reads the verdict's fields
    (first bad step, first module, rows, reproduction) off the findings.
    """
    th = th or Thresholds()
    ev = ReplayEvidence(rep)
    out = [f for d in ONSET_DETECTORS for f in d(ev, th)]
    ev = _examined(rep, out)
    out += [f for d in EXAMINE_DETECTORS for f in d(ev, th)]
    out += [f for d in STATE_DETECTORS for f in d(ev, th)]
    return out


def _examined(rep: Any, onset: list[Finding]) -> ReplayEvidence:
    """The step the examination detectors read: the earliest onset, else the largest grad norm."""
    steps = [f.metrics["step"] for f in onset if f.kind in ONSET_KINDS]
    if steps:
        return ReplayEvidence(rep, min(steps), True)
    if not rep.records:
        return ReplayEvidence(rep)
    zg = _grad_z(rep)
    return ReplayEvidence(
        rep, rep.records[int(np.argmax(np.where(np.isfinite(zg), zg, 1e9)))].step, False
    )


def _grad_z(rep: Any) -> np.ndarray:
    return step_z(
        [r.grad_norm for r in rep.records],
        [b["grad_norm"] for b in rep.baseline.values() if "grad_norm" in b],
    )


# The onset detectors' findings whose step is the first bad step.
ONSET_KINDS = ("lr_step_jump", "replay_spike")
ONSET_DETECTORS: tuple[ReplayDetector, ...] = (lr_steps, spike)
EXAMINE_DETECTORS: tuple[ReplayDetector, ...] = (localise, overflow, samples, attention)
STATE_DETECTORS: tuple[ReplayDetector, ...] = (
    output_logits,
    routing,
    rms_t,
    reproduction,
    replay_variant,
    log_agreement,
)
