"""Per-sample evidence: loss, share of the gradient norm^2, and data statistics of each row."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from .probes import ModuleProbe

__all__ = ["RowStats", "row_data_stats", "window_row_stats", "PerSampleGrad", "per_token_loss"]


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


def _longest_runs(eq: np.ndarray) -> np.ndarray:
    """Longest stretch of True in each row of a boolean [N, L] array (0 where none)."""
    n, L = eq.shape
    if L == 0:
        return np.zeros(n, dtype=np.int64)
    pos = np.arange(1, L + 1)
    # the position of the last False at or before each position: a run ends there
    last_false = np.maximum.accumulate(np.where(eq, 0, pos), axis=1)
    return (pos - last_false).max(1)


def _longest_matches(ids: np.ndarray, periods: range) -> np.ndarray:
    """[B, len(periods)]: for each row and period p, the longest stretch where
    x[t] == x[t - p], plus p itself (0 where there is none, or the row is too short)."""
    b, t = ids.shape
    out = np.zeros((b, len(periods)), dtype=np.int64)
    for k, p in enumerate(periods):
        if t > p:
            runs = _longest_runs(ids[:, p:] == ids[:, :-p])
            out[:, k] = np.where(runs > 0, runs + p, 0)
    return out


def row_data_stats(ids: np.ndarray, others: np.ndarray) -> list[RowStats]:
    """Stats for every row of `ids` [B, T]; `others` = all other tokens of the window.

    Whole-batch numpy ops (a handful per period), not a pass per row: a token is unseen
    when no other row of the batch holds it and `others` does not either."""
    ids = np.asarray(ids)
    if ids.shape[0] == 0:
        return []
    rows_with = _rows_holding([ids])
    alone = rows_with[0][(rows_with[1] == 1) & ~np.isin(rows_with[0], others)]
    return _stats(ids, alone)


def window_row_stats(window: list[np.ndarray]) -> list[list[RowStats]]:
    """`row_data_stats` of each batch [B, T] of a window against the window's other
    batches, in one call: a token is unseen exactly when one row of the whole window holds
    it, and batches of one row length are measured stacked (the same figures as a call per
    batch, with a fixed ~0.2 ms of numpy calls a step saved)."""
    window = [np.asarray(x) for x in window]
    rows_with = _rows_holding([x for x in window if x.shape[0]])
    alone = rows_with[0][rows_with[1] == 1]
    out: list[list[RowStats]] = [[] for _ in window]
    by_len: dict[int, list[int]] = {}
    for k, x in enumerate(window):
        if x.shape[0]:
            by_len.setdefault(x.shape[1], []).append(k)
    for ks in by_len.values():
        every = _stats(np.concatenate([window[k] for k in ks]), alone)
        at = 0
        for k in ks:
            out[k] = every[at : at + window[k].shape[0]]
            at += window[k].shape[0]
    return out


def _rows_holding(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct tokens of these batches, how many of their rows hold each), a row's
    repeats of a token counted once."""
    held = []
    for ids in batches:
        srt = np.sort(ids, axis=1)
        first = np.ones_like(srt, dtype=bool)
        first[:, 1:] = srt[:, 1:] != srt[:, :-1]
        held.append(srt[first])
    if not held:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.unique(np.concatenate(held), return_counts=True)


def _stats(ids: np.ndarray, alone: np.ndarray) -> list[RowStats]:
    """Each row's stats of `ids` [N, T] (N > 0), `alone`: the sorted tokens it alone holds."""
    b, t = ids.shape
    runs = _longest_matches(ids, range(1, 14))
    srt = np.sort(ids, axis=1)
    distinct = (np.diff(srt, axis=1) != 0).sum(1) + (1 if t else 0)
    unseen = np.isin(ids, alone).sum(1)
    return [
        RowStats(
            longest_run=max(int(runs[r, 0]), 1 if t else 0),
            periodic_repeat=int(runs[r, 1:].max()) if t else 0,
            unique_ratio=int(distinct[r]) / max(t, 1),
            unseen=int(unseen[r]),
            length=int(t),
        )
        for r in range(b)
    ]


