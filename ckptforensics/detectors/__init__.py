"""Detectors: pure functions from statistics to Findings, each citing its row of
docs/signatures.md. `diff` reads a checkpoint pair's diff, `replay` a replay of the
window; the training log's rules live in `triage` (they read rows, not statistics)."""

from .base import SEVERITIES, Finding, Thresholds, module_of
from .diff import DIFF_DETECTORS, diff_findings
from .replay import first_steps_from_state, replay_findings, step_z

__all__ = ["Finding", "Thresholds", "SEVERITIES", "module_of", "DIFF_DETECTORS", "diff_findings", "replay_findings", "first_steps_from_state", "step_z"]
