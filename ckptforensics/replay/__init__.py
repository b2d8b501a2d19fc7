"""Replay: rebuild model and optimizer from *before*, re-run the window's steps with probes."""

from .engine import ReplayConfig, ReplayResult, StepRecord, TensorMatch, replay

__all__ = ["ReplayConfig", "ReplayResult", "StepRecord", "TensorMatch", "replay"]
