"""Detectors: pure functions from evidence to records, each citing its row of
docs/signatures.md. `diff` reads a checkpoint pair's diff (-> Findings), `replay` a replay
of the window (-> Findings, in three stages), `log` a training log's rows (-> Onsets).
`causes` is the vocabulary their findings support: one `Cause` record per cause."""

from ckptforensics.detectors.base import SEVERITIES, Finding, Thresholds, module_of
from ckptforensics.detectors.causes import CAUSES, RESUME_CAUSES, Cause
from ckptforensics.detectors.diff import DIFF_DETECTORS, diff_findings
from ckptforensics.detectors.log import Onset, TriageConfig, log_onsets
from ckptforensics.detectors.replay import first_steps_from_state, replay_findings, step_z, trusted

__all__ = [
    "trusted",
    "Finding", "Thresholds", "SEVERITIES", "module_of", "DIFF_DETECTORS", "diff_findings", "replay_findings",
    "first_steps_from_state", "step_z", "Onset", "TriageConfig", "log_onsets",
    "Cause", "CAUSES", "RESUME_CAUSES",
]  # fmt: skip
