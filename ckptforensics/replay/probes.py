"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FWD_STATS", "BWD_STATS", "PassStats", "ModuleProbe"]

FWD_STATS = ("absmax", "rms", "nonfinite", "over_fp16", "over_bf16", "subnormal_share")
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
            x = t.detach()
            a = x.abs().float()
            fin = torch.isfinite(a)
            n = max(x.numel(), 1)
            tiny = torch.finfo(x.dtype).tiny
            self.fwd[i] = torch.stack(
                [
                    torch.where(fin, a, 0).amax() if x.numel() else a.new_zeros(()),
                    torch.sqrt(torch.where(fin, a * a, 0).sum() / n),
                    (~fin).sum().float(),
                    (a > _FP16_MAX).sum().float(),
                    (a > _BF16_MAX).sum().float(),
                    ((a < tiny) & (a > 0)).sum().float() / n,
                ]
            )
            self.fwd_order.append(i)
            if t.requires_grad:
                t.register_hook(self._backward(i))

        return hook

    def _backward(self, i: int):  # noqa: ANN202 - hook factory
        def hook(g: torch.Tensor) -> None:
            a = g.detach().abs().float()
            fin = torch.isfinite(a)
            self.bwd[i] = torch.stack(
                [torch.sqrt(torch.where(fin, a * a, 0).sum()), torch.where(fin, a, 0).amax(), (~fin).sum().float()]
            )
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
