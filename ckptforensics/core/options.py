"""How a window is replayed: the options every replay-based command shares.

`replay`, `bisect`, `whatif` and `plan` take the same options; they live here once, as one
record, so that the CLI, the library functions and `replay.ReplayConfig` (which extends it
with the window) state them once. Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

__all__ = ["ReplayOptions", "replay_options"]


@dataclass(kw_only=True, slots=True)
class ReplayOptions:
    """How to replay a window (the CLI's shared options, one field each).

    Attributes:
        model: `module:factory`, `path/file.py:factory`, an HF config dir, or None (built
            from what the run recorded: config.json, nanoGPT's model_args, Megatron's args).
        data: the run's training data, its batches rebuilt as the run drew them (an HF
            `save_to_disk` dir or `module:function`; Megatron's indexed dataset dir; the dir
            OLMo-core's dataset paths are relative to); instead of a batch log.
        collator: with `data` on an HF Trainer run, the collator it used (`module:obj`); None:
            the standard ones are tried and the one whose first step lands on the log kept.
        precision: 'auto' (what the run used, read from the run), 'fp32', 'bf16', 'fp16'
            or 'bf16-params' (bf16 weights on fp32 masters).
        device: 'cpu' or 'cuda'.
        clip: gradient clipping norm; None: what the checkpoint or batch log states, else
            calibrated against the log.
        loss: `module:function(logits, batch) -> per-token loss`; None: causal-LM cross-entropy.
        metrics: the training log; None: discovered beside the checkpoints.
        checkpoint_activations: recompute each block's activations in the backward pass.
        labels: 'shifted' or 'unshifted' where the batches' labels cannot tell; None: measured.
        allow_mismatch: write the report even when the replay misses the run's own log on its
            first checked step (every replay-derived field withheld).
    """

    model: str | None = None
    data: str | None = None
    collator: str | None = None
    precision: str = "auto"
    device: str = "cpu"
    clip: float | None = None
    loss: str | None = None
    metrics: Path | None = None
    checkpoint_activations: bool = False
    labels: str | None = None
    allow_mismatch: bool = False

    def __post_init__(self) -> None:
        # Paths given as str (a notebook's habit) are normalised once, here.
        if self.data is not None:
            self.data = str(self.data)
        if self.metrics is not None:
            self.metrics = Path(self.metrics)

    def as_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(ReplayOptions)}


def replay_options(options: ReplayOptions | None = None, **overrides: Any) -> ReplayOptions:
    """`options` (default: all defaults) with `overrides` applied: a library call may pass
    either the record or its fields by name. An unknown name is a TypeError naming it."""
    known = {f.name for f in fields(ReplayOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(
            f"unknown replay option(s) {', '.join(unknown)}; ReplayOptions has {', '.join(sorted(known))}"
        )
    return replace(options or ReplayOptions(), **overrides)
