"""Per-sample evidence: loss and share of the gradient norm^2 (the data statistics of each
row are `engine/replay/rowstats.py`'s, re-exported here)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ckptforensics.core import fused as fused_kernels
from ckptforensics.engine.replay.rowstats import RowStats, row_data_stats, window_row_stats

if TYPE_CHECKING:
    from ckptforensics.engine.replay.probes import ModuleProbe

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
    tgt = labels if shifted else labels[:, 1:]
    tgt = torch.where(tgt < 0, -100, tgt)
    if not shifted:
        # the targets shifted, not the logits (as HF's loss does): every position scored,
        # the last against an ignored target, so that [B, T, V] logits are not copied
        # (`logits[:, :-1]` is not contiguous: its reshape copied all of them); each
        # position's loss, and its gradient, is the same number either way
        tgt = nn.functional.pad(tgt, (0, 1), value=-100)
    lg = logits.float()
    loss = nn.functional.cross_entropy(
        lg.reshape(-1, lg.size(-1)), tgt.reshape(-1), reduction="none", ignore_index=-100
    )
    loss = loss.view(tgt.shape)
    if not shifted:
        loss = loss[:, :-1].contiguous()  # [B, T - 1]; contiguous: sums over it as before
    if mask is not None:
        loss = loss * (mask if shifted else mask[:, 1:]).to(loss.dtype)
    return loss


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

    With `fused` (one process, fp32: `_fusable`), a linear whose per-sample gradients are
    cheaper to form than its Gram matrices (`_fuse_pays`) is called on a detached weight,
    so autograd skips its weight gradient, and its gradient hook forms that gradient
    itself as the sum of the per-sample ones, [B, out, in] in one `bmm` of the flops
    autograd's `mm` would have spent: the per-sample norms then cost a reduction over
    that product, not the Gram products' B T^2 (in + out) multiply-adds (0.7-0.8x the
    weight gradient's own at 384 wide x 256 tokens). The weight gradient differs from
    autograd's by the order of its float sum only; the weight's `.grad` is set or added
    to as `AccumulateGrad` would (ties and repeated calls sum).
    """

    def __init__(
        self, model: nn.Module, probe: ModuleProbe | None = None, fused: bool = False
    ) -> None:
        self._vals: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []  # fused linears' per-sample L2 norms, [B] each
        # ... or, with the C kernels, rows of one buffer [calls, B]: `_nnorm` rows this pass
        self._normbuf: torch.Tensor | None = None
        self._nnorm = 0
        self.enabled = False
        # The pass's batch rows: a linear whose input does not lead with them (a MoE layer's
        # experts fed capacity buffers, DeepSpeed's [1, 1, C, d]) holds no row's gradient
        # apart, and is left out of the per-sample figures (None: every linear counts).
        self.rows: int | None = None
        # The last output a fused forward returned, with its linear and input: its gradient
        # hook forms the weight's gradient. `_ride` (the linear's forward hook) takes it;
        # one called without its hooks (`.forward` directly) is hooked on its own by the
        # next fused call or the model's forward hook (`_settle`), so no gradient is lost.
        self._fused_out: tuple[torch.Tensor, nn.Parameter, torch.Tensor, bool] | None = None
        self._fused_mods: list[nn.Linear] = []
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
        # CPU: the per-sample norms and their sum in one C-kernel pass (`fused.load`)
        self._kernels = fused_kernels.load() if fused else None
        if fused:
            for m in model.modules():
                if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
                    m.forward = functools.partial(self._linear, m)  # type: ignore[method-assign]
                    self._fused_mods.append(m)
            if self._fused_mods:
                self._handles.append(model.register_forward_hook(self._settle, always_call=True))

    @property
    def sq(self) -> torch.Tensor | None:
        """[B] per-sample squared gradient norm of the pass (None before any gradient).
        An input some of whose linears got no gradient (an output the loss does not use)
        is measured here, on the gradients that came."""
        for entry in self._inputs.values():
            self._finish(entry)
        if self._norms:
            self._vals.append(torch.stack(self._norms).square().sum(0))
            self._norms = []
        if self._nnorm and self._normbuf is not None:
            self._vals.append(self._normbuf[: self._nnorm].square().sum(0))
            self._nnorm = 0
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
        pending = self._fused_out
        if pending is not None and out is pending[0]:
            self._fused_out = None
            return self._fused_hook(pending[1], pending[2], pending[3])
        if not self.enabled or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        src = args[0]
        if self.rows is not None and src.shape[0] != self.rows:
            return None
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

    def _linear(self, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """`mod`'s forward while fused: on its detached weight when `_fusable`, so that its
        gradient hook (`_fused_hook`) forms the weight's gradient; else as it is."""
        if self._fused_out is not None:
            self._settle()
        w, b = mod.weight, mod.bias
        if not (
            self.enabled
            and (self.rows is None or x.shape[0] == self.rows)
            and _fusable(x, w, b)
            and _fuse_pays(x, w)
        ):
            return nn.functional.linear(x, w, b)
        out = nn.functional.linear(x, w.detach(), b)
        self._fused_out = (out, w, x.detach(), b is not None)
        return out

    def _settle(self, *_: object) -> None:
        """A fused output no forward hook took (its linear called through `.forward`):
        its gradient hook registered on its own."""
        if self._fused_out is not None:
            out, w, x, bias = self._fused_out
            self._fused_out = None
            out.register_hook(self._fused_hook(w, x, bias))

    def _fused_hook(
        self, w: nn.Parameter, x: torch.Tensor, bias: bool
    ) -> Callable[[torch.Tensor], None]:
        """The gradient hook of a fused linear's output: per-sample weight gradients
        [B, out, in], their norms kept, their sum the weight's gradient (on CPU with the C
        kernels: norms into the pass's buffer, the sum straight into `.grad`, one pass).
        `w`: the linear's weight, `bias`: whether it has one."""
        kernels = self._kernels if x.is_cpu else None

        def grad_hook(g: torch.Tensor) -> None:
            gg = g.detach()
            if gg.dim() != 3:
                gg = gg.reshape(x.shape[0], -1, gg.shape[-1])
            per = torch.bmm(gg.transpose(1, 2), x)
            if bias:
                self._vals.append(gg.sum(1).pow(2).sum(1))
            if kernels is not None and self._kernel_sum(kernels, per, w):
                return
            self._norms.append(torch.linalg.vector_norm(per, dim=(1, 2)))
            if w.grad is None:
                w.grad = per.sum(0)
            else:
                w.grad.add_(per.sum(0))

        return grad_hook

    def _kernel_sum(self, kernels: Any, per: torch.Tensor, w: torch.Tensor) -> bool:
        """The per-sample norms of `per` into the pass's buffer and their sum into `w.grad`
        (added in place to an fp32 CPU gradient already there) by one C pass; False where
        the kernel does not take them."""
        row = self._norm_row(per.shape[0])
        if row is None:
            return False
        held = w.grad
        into = (
            held
            if held is not None
            and type(held) is torch.Tensor
            and held.dtype == torch.float32
            and held.device.type == "cpu"
            and held.is_contiguous()
            and held.shape == w.shape
            else None
        )
        total = into if into is not None else torch.empty(w.shape, dtype=torch.float32)
        if not kernels.persample(per, row, total, into is not None):
            self._nnorm -= 1
            return False
        if held is None:
            w.grad = total
        elif into is None:
            held.add_(total)
        return True

    def _norm_row(self, b: int) -> int | None:
        """The address of the next row [B] of the pass's fp32 buffer of fused per-sample
        norms (grown as needed); None where this call's batch differs from the buffer's."""
        buf = self._normbuf
        if buf is None or (self._nnorm == 0 and buf.shape[1] != b):
            buf = self._normbuf = torch.empty(64, b, dtype=torch.float32)
        elif buf.shape[1] != b:
            return None
        elif self._nnorm == buf.shape[0]:
            grown = torch.empty(2 * buf.shape[0], b, dtype=torch.float32)
            grown[: buf.shape[0]] = buf
            buf = self._normbuf = grown
        self._nnorm += 1
        return buf.data_ptr() + 4 * b * (self._nnorm - 1)

    def _finish(self, entry: _Input) -> None:
        """An input's figure: its Gram matrix against its gradients' summed Gram matrices."""
        if entry.ggram is not None:
            gram = torch.bmm(entry.x, entry.x.transpose(1, 2))
            self._vals.append(gram.mul_(entry.ggram).sum((1, 2)))
            entry.ggram = None

    def reset(self) -> None:
        self._vals = []
        self._norms = []
        self._nnorm = 0
        self._fused_out = None
        self._inputs.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for m in self._fused_mods:
            del m.forward
        self._fused_mods.clear()
        if self._probe is not None:
            self._probe.ride(None)
            self._probe = None


# Time of one elementwise pass over a fused linear's per-sample product, in multiply-adds
# of a product per element: below it the Gram matrices cost less (bench/RESULTS.md,
# replay_step notes).
FUSE_PASS = 8
# A fused linear's [B, out, in] per-sample gradients, at most this many elements (fp32:
# 256 MiB); a larger product takes the Gram matrices.
FUSED_MAX = 1 << 26


def _fusable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether a linear call can form its own weight gradient: fp32 input and weight as
    plain tensors (not a DTensor, not under autocast: there the product's dtype and the
    weight's cast are autograd's), the weight trained, an output that will get a gradient
    with the weight detached, grad mode on, rows as [B, T, in]."""
    # (cheapest tests first: this runs at every linear's call, between the model's ops)
    return (
        type(x) is torch.Tensor
        and type(w) is nn.Parameter
        and x.dtype is torch.float32
        and w.dtype is torch.float32
        and w.requires_grad
        and (x.requires_grad or (b is not None and b.requires_grad))
        and x.dim() == 3
        and torch.is_grad_enabled()
        and not torch.is_autocast_enabled(x.device.type)
    )


def _fuse_pays(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether forming [B, out, in] per-sample gradients costs less than the two Gram
    matrices' B T^2 (in + out) multiply-adds: a pass over the product is about FUSE_PASS
    multiply-adds' time per element (an elementwise pass is memory-bound, a product is not),
    and it must fit `FUSED_MAX`."""
    b, t, fin = x.shape
    fout = w.shape[0]
    return b * fout * fin <= FUSED_MAX and t * t * (fin + fout) >= FUSE_PASS * fin * fout
