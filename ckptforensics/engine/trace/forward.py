"""The traced forward pass: `trace_architecture`, and `trace_pass` with its logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptforensics.engine.replay.probes import logits_of
from ckptforensics.engine.trace.architecture import Architecture
from ckptforensics.engine.trace.graph import Graph
from ckptforensics.engine.trace.reader import read
from ckptforensics.engine.trace.recorder import Recorder, Trace


def _call(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The model called with keywords, else with the ids alone (a caller that knows the
    run's calling convention passes its own `call`)."""
    ids = batch["input_ids"]
    kwargs = {"input_ids": ids}
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    try:
        return model(**kwargs)
    except TypeError:
        return model(ids)


Call = Callable[[nn.Module, dict[str, torch.Tensor]], Any]


def trace_architecture(
    model: nn.Module, batch: dict[str, torch.Tensor], call: Call | None = None
) -> Architecture:
    """Run one forward pass of `model` on `batch` (on the model's device; grad enabled, no
    backward) and read the architecture off it.

    Args:
        model: the model, its weights loaded (eval mode is set for the pass: no dropout).
        batch: `input_ids` [B, T] (and optionally `attention_mask`).
        call: how to call the model (`replay.conventions.call_model` with the run's
            convention); default: keywords, else the ids alone.

    Returns:
        The architecture (`Architecture`); what could not be decided is in its notes.

    Example:
        >>> arch = trace_architecture(model, {"input_ids": ids})
        >>> arch.norm_placement, arch.qk_norm
        ('pre', False)
    """
    return trace_pass(model, batch, call)[0]


def trace_pass(
    model: nn.Module, batch: dict[str, torch.Tensor], call: Call | None = None
) -> tuple[Architecture, torch.Tensor]:
    """`trace_architecture`, and the pass's logits with their graph (a caller may take the
    gradient of a loss on them: the audit's RMS_t)."""
    was_training = model.training
    model.eval()
    trace = Trace(model)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied weight under its first name
    needs = [p for p in model.parameters() if not p.requires_grad]
    for p in needs:  # the graph needs every weight as a leaf
        p.requires_grad_(True)
    try:
        with torch.enable_grad(), Recorder(trace):
            out = (call or _call)(model, batch)
    finally:
        trace.remove()
        for p in needs:
            p.requires_grad_(False)
        model.train(was_training)
    logits = logits_of(out)
    if logits is None or logits.grad_fn is None:
        raise ValueError("the model's output has no logits with a gradient graph")
    g = Graph(logits.grad_fn)
    return read(trace, g, logits, names), logits
