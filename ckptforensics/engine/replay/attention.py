"""Attention watched where it is computed: every `scaled_dot_product_attention` call, and
every softmax over the last dim of a [B, H, T, S] tensor (eager attention), gives its heads'
largest pre-softmax logit and their attention entropy, kept on the device
(`AttentionWatch`; the module probe attributes them to the module that ran them). The
statistics themselves are `engine/replay/attnstats.py`'s.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ckptforensics.engine.replay import attnstats
from ckptforensics.engine.replay.attnstats import (
    ATTN_STATS,
    attention_logit_stats,
    attention_logit_stats_many,
    softmax_logit_stats,
)

__all__ = [
    "ATTN_STATS",
    "AttentionWatch",
    "Patched",
    "attention_logit_stats",
    "attention_logit_stats_many",
    "softmax_logit_stats",
]

_SOFTMAX = (
    torch.softmax,
    F.softmax,
    torch.Tensor.softmax,
    torch._C._nn.softmax if hasattr(torch._C._nn, "softmax") else torch.softmax,
)


_SDPA = F.scaled_dot_product_attention
_WATCHED = frozenset((_SDPA, *_SOFTMAX))
# Where models find the watched functions, as `Patched` wraps them: (owner, attribute).
_PATCHED = (
    (F, "scaled_dot_product_attention"),
    (F, "softmax"),
    (torch, "softmax"),
    (torch.Tensor, "softmax"),
)


class Patched:
    """The watched functions (`_PATCHED`) wrapped where models look them up, the cheap form
    of an `AttentionWatch`: while installed, a call from this thread with `active()` true is
    handed to `watch.record` (the outermost wrapper only: F.softmax calls Tensor.softmax),
    and nothing else pays a Python call (the torch-function mode pays one for every torch
    call it sees). A model that calls them by another name is not seen: `ModuleProbe`
    installs this on the mapping pass too, under the mode, and uses it alone only when every
    call the mode saw went through a wrapper (`watch.patch_ok`)."""

    def __init__(self, watch: AttentionWatch, active: Any) -> None:
        self.watch, self.active = watch, active
        self._saved: list[tuple[Any, str, Any]] = []
        self._thread = 0

    def _wrap(self, orig: Any) -> Any:
        watch, active = self.watch, self.active

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if watch.inside or threading.get_ident() != self._thread:
                return orig(*args, **kwargs)
            watch.inside += 1  # the measurement's own softmax is not watched either
            try:
                out = orig(*args, **kwargs)
                if active():
                    watch.record(orig, args, kwargs or {}, out)
            finally:
                watch.inside -= 1
            return out

        return wrapper

    def install(self) -> None:
        if self._saved:
            return
        self._thread = threading.get_ident()
        for owner, name in _PATCHED:
            orig = getattr(owner, name)
            self._saved.append((owner, name, orig))
            wrapper = self._wrap(orig)
            self.watch.unwrap[wrapper] = orig
            setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()
        self.watch.unwrap.clear()


def _softmax_input(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The logits of a softmax over the last dim of a 4-D tensor (eager attention), else None."""
    if func not in _SOFTMAX or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return x if x.dim() == 4 and dim in (-1, 3) and x.is_floating_point() else None


class AttentionWatch(TorchFunctionMode):
    """While active, each attention call's per-head statistics (`ATTN_STATS`) land in
    `rows` (one [H, 3] device tensor per call, in call order); `sites` holds what `on_call`
    returned for each. Nothing leaves the device; the caller reads `rows` once per pass,
    after `flush`.

    SDPA calls whose q or k autograd keeps for the backward pass (so nothing changes them
    in place) are measured at `flush`, those of one shape, mask and scale together
    (`attention_logit_stats_many`: one recomputation of the layers' logits instead of one
    per layer); at most `_ATTN_CHUNK` elements of q and k are held waiting, past that the
    watch flushes. Other calls are measured as they come.

    Entered around a forward pass only (a checkpointed block's recomputation in the backward
    pass is not watched: same values). Other torch functions pass straight through.
    """

    def __init__(self, on_call: Any = None) -> None:
        super().__init__()
        self.rows: list[torch.Tensor | None] = []  # None: waiting for `flush`
        self.on_call = on_call
        self.sites: list[Any] = []
        # (row, q, k, mask, is_causal, scale) of the calls waiting, and their q + k elements
        self._waiting: list[tuple[int, torch.Tensor, torch.Tensor, Any, bool, Any]] = []
        self._held = 0
        # `Patched`: how deep in its wrappers this thread is, and whether every call the
        # mode saw went through one (so that `Patched` alone sees them all)
        self.inside = 0
        self.patch_ok = True
        self.unwrap: dict[Any, Any] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        func = self.unwrap.get(func, func)  # `Patched`'s wrapper: the function it wraps
        if func in _WATCHED:  # every other torch call of the forward: straight through
            if self.inside == 0:
                self.patch_ok = False  # a call `Patched` did not see
            self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """One watched call's statistics (an SDPA call, or a softmax over the last dim of a
        4-D tensor; anything else is ignored)."""
        if func is _SDPA:
            q, k = args[0], args[1] if len(args) > 1 else kwargs["key"]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
                self._waiting.append((len(self.rows), q.detach(), k.detach(), mask, causal, scale))
                self.rows.append(None)
                self._held += q.numel() + k.numel()
                if self._held > attnstats._ATTN_CHUNK:
                    self.flush()
            else:
                self.rows.append(attention_logit_stats(q, k, mask, causal, scale))
            if self.on_call is not None:
                self.sites.append(self.on_call("sdpa", args, kwargs, out))
        elif (x := _softmax_input(func, args, kwargs)) is not None:
            self.rows.append(softmax_logit_stats(x))
            if self.on_call is not None:
                self.sites.append(self.on_call("softmax", args, kwargs, out))

    def flush(self) -> None:
        """The waiting calls' rows: calls alike (shapes, dtypes, device, the same mask,
        causality, scale) measured together."""
        alike: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor, Any, bool, Any]]] = {}
        for w in self._waiting:
            _, q, k, mask, causal, scale = w
            key = (q.shape, k.shape, q.dtype, k.dtype, q.device, id(mask), causal, scale)
            alike.setdefault(key, []).append(w)
        for calls in alike.values():
            _, _, _, mask, causal, scale = calls[0]
            table = attention_logit_stats_many(
                [c[1] for c in calls], [c[2] for c in calls], mask, causal, scale
            )
            for c, row in zip(calls, table.unbind(0), strict=True):
                self.rows[c[0]] = row
        self.clear_waiting()

    def clear_waiting(self) -> None:
        self._waiting.clear()
        self._held = 0
