"""Detectors over a training log (step -> metrics rows, `logs.read_metrics`): where an
incident starts (docs/signatures.md#log-onset).

Each detector is a pure function `(LogEvidence, TriageConfig) -> list[Onset]`. The seed
detectors (grad-norm spikes, loss-scale backoffs) raise candidates that count only where
the loss follows (`log_onsets` settles that); the onset detectors (loss spikes, LR jumps,
a gradient's return) are onsets as they stand; then the log's own tail of recovering blips
filters what a noisy log does routinely, and `log_noise` says how noisy it is.

One module per seam: `evidence` (the settings, the onset record, the curves judged once),
`signals` (the rules over a full log, one signal each), `short` (an excerpt's first lines),
`blips` (the log's own tail of recovering blips), `held` and `shift` (a held rise, a held
shift), `creep` (the loss leaving its trend for good), `settled` (a settled level shift: a
departure that is the first step of the level the run then keeps), `onsets` (`log_onsets`,
whose order of signals and filters is the contract) and `noise` (how noisy the log is; the
last line an excerpt cannot decide).
"""

from __future__ import annotations

from ckptforensics.detectors.log.evidence import (
    Curve,
    LogDetector,
    LogEvidence,
    Onset,
    TriageConfig,
    log_evidence,
)
from ckptforensics.detectors.log.noise import undecidable_last_line
from ckptforensics.detectors.log.onsets import ONSET_DETECTORS, SEED_DETECTORS, log_onsets

__all__ = [
    "undecidable_last_line",
    "TriageConfig",
    "Onset",
    "Curve",
    "LogEvidence",
    "LogDetector",
    "SEED_DETECTORS",
    "ONSET_DETECTORS",
    "log_evidence",
    "log_onsets",
]
