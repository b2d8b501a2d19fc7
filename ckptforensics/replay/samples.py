"""Per-sample evidence: loss, share of the gradient norm^2, and data statistics of each row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

__all__ = ["RowStats", "row_data_stats", "PerSampleGrad", "per_token_loss"]


def per_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    shifted: bool = False,
) -> torch.Tensor:
    """Causal-LM cross entropy per token (ignored tokens 0).

    HF's labels are the inputs, shifted inside the loss: [B, T-1]. Megatron, nanoGPT,
    LitGPT, torchtitan and OLMo-core hand the model targets already shifted (`labels[t]` is
    the token after `t`): with `shifted`, every position is scored as is: [B, T]. Any
    negative label is ignored (HF's -100, nanoGPT's -1).
    """
    lg, tgt = (logits.float(), labels) if shifted else (logits[:, :-1].float(), labels[:, 1:])
    tgt = torch.where(tgt < 0, torch.full_like(tgt, -100), tgt)
    loss = nn.functional.cross_entropy(
        lg.reshape(-1, lg.size(-1)), tgt.reshape(-1), reduction="none", ignore_index=-100
    )
    loss = loss.view(tgt.shape)
    if mask is not None:
        loss = loss * (mask if shifted else mask[:, 1:]).to(loss.dtype)
    return loss


@dataclass(frozen=True, slots=True)
class RowStats:
    """Data statistics of one row (OLMo-core's instance filter and friends).

    Attributes:
        longest_run: longest stretch of one repeated token.
        periodic_repeat: longest stretch repeating with a period of 2..13 tokens.
        unique_ratio: distinct tokens / tokens.
        unseen: tokens of the row that no other row of the window contains.
        length: tokens in the row.
    """

    longest_run: int
    periodic_repeat: int
    unique_ratio: float
    unseen: int
    length: int


def _longest_match(x: np.ndarray, p: int) -> int:
    """Longest stretch where x[t] == x[t - p], plus the period itself."""
    if len(x) <= p:
        return 0
    eq = np.concatenate([[0], (x[p:] == x[:-p]).astype(np.int8), [0]])
    d = np.diff(eq)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return int((ends - starts).max()) + p if starts.size else 0


def row_data_stats(ids: np.ndarray, others: np.ndarray) -> list[RowStats]:
    """Stats for every row of `ids` [B, T]; `others` = all other tokens of the window."""
    seen_elsewhere = set(np.unique(others).tolist())
    out = []
    for b in range(ids.shape[0]):
        row = ids[b]
        rest = set(np.unique(np.delete(ids, b, axis=0)).tolist()) | seen_elsewhere
        out.append(
            RowStats(
                longest_run=max(_longest_match(row, 1), 1 if len(row) else 0),
                periodic_repeat=max((_longest_match(row, p) for p in range(2, 14)), default=0),
                unique_ratio=len(np.unique(row)) / max(len(row), 1),
                unseen=int(sum(1 for t in row.tolist() if t not in rest)),
                length=int(len(row)),
            )
        )
    return out


@dataclass(slots=True, eq=False)
class _Input:
    """A linear layer's input in one pass: [B, T, in] in fp32, its [B, T, T] Gram matrix
    once a gradient asked for it, and the linears whose gradients have yet to use it."""

    src: torch.Tensor
    x: torch.Tensor
    gram: torch.Tensor | None = None
    consumers: int = 0


class PerSampleGrad:
    """Per-sample squared gradient norms of every nn.Linear, from one batched backward.

    For y = x W^T + b with x [B, T, in] and output gradient g [B, T, out], sample b's
    weight gradient is sum_t g_bt x_bt^T, whose squared Frobenius norm is
    sum_{t,t'} (g_bt . g_bt') (x_bt . x_bt'): two [B, T, T] Gram matrices instead of B
    backward passes (or B x out x in per-sample gradients) when T^2 < in * out.
    """

    def __init__(self, model: nn.Module) -> None:
        self.sq: torch.Tensor | None = None
        self.enabled = False
        # Linears fed the same input tensor (q/k/v, gate/up) share its Gram matrix: keyed
        # by the input's id, with the input kept so the id stays its own; dropped once
        # every consumer's gradient has used it (or at `reset`).
        self._inputs: dict[int, _Input] = {}
        self._handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, nn.Linear)
        ]

    def _hook(self, mod: nn.Linear, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if not self.enabled or not out.requires_grad:
            return
        src = args[0]
        entry = self._inputs.get(id(src))
        if entry is None or entry.src is not src:
            x = src.detach()
            if x.dim() == 2:
                x = x.unsqueeze(1)
            entry = _Input(src, x.reshape(x.shape[0], -1, x.shape[-1]).float())
            self._inputs[id(src)] = entry
        entry.consumers += 1
        x = entry.x

        def grad_hook(g: torch.Tensor) -> None:
            gg = g.detach().reshape(x.shape[0], -1, g.shape[-1]).float()
            t, fin, fout = x.shape[1], x.shape[2], gg.shape[2]
            if t * t <= fin * fout:
                if entry.gram is None:
                    entry.gram = torch.bmm(x, x.transpose(1, 2))
                val = (torch.bmm(gg, gg.transpose(1, 2)) * entry.gram).sum((1, 2))
            else:
                val = torch.einsum("bto,bti->boi", gg, x).pow(2).sum((1, 2))
            if mod.bias is not None:
                val = val + gg.sum(1).pow(2).sum(1)
            self.sq = val if self.sq is None else self.sq + val
            entry.consumers -= 1
            if entry.consumers <= 0 and self._inputs.get(id(entry.src)) is entry:
                del self._inputs[id(entry.src)]

        out.register_hook(grad_hook)

    def reset(self) -> None:
        self.sq = None
        self._inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
