"""ckptforensics: post-mortem forensics for loss spikes in large-model pre-training."""

__version__ = "0.1.0"

__all__ = ["__version__"]
