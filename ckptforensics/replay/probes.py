"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FWD_STATS", "BWD_STATS", "PassStats", "ModuleProbe"]

FWD_STATS = ("absmax", "rms", "nonfinite", "over_fp16", "over_bf16", "subnormal_share")
# nonfinite / over_* are 0/1 flags (any element), derived from the extrema.
BWD_STATS = ("grad_norm", "grad_absmax", "grad_nonfinite")

_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@dataclass(frozen=True, slots=True)
class PassStats:
    """One forward+backward pass.

    Attributes:
        modules: module names (the model's own), row order of the tables.
        fwd: [M, len(FWD_STATS)] output statistics; NaN for modules that did not run.
        bwd: [M, len(BWD_STATS)] output-gradient statistics; NaN where none flowed.
        fwd_order, bwd_order: row indices in the order the hooks fired.
    """

    modules: tuple[str, ...]
    fwd: torch.Tensor
    bwd: torch.Tensor
    fwd_order: tuple[int, ...]
    bwd_order: tuple[int, ...]


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        for o in out.values():
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _stats(x: torch.Tensor, with_subnormal: bool) -> torch.Tensor:
    """[absmax, rms, nonfinite, over_fp16, over_bf16, subnormal_share] in two passes.

    One aminmax and one norm (both propagate NaN/inf), then scalar ops: the flags are
    0/1 indicators derived from the extrema, not counts, so no pass is spent counting
    and nothing leaves the device.
    """
    if x.numel() == 0:
        return torch.zeros(len(FWD_STATS), device=x.device)
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(-lo.float(), hi.float())
    rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    nonfinite = (~torch.isfinite(absmax)).float()
    sub = (((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / x.numel()) if with_subnormal else absmax.new_zeros(())
    return torch.stack([absmax, rms, nonfinite, (absmax > _FP16_MAX).float(), (absmax > _BF16_MAX).float(), sub])


class ModuleProbe:
    """Forward hooks on every named module, and a gradient hook on each output."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.names = tuple(n for n, _ in model.named_modules() if n)
        self.index = {n: i for i, n in enumerate(self.names)}
        m = len(self.names)
        self.fwd = torch.full((m, len(FWD_STATS)), float("nan"), device=device)
        self.bwd = torch.full((m, len(BWD_STATS)), float("nan"), device=device)
        self.fwd_order: list[int] = []
        self.bwd_order: list[int] = []
        self.enabled = True
        self._handles = [mod.register_forward_hook(self._forward(self.index[n])) for n, mod in model.named_modules() if n]

    def _forward(self, i: int):  # noqa: ANN202 - hook factory
        def hook(module: nn.Module, args: object, out: object) -> None:
            if not self.enabled:
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            self.fwd[i] = _stats(t.detach(), with_subnormal=t.dtype in (torch.float16, torch.bfloat16))
            self.fwd_order.append(i)
            if t.requires_grad:
                t.register_hook(self._backward(i))

        return hook

    def _backward(self, i: int):  # noqa: ANN202 - hook factory
        def hook(g: torch.Tensor) -> None:
            st = _stats(g.detach(), with_subnormal=False)
            # grad_norm = rms * sqrt(n); absmax; non-finite flag.
            self.bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
            self.bwd_order.append(i)

        return hook

    def reset(self) -> None:
        self.fwd.fill_(float("nan"))
        self.bwd.fill_(float("nan"))
        self.fwd_order.clear()
        self.bwd_order.clear()

    def collect(self) -> PassStats:
        """The pass's tables, read to the host in one transfer each."""
        return PassStats(self.names, self.fwd.cpu().clone(), self.bwd.cpu().clone(), tuple(self.fwd_order), tuple(self.bwd_order))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