@dataclass(slots=True, eq=False)
class _Input:
    """A linear layer's input in one pass: [B, T, in] in fp32, the linears whose gradients
    have yet to use it, and the sum of the [B, T, T] Gram matrices of the output gradients
    of those that have."""

    src: torch.Tensor
    x: torch.Tensor
    consumers: int = 0
    ggram: torch.Tensor | None = None


class PerSampleGrad:
    """Per-sample squared gradient norms of every nn.Linear, from one batched backward.

    For y = x W^T + b with x [B, T, in] and output gradient g [B, T, out], sample b's
    weight gradient is sum_t g_bt x_bt^T, whose squared Frobenius norm is
    sum_{t,t'} (g_bt . g_bt') (x_bt . x_bt'): two [B, T, T] Gram matrices instead of B
    backward passes (or B x out x in per-sample gradients) when T^2 < in * out.

    Linears fed one input tensor (q/k/v, gate/up) share its Gram matrix, and the sum of
    their figures is that Gram matrix against the sum of their gradients' Gram matrices
    (each added in place by one `baddbmm_`, as the gradient arrives): one product per
    input, not per linear. Each input's figure is kept on the device and summed once,
    at `sq` (at 64 wide the ops' dispatch, not their arithmetic, is much of the cost).
    """

    def __init__(self, model: nn.Module, probe: ModuleProbe | None = None) -> None:
        self._vals: list[torch.Tensor] = []
        self.enabled = False
        # Keyed by the input's id, with the input kept so the id stays its own; dropped
        # once every consumer's gradient has used it (or at `reset`).
        self._inputs: dict[int, _Input] = {}
        # With a `ModuleProbe` on the same model, its hooks on each linear carry this
        # one's work (`ModuleProbe.ride`): one forward hook and one gradient hook per
        # linear instead of two each; linears it does not hook get hooks of their own.
        self._probe = probe
        ridden = probe.ride(self._ride) if probe is not None else set()
        self._handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if isinstance(m, nn.Linear) and id(m) not in ridden
        ]

    @property
    def sq(self) -> torch.Tensor | None:
        """[B] per-sample squared gradient norm of the pass (None before any gradient).
        An input some of whose linears got no gradient (an output the loss does not use)
        is measured here, on the gradients that came."""
        for entry in self._inputs.values():
            self._finish(entry)
        if len(self._vals) > 1:
            self._vals = [torch.stack(self._vals).sum(0)]
        return self._vals[0] if self._vals else None

    def _hook(self, mod: nn.Linear, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        fn = self._ride(mod, args, out)
        if fn is not None:
            out.register_hook(fn)

    def _ride(
        self, mod: nn.Module, args: tuple[Any, ...], out: Any
    ) -> Callable[[torch.Tensor], None] | None:
        """A linear's forward seen: its input held, and the gradient hook its output needs
        (None when this pass measures nothing); who registers it is the caller's choice."""
        if not self.enabled or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
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
        bias = getattr(mod, "bias", None) is not None

        def grad_hook(g: torch.Tensor) -> None:
            gg = g.detach().reshape(x.shape[0], -1, g.shape[-1]).float()
            t, fin, fout = x.shape[1], x.shape[2], gg.shape[2]
            entry.consumers -= 1
            if t * t <= fin * fout:
                if entry.ggram is None:
                    entry.ggram = torch.bmm(gg, gg.transpose(1, 2))
                else:
                    entry.ggram.baddbmm_(gg, gg.transpose(1, 2))
            else:
                self._vals.append(torch.einsum("bto,bti->boi", gg, x).pow(2).sum((1, 2)))
            if bias:
                self._vals.append(gg.sum(1).pow(2).sum(1))
            if entry.consumers <= 0:
                self._finish(entry)
                if self._inputs.get(id(entry.src)) is entry:
                    del self._inputs[id(entry.src)]

        return grad_hook

    def _finish(self, entry: _Input) -> None:
        """An input's figure: its Gram matrix against its gradients' summed Gram matrices."""
        if entry.ggram is not None:
            gram = torch.bmm(entry.x, entry.x.transpose(1, 2))
            self._vals.append(gram.mul_(entry.ggram).sum((1, 2)))
            entry.ggram = None

    def reset(self) -> None:
        self._vals = []
        self._inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._probe is not None:
            self._probe.ride(None)
            self._probe = None
