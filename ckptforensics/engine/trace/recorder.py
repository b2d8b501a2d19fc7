"""The trace of one forward pass: the functional norms, attention calls and two-tensor adds a
`TorchFunctionMode` sees, the order modules run in, and which modules behave as norms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ckptforensics.engine.replay.probes import attention_logit_stats, softmax_logit_stats

_NORM_FUNCS = tuple(
    f
    for f in (
        F.layer_norm,
        getattr(F, "rms_norm", None),
        F.group_norm,
        F.normalize,
        torch.layer_norm,
        getattr(torch, "rms_norm", None),
        torch.group_norm,
    )
    if f is not None
)
_ADD_FUNCS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
# The relative change of a norm's output when its (unit-RMS) input is scaled x10: its eps
# moves it by ~eps (1e-5 .. 1e-6); any non-normalising layer moves by O(1).
_SCALE_INVARIANT = 1e-3


@dataclass(slots=True)
class NormSite:
    """A normalisation seen in the pass: its input and output graph nodes, its parameters."""

    inp: Any
    out: Any
    params: list[torch.Tensor] = field(default_factory=list)
    module: str | None = None


@dataclass(slots=True)
class AttnSite:
    kind: str
    module: str
    heads: int
    qk: list[Any]  # graph nodes of the queries and keys (SDPA), or of the logits (softmax)
    out: Any  # graph node of the attention output (SDPA) or the probabilities (softmax)
    stats: torch.Tensor  # [H, 3] (`attention_logit_stats`)


class Recorder(TorchFunctionMode):
    """Records the functional norms, attention calls and two-tensor adds of one pass."""

    def __init__(self, trace: Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        t = self.trace
        if t.busy or not isinstance(out, torch.Tensor):
            return out
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1] if len(args) > 1 else kwargs["key"]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
            t.attention.append(
                AttnSite(
                    "sdpa",
                    t.running(),
                    int(q.shape[-3]),
                    [q.grad_fn, k.grad_fn],
                    out.grad_fn,
                    attention_logit_stats(q, k, mask, causal, scale),
                )
            )
        elif func in _SOFTMAX and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim in (-1, 3) and args[0].is_floating_point():
                t.attention.append(
                    AttnSite(
                        "softmax",
                        t.running(),
                        int(args[0].shape[1]),
                        [args[0].grad_fn],
                        out.grad_fn,
                        softmax_logit_stats(args[0]),
                    )
                )
        elif (
            func in _NORM_FUNCS
            and args
            and isinstance(args[0], torch.Tensor)
            and out.grad_fn is not None
        ):
            params = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, nn.Parameter)]
            t.add_norm(NormSite(args[0].grad_fn, out.grad_fn, params))
        elif func in _ADD_FUNCS and _same_shape_add(args, out):
            a, b = args[0].detach(), args[1].detach()
            t.adds[out.grad_fn] = (
                _rms(a),
                _rms(b),
                _rms(out.detach()),
                args[0].grad_fn,
                args[1].grad_fn,
            )
        return out


def _same_shape_add(args: tuple, out: torch.Tensor) -> bool:
    """Two float tensors of one shape added (a residual add is one): their RMS is recorded."""
    return (
        len(args) >= 2
        and all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args[:2])
        and out.grad_fn is not None
        and args[0].shape == args[1].shape == out.shape
    )


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.float()) / math.sqrt(max(x.numel(), 1))


class Trace:
    """Module calls and the recorder's sites of one forward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.busy = False  # re-running a module to test it: record nothing
        self.norms: dict[Any, NormSite] = {}  # output node -> site
        # Norms fused into the projection after them (Transformer Engine's LayerNormLinear,
        # an opaque kernel): output node -> site; the output is the projection's.
        self.fused: dict[Any, NormSite] = {}
        self.attention: list[AttnSite] = []
        self.adds: dict[Any, tuple[Any, ...]] = {}
        self.outputs: dict[Any, str] = {}  # output node -> innermost module that returned it
        self.handles: list[Any] = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
                self.handles.append(mod.register_forward_hook(self._post(name)))

    def running(self) -> str:
        return self.stack[-1] if self.stack else ""

    def add_norm(self, site: NormSite) -> None:
        old = self.norms.get(site.out)
        if old is not None:  # a norm module whose forward is a functional norm: one site
            old.params = old.params or site.params
            return
        self.norms[site.out] = site

    def _pre(self, name: str) -> Any:
        def hook(_m: nn.Module, _a: Any) -> None:
            if not self.busy:
                self.stack.append(name)

        return hook

    def _post(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if self.busy:
                return
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                self.outputs.setdefault(out.grad_fn, name)
            x = (
                args[0]
                if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], torch.Tensor)
                else None
            )
            if x is not None and _fused_candidate(mod, x, _first(out)):
                self._test_fused(name, mod, x, _first(out))
                return
            if (
                x is None
                or not isinstance(out, torch.Tensor)
                or out.grad_fn is None
                or not _norm_candidate(mod, x, out)
            ):
                return
            if _scale_invariant(self, mod, x):
                site = self.norms.get(out.grad_fn)
                params = [p for p in mod.parameters(recurse=False)]
                if site is None:
                    self.norms[out.grad_fn] = NormSite(x.grad_fn, out.grad_fn, params, name)
                else:
                    site.module, site.params, site.inp = name, params or site.params, x.grad_fn

        return hook

    def _test_fused(
        self, name: str, mod: nn.Module, x: torch.Tensor, out: torch.Tensor | None
    ) -> None:
        """A projection whose output does not change when its input is scaled normalises
        that input first: a norm fused into it, whatever its kernel."""
        if out is None or out.grad_fn is None or not _scale_invariant(self, mod, x):
            return
        # the norm's gain and shift; the projection's own `bias` is not the norm's
        params = [p for n, p in mod.named_parameters(recurse=False) if p.dim() == 1 and n != "bias"]
        self.fused[out.grad_fn] = NormSite(x.grad_fn, out.grad_fn, params, name)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _norm_candidate(mod: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
    """A leaf module mapping a float tensor to one of its shape, with at most 1-D parameters."""
    return (
        not any(True for _ in mod.children())
        and x.is_floating_point()
        and out.shape == x.shape
        and x.numel() > 0
        and all(p.dim() <= 1 for p in mod.parameters(recurse=False))
    )


def _first(out: Any) -> torch.Tensor | None:
    """A module's output tensor: itself, or the first of the (output, bias) pair Megatron's
    linear layers return."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out if isinstance(out, torch.Tensor) else None


def _fused_candidate(mod: nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> bool:
    """A leaf projection (a >= 2-D weight) that also holds a 1-D parameter other than its
    output bias, mapping each token's features to new ones: where a norm fused into a
    projection keeps its gain. Only the behaviour test (`_scale_invariant`) decides."""
    if out is None or any(True for _ in mod.children()) or not x.is_floating_point():
        return False
    own = list(mod.named_parameters(recurse=False))
    return (
        any(p.dim() >= 2 for _, p in own)
        and any(p.dim() == 1 and n != "bias" for n, p in own)
        and x.dim() >= 2
        and out.shape[:-1] == x.shape[:-1]
        and x.numel() > 0
    )


def _scale_invariant(trace: Trace, mod: nn.Module, x: torch.Tensor) -> bool:
    """Whether `mod` normalises: f(c x) = f(10 c x) with c x at unit RMS, and f is not
    constant (f(c x) != f(-c x))."""
    with torch.no_grad():
        xs = x.detach().float()
        r = float(_rms(xs))
        if not math.isfinite(r) or r == 0:
            return False
        xs = (xs / r).to(x.dtype)
        trace.busy = True
        try:
            a, b, c = (_first(mod(v)) for v in (xs, 10 * xs, -xs))
        except (
            Exception
        ):  # a module that cannot be called on its own input again: not a norm we can test
            return False
        finally:
            trace.busy = False
        if not all(isinstance(t, torch.Tensor) for t in (a, b, c)):
            return False
        a, b, c = a.float(), b.float(), c.float()
        size = float(torch.linalg.vector_norm(a)) or 1.0
        same = float(torch.linalg.vector_norm(a - b)) / size
        odd = float(torch.linalg.vector_norm(a - c)) / size
        return same < _SCALE_INVARIANT and odd > _SCALE_INVARIANT
