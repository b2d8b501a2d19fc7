"""Audit a run for known instability risks before the next spike (`ckptforensics audit`)."""

from .trace import Architecture, AttentionLayer, trace_architecture

__all__ = ["Architecture", "AttentionLayer", "trace_architecture"]
