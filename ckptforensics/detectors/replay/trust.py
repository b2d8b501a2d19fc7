"""Whether a replay is evidence: it is where it lands on the run's own log; a replay that
misses the log is withheld (and refused outright on its first checked step)."""

from __future__ import annotations

from typing import Any

from ckptforensics.core.errors import ReplayMismatch
from ckptforensics.detectors.base import Finding


def trusted(cfg: Any, rfind: list[Finding]) -> Finding | None:
    """None when the replay is evidence; else the finding that withholds it (its evidence is
    dropped and the report says why). A replay that misses the log on its first checked step
    is refused outright unless `cfg.allow_mismatch`.

    Raises:
        ReplayMismatch: the first checked step misses and the mismatch is not allowed.
    """
    # withheld: a replay that misses the log, or misses its spike with explanations open
    bad = next((f for f in rfind if f.kind in ("replay_withheld", "replay_unexplained")), None)
    if bad is None:
        return None
    if bad.metrics["status"] == "missed_first" and not cfg.allow_mismatch:
        raise ReplayMismatch(
            f"{bad.message}; pass --allow-mismatch to write the report from the checkpoint diff alone"
        )
    return bad
