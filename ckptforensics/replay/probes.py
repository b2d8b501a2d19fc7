"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FWD_STATS", "BWD_STATS", "PassStats", "ModuleProbe", "param_grad_stats"]

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


def param_grad_stats(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """[RMS(g), RMS_t, SPAM spike count] of one parameter's gradient, on its device.

    RMS_t = sqrt(mean(g^2 / v_hat)) against Adam's second moment *before* this step
    (StableAdamW, Wortsman 2304.13013): ~1 in steady state, >> 1 when v is stale.
    Spikes: elements with g^2 > 5000 v (SPAM 2501.06842; v floored by Adam's eps^2 / c).
    NaN / 0 without Adam state. One ratio tensor serves both: with v_hat = c v (c the
    bias correction), g^2 / (v_hat + eps^2) = (g^2 / (v + eps^2 / c)) / c.
    """
    g2 = grad.detach().float().pow(2)
    v = state.get("exp_avg_sq")
    if v is None or float(state.get("step", 0)) <= 0 or "betas" not in group:
        return torch.stack([g2.mean().sqrt(), g2.new_tensor(math.nan), g2.new_zeros(())])
    beta2, eps = group["betas"][1], group["eps"]
    c = 1.0 / (1 - beta2 ** float(state["step"]))  # v_hat = c v
    rms = g2.mean().sqrt()
    r = g2.div_(v.float().add(eps * eps / c))  # g2 is our own temporary; r = c g^2 / (v_hat + eps^2)
    return torch.stack([rms, (r.mean() / c).sqrt(), (r > 5000).sum().float()])
