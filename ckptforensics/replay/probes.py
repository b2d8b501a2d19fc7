"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["FWD_STATS", "BWD_STATS", "PassStats", "ModuleProbe", "param_grad_stats", "param_grad_sums"]

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

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu", ranks: Any = None) -> None:
        self.names = tuple(n for n, _ in model.named_modules() if n)
        self.index = {n: i for i, n in enumerate(self.names)}
        m = len(self.names)
        self.fwd = torch.full((m, len(FWD_STATS)), float("nan"), device=device)
        self.bwd = torch.full((m, len(BWD_STATS)), float("nan"), device=device)
        # Under torchrun (`replay.distributed`): elements each rank's statistics cover, to
        # weigh them when the ranks' tables are merged.
        self.ranks = ranks
        self.count = torch.zeros((m, 1), device=device) if ranks is not None else None
        # Outputs without this rank's rows as dim 0 (a position table [T, C] added to every
        # row) are the same on every rank, and their true gradient is the ranks' sum: kept
        # whole (they are small) and summed at `collect`, the norm taken after the sum.
        self.rows: int | None = None
        self.shared: dict[int, torch.Tensor] = {}
        self.fwd_order: list[int] = []
        self.bwd_order: list[int] = []
        # With activation checkpointing a block's modules run again in the backward pass:
        # only their first call in a pass is recorded.
        self.once = False
        self._ran: set[int] = set()
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
            if self.count is not None:
                self.count[i] = t.numel()
            if self.once:
                if i in self._ran:
                    return  # recomputed (activation checkpointing): same values; the gradient flows to the first
                self._ran.add(i)
            self.fwd_order.append(i)
            if t.requires_grad:
                shared = self.count is not None and (t.dim() == 0 or t.shape[0] != self.rows)
                t.register_hook(self._backward(i, shared))

        return hook

    def _backward(self, i: int, shared: bool = False):  # noqa: ANN202 - hook factory
        def hook(g: torch.Tensor) -> None:
            if shared:
                self.shared[i] = g.detach().float().clone()
            st = _stats(g.detach(), with_subnormal=False)
            # grad_norm = rms * sqrt(n); absmax; non-finite flag.
            self.bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
            self.bwd_order.append(i)

        return hook

    def reset(self) -> None:
        self.fwd.fill_(float("nan"))
        self.bwd.fill_(float("nan"))
        if self.count is not None:
            self.count.zero_()
        self.shared.clear()
        self._ran.clear()
        self.fwd_order.clear()
        self.bwd_order.clear()

    def collect(self) -> PassStats:
        """The pass's tables, read to the host in one transfer each (under torchrun, every
        rank's tables merged after one collective)."""
        fwd, bwd = (self.fwd, self.bwd) if self.ranks is None else self._merged()
        return PassStats(self.names, fwd.cpu().clone(), bwd.cpu().clone(), tuple(self.fwd_order), tuple(self.bwd_order))

    def _merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole batch's statistics from every rank's share of its rows: one gather of
        [fwd | bwd | count] per pass. Extremes and flags take the maximum, RMS and the
        subnormal share the element-weighted mean, gradient norms the root sum of squares."""
        assert self.count is not None
        nf, nb = len(FWD_STATS), len(BWD_STATS)
        flags = torch.zeros_like(self.count)
        flags[list(self.shared)] = 1.0
        table = torch.cat([self.fwd, self.bwd, self.count, flags], 1).double()
        every = self.ranks.gather(table.reshape(-1)).reshape(-1, *table.shape)  # [W, M, nf + nb + 2]
        fwd_r, bwd_r, nfw = every[..., :nf], every[..., nf : nf + nb], every[..., nf + nb]
        fwd = fwd_r.amax(0)
        tot = nfw.sum(0)
        rms = FWD_STATS.index("rms")
        fwd[:, rms] = ((fwd_r[..., rms].pow(2) * nfw).sum(0) / tot).sqrt()
        sub = FWD_STATS.index("subnormal_share")
        fwd[:, sub] = (fwd_r[..., sub] * nfw).sum(0) / tot
        bwd = bwd_r.amax(0)
        bwd[:, BWD_STATS.index("grad_norm")] = bwd_r[..., BWD_STATS.index("grad_norm")].pow(2).sum(0).sqrt()
        # A rank with no rows reports zeros over no elements (`_stats`): weightless.
        shared = torch.nonzero(every[..., nf + nb + 1].amin(0) > 0).flatten().tolist()  # shared on every rank
        if shared:
            grads = [self.shared[i] for i in shared]
            total = self.ranks.sum(torch.cat([g.reshape(-1) for g in grads]))
            for i, g in zip(shared, total.split([g.numel() for g in grads]), strict=True):
                st = _stats(g, with_subnormal=False).double()
                bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
        return fwd.float(), bwd.float()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def param_grad_stats(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """[RMS(g), RMS_t, SPAM spike count] of one parameter's gradient, on its device.

    RMS_t = sqrt(mean(g^2 / v_hat)) against Adam's second moment *before* this step
    (StableAdamW, Wortsman 2304.13013): ~1 in steady state, >> 1 when v is stale.
    Spikes: elements with g^2 > 5000 v (SPAM 2501.06842; v floored by Adam's eps^2 / c).
    NaN / 0 without Adam state.
    """
    sums = param_grad_sums(grad, state, group)
    n = max(grad.numel(), 1)
    return torch.stack([(sums[0] / n).sqrt(), (sums[1] / n).sqrt(), sums[2]])


def param_grad_sums(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """[sum g^2, sum g^2 / v_hat, SPAM spike count] of a gradient (or a rank's shard of it
    with the matching shard of v): sums, so that ranks' shares add up (`param_grad_stats`).

    One ratio tensor serves both: with v_hat = c v (c the bias correction),
    g^2 / (v_hat + eps^2) = (g^2 / (v + eps^2 / c)) / c. NaN / 0 without Adam state.
    """
    g2 = grad.detach().float().pow(2)
    v = state.get("exp_avg_sq")
    if v is None or float(state.get("step", 0)) <= 0 or "betas" not in group:
        return torch.stack([g2.sum(), g2.new_tensor(math.nan), g2.new_zeros(())])
    v = v.to_local() if hasattr(v, "to_local") else v
    beta2, eps = group["betas"][1], group["eps"]
    c = 1.0 / (1 - beta2 ** float(state["step"]))  # v_hat = c v
    total = g2.sum()
    r = g2.div_(v.float().add(eps * eps / c))  # g2 is our own temporary; r = c g^2 / (v_hat + eps^2)
    return torch.stack([total, r.sum() / c, (r > 5000).sum().float()])
