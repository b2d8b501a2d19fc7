"""One probed pass's statistics as the host gets them, under torchrun merged across ranks.

`PassStats` is the record of a pass; `merge_ranks` makes the whole batch's tables from every
rank's share of its rows. The tables are filled by `engine/replay/probes.py`'s `ModuleProbe`, their
rows derived as `engine/replay/proberows.py` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptforensics.engine.replay.proberows import BF16_MAX, BWD_STATS, FP16_MAX, FWD_STATS

__all__ = ["PassStats", "merge_ranks"]


@dataclass(frozen=True, slots=True)
class PassStats:
    """One forward+backward pass.

    Attributes:
        modules: module names (the model's own), row order of the tables.
        fwd: [M, len(FWD_STATS)] output statistics; NaN for modules that did not run.
        bwd: [M, len(BWD_STATS)] output-gradient statistics; NaN where none flowed.
        fwd_order, bwd_order: row indices in the order the hooks fired.
        attn_modules: the module that ran each attention call, in forward order (one per
            layer; the innermost module running when the call was made).
        attn: [L, Hmax, len(ATTN_STATS)] per attention call and head; NaN past a call's heads.
        head: the module whose output is the model's logits (the last module in forward
            order whose output has the logits' shape); None when a bare function computes them.
        logit_mean: mean output logit of the pass (nats; its drift with log Z is the
            output-logit divergence of Wortsman et al. 2023).
    """

    modules: tuple[str, ...]
    fwd: torch.Tensor
    bwd: torch.Tensor
    fwd_order: tuple[int, ...]
    bwd_order: tuple[int, ...]
    attn_modules: tuple[str, ...] = ()
    attn: torch.Tensor | None = None
    head: str | None = None
    logit_mean: float = math.nan


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
    sub = (
        (((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / x.numel())
        if with_subnormal
        else absmax.new_zeros(())
    )
    return torch.stack(
        [absmax, rms, nonfinite, (absmax > FP16_MAX).float(), (absmax > BF16_MAX).float(), sub]
    )


def merge_ranks(
    ranks: Any,
    fwd: torch.Tensor,
    bwd: torch.Tensor,
    count: torch.Tensor,
    shared: dict[int, torch.Tensor],
    attn: torch.Tensor,
    logit_sum: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch's statistics from every rank's share of its rows: one gather of
    [fwd | bwd | count | shared flag] per module, the attention table and the logit sums.
    Extremes and flags take the maximum, RMS and the subnormal share the element-weighted
    mean, gradient norms the root sum of squares, attention entropy and logit sums add."""
    nf, nb = len(FWD_STATS), len(BWD_STATS)
    flags = torch.zeros_like(count)
    flags[list(shared)] = 1.0
    table = torch.cat([fwd, bwd, count, flags], 1).double()
    m = table.numel()
    flat = torch.cat(
        [
            table.reshape(-1),
            attn.reshape(-1).double().to(table.device),
            logit_sum.to(table.device),
        ]
    )
    gathered = ranks.gather(flat).reshape(-1, flat.numel())  # [W, m + attn + 2]
    w = gathered.shape[0]
    every = gathered[:, :m].reshape(w, *table.shape)  # [W, M, nf + nb + 2]
    att_r = gathered[:, m : m + attn.numel()].reshape(w, *attn.shape)
    logit_r = gathered[:, m + attn.numel() :]
    fwd_r, bwd_r, nfw = every[..., :nf], every[..., nf : nf + nb], every[..., nf + nb]
    fwd = fwd_r.amax(0)
    tot = nfw.sum(0)
    rms = FWD_STATS.index("rms")
    fwd[:, rms] = ((fwd_r[..., rms].pow(2) * nfw).sum(0) / tot).sqrt()
    sub = FWD_STATS.index("subnormal_share")
    fwd[:, sub] = (fwd_r[..., sub] * nfw).sum(0) / tot
    bwd = bwd_r.amax(0)
    bwd[:, BWD_STATS.index("grad_norm")] = (
        bwd_r[..., BWD_STATS.index("grad_norm")].pow(2).sum(0).sqrt()
    )
    # A rank with no rows reports zeros over no elements (`_stats`): weightless.
    shared_rows = (
        torch.nonzero(every[..., nf + nb + 1].amin(0) > 0).flatten().tolist()
    )  # shared on every rank
    if shared_rows:
        grads = [shared[i] for i in shared_rows]
        total = ranks.sum(torch.cat([g.reshape(-1) for g in grads]))
        for i, g in zip(shared_rows, total.split([g.numel() for g in grads]), strict=True):
            st = _stats(g, with_subnormal=False).double()
            bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
    att = att_r[0].clone() if att_r.shape[0] else attn.double()
    if att.numel():
        att[..., 0] = att_r[..., 0].amax(0)
        att[..., 1:] = att_r[..., 1:].nansum(0)
    logits = logit_r.nansum(0)
    return fwd.float(), bwd.float(), att.float(), logits.float()
