"""Replay: rebuild model and optimizer from *before*, re-run the window's steps with probes."""

from .engine import Plan, ReplayConfig, ReplayResult, Session, StepRecord, TensorMatch, plan, replay

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
