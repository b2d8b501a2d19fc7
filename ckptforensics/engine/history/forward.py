"""One checkpoint's forward pass on the history's fixed batch: the replay's probes on every
module (activation RMS), its attention watch (each layer's largest pre-softmax logit and its
most collapsed head's entropy) and its logit figures (log Z, max |logit|).

The model is built once and each checkpoint's weights loaded into it: a history of N
checkpoints costs N loads and N forward passes, not N model builds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptforensics.engine.replay.conventions import (
    LabelError,
    call_model,
    detect_call,
    settle_labels,
)
from ckptforensics.engine.replay.probes import FWD_STATS, ModuleProbe, logits_of
from ckptforensics.engine.replay.session import logit_figures

__all__ = ["CheckpointPass", "Forward"]

_RMS = FWD_STATS.index("rms")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPass:
    """What one forward pass on the fixed batch measured at one checkpoint.

    Attributes:
        step: the checkpoint's step.
        attn_max: attention module -> its largest pre-softmax logit (over heads; logit units).
        attn_entropy: attention module -> its most collapsed head's mean entropy / log(keys)
            (1 uniform, 0 one-hot).
        log_z: mean log-sum-exp of the output logits over the batch's positions (nats).
        max_logit: largest |output logit|.
        rms: module -> RMS of its output (the activation's own unit).
        head: the module whose output is the logits (None: a bare function computes them).
    """

    step: int
    attn_max: dict[str, float]
    attn_entropy: dict[str, float]
    log_z: float
    max_logit: float
    rms: dict[str, float]
    head: str | None


class Forward:
    """The fixed batch's forward pass, set up once: the run's calling convention (measured on
    the first checkpoint, `replay.conventions`) and the replay's probes on the model."""

    def __init__(self, model: nn.Module, batch: dict[str, torch.Tensor], device: str) -> None:
        self.model = model.to(device).eval()
        self.batch = {k: v.to(device) for k, v in batch.items()}
        self.probe = ModuleProbe(model, device)
        self._call: Callable[[nn.Module, dict[str, torch.Tensor]], Any] | None = None

    def _settle(self) -> None:
        """How the run's trainer calls the model (labels measured from the data)."""
        try:
            shifted = settle_labels([self.batch]).shifted
        except LabelError:
            shifted = False  # ids alone: the inputs serve as the targets
        self.probe.enabled = False
        try:
            with torch.no_grad():
                conv = detect_call(self.model, self.batch, shifted)
        finally:
            self.probe.enabled = True
        self._call = lambda m, b: call_model(m, conv, b, shifted)

    def measure(self, step: int) -> CheckpointPass:
        """One pass with the weights now loaded (the checkpoint of `step`)."""
        if self._call is None:
            self._settle()
        assert self._call is not None
        self.probe.reset()
        with torch.no_grad():
            out = self._call(self.model, self.batch)
        stats = self.probe.collect()
        logits = logits_of(out)
        top, log_z = logit_figures(logits) if logits is not None else (math.nan, math.nan)
        attn_max: dict[str, float] = {}
        attn_ent: dict[str, float] = {}
        if stats.attn is not None:
            for mod, heads in zip(stats.attn_modules, stats.attn.tolist(), strict=True):
                live = [h for h in heads if math.isfinite(h[0])]
                # one module may run several calls (a shared block): its worst
                attn_max[mod] = max([attn_max.get(mod, -math.inf), *(h[0] for h in live)])
                ents = [h[1] for h in live if math.isfinite(h[1])]
                attn_ent[mod] = min([attn_ent.get(mod, math.inf), *ents])
        rms = {
            n: float(r)
            for n, r in zip(stats.modules, stats.fwd[:, _RMS].tolist(), strict=True)
            if math.isfinite(r)
        }
        return CheckpointPass(
            step=step,
            attn_max=attn_max,
            attn_entropy={k: v if math.isfinite(v) else math.nan for k, v in attn_ent.items()},
            log_z=log_z,
            max_logit=top,
            rms=rms,
            head=stats.head,
        )

    def close(self) -> None:
        self.probe.remove()
