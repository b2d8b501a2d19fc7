"""Replay: rebuild model and optimizer from *before*, re-run the window's steps with probes."""

from ckptforensics.engine.replay.run import (
    Plan,
    ReplayConfig,
    ReplayResult,
    Session,
    StepRecord,
    TensorMatch,
    plan,
    replay,
)

__all__ = [
    "Plan",
    "ReplayConfig",
    "ReplayResult",
    "Session",
    "StepRecord",
    "TensorMatch",
    "plan",
    "replay",
]
