"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module. Attention is
watched where it is computed: every `scaled_dot_product_attention` call, and every softmax
over the last dim of a [B, H, T, S] tensor (eager attention), gives its heads' largest
pre-softmax logit and their attention entropy (`AttentionWatch`), also on the device.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "FWD_STATS",
    "BWD_STATS",
    "ATTN_STATS",
    "PassStats",
    "ModuleProbe",
    "AttentionWatch",
    "attention_logit_stats",
    "attention_logit_stats_many",
    "softmax_logit_stats",
    "logits_of",
    "param_grad_stats",
    "param_grad_sums",
]

FWD_STATS = ("absmax", "rms", "nonfinite", "over_fp16", "over_bf16", "subnormal_share")
# nonfinite / over_* are 0/1 flags (any element), derived from the extrema.
BWD_STATS = ("grad_norm", "grad_absmax", "grad_nonfinite")

# Per head of one attention call: its largest pre-softmax logit, and its attention entropy
# over each query row divided by log(keys the row may attend to), averaged over the rows
# with more than one key (1 = uniform, 0 = one-hot: Zhai et al. 2023's entropy collapse).
ATTN_STATS = ("max_logit", "entropy")

_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# Elements of logits one chunk of the attention statistics materialises (fp32: 16 MiB): the
# score matrix is recomputed piecewise, never held whole for a long sequence.
_ATTN_CHUNK = 1 << 22


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


def logits_of(out: object) -> torch.Tensor | None:
    """The logits in a model's output: the tensor itself, `.logits` (transformers), the first
    tensor of a tuple (nanoGPT's `(logits, loss)`); None when there is none."""
    return _first_tensor(out)


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
    sub = (
        (((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / x.numel())
        if with_subnormal
        else absmax.new_zeros(())
    )
    return torch.stack(
        [absmax, rms, nonfinite, (absmax > _FP16_MAX).float(), (absmax > _BF16_MAX).float(), sub]
    )


# One hook call's measurement: (module row, elements, L2 norm, min, max, subnormal share or None).
_Norms = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _norms(
    x: torch.Tensor, subnormal: bool = True
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(elements, L2 norm in fp32, min, max, subnormal share) of a tensor in two reductions
    (both propagate NaN / inf; aminmax, not the inf-norm, which is ten times slower on CPU),
    on its device; the subnormal share only for fp16 / bf16 tensors."""
    n = x.numel()
    if n == 0:
        z = torch.zeros((), device=x.device)
        return 0, z, z, z, None
    l2 = torch.linalg.vector_norm(x, dtype=torch.float32)
    lo, hi = torch.aminmax(x)
    sub = (
        ((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / n
        if subnormal and x.dtype in (torch.float16, torch.bfloat16)
        else None
    )
    return n, l2, lo, hi, sub


def _rows(pending: list[_Norms], backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(module rows, their table rows) from the hooks' measurements, in a few ops over all
    of them: forward rows are `FWD_STATS` (`_stats`' figures), backward rows `BWD_STATS`
    (grad norm, max |g|, non-finite flag). A module measured twice keeps its last call."""
    last = {e[0]: k for k, e in enumerate(pending)}
    keep = [pending[k] for k in sorted(last.values())]
    idx = torch.tensor([e[0] for e in keep], dtype=torch.long)
    l2 = torch.stack([e[2] for e in keep])
    lo = torch.stack([e[3].float() for e in keep])
    hi = torch.stack([e[4].float() for e in keep])
    top = torch.maximum(-lo, hi)
    nonfinite = (~torch.isfinite(top)).float()
    if backward:
        return idx, torch.stack([l2, top, nonfinite], 1)
    root_n = torch.tensor([math.sqrt(max(e[1], 1)) for e in keep], device=l2.device)
    subs = [e[5] for e in keep]
    sub = (
        torch.stack([s if s is not None else top.new_zeros(()) for s in subs])
        if any(s is not None for s in subs)
        else torch.zeros_like(top)
    )
    rows = torch.stack(
        [top, l2 / root_n, nonfinite, (top > _FP16_MAX).float(), (top > _BF16_MAX).float(), sub], 1
    )
    return idx, rows


def _as4(t: torch.Tensor) -> torch.Tensor:
    """[..., T, D] -> [B, H, T, D] (SDPA takes any leading dims; heads are dim -3)."""
    if t.dim() == 4:
        return t
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape(-1, *t.shape[-3:])


def _chunks(b: int, h: int, t: int, s: int) -> list[tuple[int, int, int, int]]:
    """(b0, b1, t0, t1) blocks of at most `_ATTN_CHUNK` logits, whole rows first."""
    per_row = max(h * t * s, 1)
    if per_row <= _ATTN_CHUNK:
        step = max(1, _ATTN_CHUNK // per_row)
        return [(b0, min(b, b0 + step), 0, t) for b0 in range(0, b, step)]
    tq = max(1, _ATTN_CHUNK // max(h * s, 1))
    return [(b0, b0 + 1, t0, min(t, t0 + tq)) for b0 in range(b) for t0 in range(0, t, tq)]


# Per causal block shape (query rows t0:t1, keys, device): (where a query may NOT attend
# [t, S], each row's weight 1 / log(keys) or 0 where it has one key or none [t], rows
# counted): the same for every attention call of a shape, so made once (a few KiB each).
_CAUSAL: dict[tuple[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor, int]] = {}


def _causal(
    t0: int, t1: int, sk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows t0:t1 of SDPA's top-left causal mask over `sk` keys, as `_accumulate` takes it."""
    key = (t0, t1, sk, torch.device(device))
    hit = _CAUSAL.get(key)
    if hit is None:
        valid = torch.ones(t1, sk, dtype=torch.bool, device=device).tril()[t0:t1]
        n = valid.sum(-1)
        use = n > 1
        w = torch.where(use, 1.0 / n.clamp_min(2).float().log(), 0.0)
        hit = _CAUSAL[key] = (~valid, w, int(use.sum()))
    return hit


def _accumulate(
    s: torch.Tensor,
    valid: torch.Tensor | None,
    causal: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """[..., H, 3] = [max logit, sum of row entropy / log(keys), rows counted] of a block of
    logits s [..., b, H, t, S] (leading dims: attention calls batched together), reduced
    over b and t. Where a query may attend: `valid` (broadcastable to s) and / or `causal`
    (`_causal`: the mask, row weights and row count cached per shape, for when the causal
    mask is all there is). Rows with one key or none are not counted; a row whose logits
    hold a NaN counts entropy 0 (its max logit is NaN)."""
    if causal is not None and valid is not None:
        valid = valid & ~causal[0]
        causal = None
    if causal is not None:
        s = s.masked_fill(causal[0], float("-inf"))
    elif valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    top = s.amax(dim=(-4, -2, -1))
    # Each row's entropy: entr(p) = -p log p, 0 where p is (masked keys); a row of -inf
    # (nothing to attend) or one holding a NaN sums to NaN: 0.
    ent = torch.special.entr(torch.softmax(s, -1)).sum(-1).nan_to_num_(0.0, 0.0, 0.0)
    if causal is not None:
        ents = (ent * causal[1]).sum((-3, -1))
        n = torch.full_like(top, float(causal[2] * s.shape[-4]))
    else:
        keys = (
            valid.sum(-1).expand_as(ent)
            if valid is not None
            else torch.full_like(ent, float(s.shape[-1]))
        )
        use = keys > 1
        ents = torch.where(use, ent / keys.clamp_min(2).float().log(), 0.0).sum((-3, -1))
        n = use.sum((-3, -1)).float()
    return torch.stack([top, ents, n], -1)


def _heads(q4: torch.Tensor, k4: torch.Tensor) -> torch.Tensor:
    """Keys repeated for each query head they serve (GQA), as SDPA's `enable_gqa` does
    (heads are dim -3)."""
    h, hk = q4.shape[-3], k4.shape[-3]
    return k4 if hk == h else k4.repeat_interleave(h // hk, dim=-3)


def _masked(s: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, where a query may attend) under an SDPA mask: a boolean one marks where, a
    float one is added (entries at the dtype's lowest count as masked)."""
    if m is None:
        return s, None
    if m.dtype == torch.bool:
        return s, m
    return s + m.float(), m > torch.finfo(m.dtype).min / 2


def attention_logit_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """[H, 3] per query head of one `scaled_dot_product_attention` call: [max pre-softmax
    logit, summed normalised entropy, rows summed], on q's device, no host sync.

    The logits q k^T * scale (+ the mask) are recomputed in fp32, in blocks of at most
    `_ATTN_CHUNK` elements; keys shared by a group of query heads (GQA) are repeated as SDPA's
    `enable_gqa` does. `is_causal` is SDPA's top-left causal mask; a boolean mask marks where
    a query may attend, a float one is added (entries at the dtype's lowest count as masked).
    """
    q4, k4 = _as4(q.detach()), _as4(k.detach())
    b, h, t, d = q4.shape
    sk = k4.shape[2]
    k4 = _heads(q4, k4)
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    m4 = _as4(attn_mask.detach()) if attn_mask is not None else None
    parts = []
    for b0, b1, t0, t1 in _chunks(b, h, t, sk):
        s = torch.matmul(q4[b0:b1, :, t0:t1].float(), k4[b0:b1].float().transpose(-1, -2)) * sc
        m = None
        if m4 is not None:
            m = m4[b0:b1] if m4.shape[0] == b else m4
            m = m[..., t0:t1, :] if m.shape[-2] == t else m
        s, valid = _masked(s, m)
        parts.append(_accumulate(s, valid, _causal(t0, t1, sk, q.device) if is_causal else None))
    if len(parts) == 1:
        return parts[0]
    every = torch.stack(parts)
    return torch.stack([every[..., 0].amax(0), every[..., 1].sum(0), every[..., 2].sum(0)], -1)


def attention_logit_stats_many(
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """[L, H, 3]: `attention_logit_stats` of L attention calls of one shape that share their
    mask, causality and scale (a model's layers), in one recomputation of their logits per
    `_ATTN_CHUNK` elements instead of one per call (a call larger than that: one at a time)."""
    q = torch.stack([_as4(x.detach()) for x in qs])  # [L, b, H, t, D]
    n, b, h, t, d = q.shape
    sk = _as4(ks[0]).shape[2]
    if b * h * t * sk > _ATTN_CHUNK:
        return torch.stack(
            [
                attention_logit_stats(x, y, attn_mask, is_causal, scale)
                for x, y in zip(qs, ks, strict=True)
            ]
        )
    k = _heads(q, torch.stack([_as4(x.detach()) for x in ks]))
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    m4 = _as4(attn_mask.detach()) if attn_mask is not None else None
    causal = _causal(0, t, sk, q.device) if is_causal else None
    step = max(1, _ATTN_CHUNK // (b * h * t * sk))
    parts = []
    for l0 in range(0, n, step):
        s = torch.matmul(q[l0 : l0 + step].float(), k[l0 : l0 + step].float().transpose(-1, -2))
        s, valid = _masked(s * sc, m4)
        parts.append(_accumulate(s, valid, causal))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def softmax_logit_stats(x: torch.Tensor) -> torch.Tensor:
    """`attention_logit_stats` for eager attention: x [B, H, T, S] are the logits a softmax
    over the last dim receives, the mask already added (masked entries at the dtype's lowest
    value or -inf)."""
    x4 = _as4(x.detach())
    b, h, t, sk = x4.shape
    low = torch.finfo(x.dtype).min / 2
    parts = []
    for b0, b1, t0, t1 in _chunks(b, h, t, sk):
        blk = x4[b0:b1, :, t0:t1].float()
        parts.append(_accumulate(blk, blk > low))
    if len(parts) == 1:
        return parts[0]
    every = torch.stack(parts)
    return torch.stack([every[..., 0].amax(0), every[..., 1].sum(0), every[..., 2].sum(0)], -1)


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
                if self._held > _ATTN_CHUNK:
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


class ModuleProbe:
    """Forward hooks on every named module, a gradient hook on each output, and an
    `AttentionWatch` (its attention calls' logit statistics, attributed to the module that
    ran them on the first pass, which watches the whole forward; later passes watch only
    the modules that ran attention, and map again if the count of calls changes). Where
    every call of the first pass went through `Patched`'s wrappers of the attention
    functions, later passes are watched by those alone, with no torch-function mode (which
    costs a Python call for every torch call of the attention modules)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str = "cpu",
        ranks: Any = None,
        attention: bool = True,
    ) -> None:
        self.model = model
        self.names = tuple(n for n, _ in model.named_modules() if n)
        self.index = {n: i for i, n in enumerate(self.names)}
        m = len(self.names)
        self.device = device
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
        # What the hooks measured, written to the tables at `collect` (`_flush`): a few
        # device scalars per call, so a hook costs two reductions, not a dozen small ops.
        self._pending_fwd: list[_Norms] = []
        self._pending_bwd: list[_Norms] = []
        # With activation checkpointing a block's modules run again in the backward pass:
        # only their first call in a pass is recorded.
        self.once = False
        self._ran: set[int] = set()
        self.enabled = True
        self._handles = [
            mod.register_forward_hook(self._forward(self.index[n]))
            for n, mod in model.named_modules()
            if n
        ]
        # Attention and output logits: the watch is entered by the model's own forward
        # pre-hook and left by its forward hook (also when the forward raises).
        self.watch = AttentionWatch(self._site) if attention else None
        self.attn_modules: tuple[str, ...] | None = None  # settled on the first watched pass
        self.head: str | None = None
        self._mapping = False  # the first pass: record output shapes and the running module
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._stack: list[str] = []
        self._stack_handles: list[Any] = []
        self._watching = False
        # Once the first pass has mapped which modules run attention, the watch (a torch
        # function mode: a Python call for every torch call it sees) is entered around
        # those modules only, not the whole forward; the whole forward is watched on a
        # mapping pass, or when an attention call ran outside every named module.
        self._whole = False
        self._scope: frozenset[str] = frozenset()
        self._scope_handles: list[Any] = []
        self._depth = 0
        # After a mapping pass on which every attention call went through `Patched`'s
        # wrappers, the scoped passes use those alone (no torch-function mode at all).
        self._patch_only = False
        self._patched = (
            Patched(self.watch, lambda: self._patch_only and self._depth > 0)
            if self.watch is not None
            else None
        )
        self._logits = torch.full((2,), float("nan"), device=device)  # [sum of logits, count]
        if self.watch is not None:
            self._handles.append(model.register_forward_pre_hook(self._enter))
            self._handles.append(model.register_forward_hook(self._leave, always_call=True))

    def _site(self, kind: str, args: tuple, kwargs: dict, out: Any) -> str:
        """The module running an attention call (on the mapping pass; else unused)."""
        return self._stack[-1] if self._stack else ""

    def _enter(self, module: nn.Module, args: object) -> None:
        if not self.enabled or self.watch is None or self._watching:
            return
        self._mapping = self.attn_modules is None
        if self._mapping:
            # Which module runs each attention call: a stack of running modules, kept only
            # on this first pass (its pre-hooks cost a call per module).
            for n, mod in self.model.named_modules():
                if n:
                    self._stack_handles.append(
                        mod.register_forward_pre_hook(lambda _m, _a, n=n: self._stack.append(n))
                    )
        self.watch.rows.clear()
        self.watch.sites.clear()
        self._watching = True
        self._whole = self._mapping or not self._scoped()
        if self._mapping:
            self._patch_only = False
            self.watch.patch_ok = True
        if self._patched is not None and (self._mapping or (self._patch_only and not self._whole)):
            self._patched.install()
        if self._whole:
            self.watch.__enter__()

    def _scoped(self) -> bool:
        """Whether this pass watches the mapped attention modules only (hooks on them
        installed as needed)."""
        mods = self.attn_modules or ()
        if "" in mods:
            return False
        scope = frozenset(mods)
        if scope != self._scope:
            for h in self._scope_handles:
                h.remove()
            self._scope_handles.clear()
            for n, mod in self.model.named_modules():
                if n in scope:
                    self._scope_handles.append(mod.register_forward_pre_hook(self._scope_in))
                    self._scope_handles.append(
                        mod.register_forward_hook(self._scope_out, always_call=True)
                    )
            self._scope = scope
        return True

    def _scope_in(self, module: nn.Module, args: object) -> None:
        if self._watching and not self._whole and self.watch is not None:
            if self._depth == 0 and not self._patch_only:
                self.watch.__enter__()
            self._depth += 1

    def _scope_out(self, module: nn.Module, args: object, out: object) -> None:
        if self._depth > 0 and self.watch is not None:
            self._depth -= 1
            if self._depth == 0 and not self._patch_only:
                self.watch.__exit__(None, None, None)

    def _leave(self, module: nn.Module, args: object, out: object) -> None:
        if not self._watching or self.watch is None:
            return
        if self._whole or (self._depth > 0 and not self._patch_only):
            self.watch.__exit__(None, None, None)
        if self._patched is not None:
            self._patched.uninstall()
        self.watch.flush()
        self._depth = 0
        self._whole = False
        self._watching = False
        logits = logits_of(out)
        if logits is not None and logits.is_floating_point():
            lg = logits.detach()
            self._logits = torch.stack(
                [lg.float().sum(), lg.new_tensor(float(lg.numel()), dtype=torch.float32)]
            )
        if self._mapping:
            for h in self._stack_handles:
                h.remove()
            self._stack_handles.clear()
            self._stack.clear()
            self.attn_modules = tuple(self.watch.sites)
            # every call went through `Patched`: later passes need no torch-function mode
            self._patch_only = self.watch.patch_ok
            if logits is not None:
                shape = tuple(logits.shape)
                self.head = next(
                    (
                        self.names[i]
                        for i in reversed(self.fwd_order)
                        if self._shapes.get(i) == shape
                    ),
                    None,
                )
            self._mapping = False
        elif self.attn_modules is not None and len(self.watch.rows) != len(self.attn_modules):
            self.attn_modules = None  # a different call pattern: map again on the next pass

    def _forward(self, i: int):  # noqa: ANN202 - hook factory
        def hook(module: nn.Module, args: object, out: object) -> None:
            if self._stack and self._mapping:
                self._stack.pop()
            if not self.enabled:
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                return
            if self._mapping:
                self._shapes[i] = tuple(t.shape)
            self._pending_fwd.append((i, *_norms(t.detach())))
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
            self._pending_bwd.append((i, *_norms(g.detach(), subnormal=False)))
            self.bwd_order.append(i)

        return hook

    def reset(self) -> None:
        self.fwd.fill_(float("nan"))
        self.bwd.fill_(float("nan"))
        self._pending_fwd.clear()
        self._pending_bwd.clear()
        if self.count is not None:
            self.count.zero_()
        self.shared.clear()
        self._ran.clear()
        self.fwd_order.clear()
        self.bwd_order.clear()
        if self.watch is not None:
            self.watch.rows.clear()
            self.watch.clear_waiting()
        self._logits = torch.full((2,), float("nan"), device=self.device)

    def _flush(self) -> None:
        """The hooks' pending measurements into the tables (`_rows`); a module that ran
        more than once in the pass keeps its last call's row, as each call overwrote it."""
        if self._pending_fwd:
            idx, rows = _rows(self._pending_fwd, backward=False)
            self.fwd[idx.to(self.fwd.device)] = rows.to(self.fwd.device)
            self._pending_fwd.clear()
        if self._pending_bwd:
            idx, rows = _rows(self._pending_bwd, backward=True)
            self.bwd[idx.to(self.bwd.device)] = rows.to(self.bwd.device)
            self._pending_bwd.clear()

    def _attn_table(self) -> torch.Tensor:
        """[L, Hmax, 3] of the pass's attention calls (NaN past a call's heads)."""
        if self.watch is not None:
            self.watch.flush()
        rows = [r for r in self.watch.rows if r is not None] if self.watch is not None else []
        if not rows:
            return torch.zeros(0, 0, 3, device=self.device)
        hmax = max(r.shape[0] for r in rows)
        if all(r.shape[0] == hmax for r in rows):
            return torch.stack(rows)
        table = torch.full((len(rows), hmax, 3), float("nan"), device=rows[0].device)
        for i, r in enumerate(rows):
            table[i, : r.shape[0]] = r
        return table

    def collect(self) -> PassStats:
        """The pass's tables, read to the host in one transfer (under torchrun, every rank's
        tables merged after one collective)."""
        self._flush()
        attn = self._attn_table()
        fwd, bwd, attn, logits = (
            (self.fwd, self.bwd, attn, self._logits) if self.ranks is None else self._merged(attn)
        )
        flat = torch.cat(
            [
                fwd.reshape(-1).float(),
                bwd.reshape(-1).float(),
                attn.reshape(-1).float().to(fwd.device),
                logits.float().to(fwd.device),
            ]
        ).cpu()
        nf, nb, na = fwd.numel(), bwd.numel(), attn.numel()
        a = flat[nf + nb : nf + nb + na].reshape(attn.shape)
        # per head: max logit, mean normalised entropy over the rows counted
        heads = (
            torch.stack(
                [
                    a[..., 0],
                    a[..., 1] / a[..., 2].clamp_min(1).where(a[..., 2] > 0, torch.tensor(math.nan)),
                ],
                -1,
            )
            if na
            else None
        )
        s, n = flat[-2:].tolist()
        mods = (
            self.attn_modules
            if self.attn_modules is not None
            and heads is not None
            and len(self.attn_modules) == heads.shape[0]
            else ()
        )
        return PassStats(
            self.names,
            flat[:nf].reshape(fwd.shape).clone(),
            flat[nf : nf + nb].reshape(bwd.shape).clone(),
            tuple(self.fwd_order),
            tuple(self.bwd_order),
            attn_modules=tuple(mods),
            attn=heads,
            head=self.head,
            logit_mean=s / n if n > 0 else math.nan,
        )

    def _merged(
        self, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole batch's statistics from every rank's share of its rows: one gather of
        [fwd | bwd | count | shared flag] per module, the attention table and the logit sums.
        Extremes and flags take the maximum, RMS and the subnormal share the element-weighted
        mean, gradient norms the root sum of squares, attention entropy and logit sums add."""
        assert self.count is not None
        nf, nb = len(FWD_STATS), len(BWD_STATS)
        flags = torch.zeros_like(self.count)
        flags[list(self.shared)] = 1.0
        table = torch.cat([self.fwd, self.bwd, self.count, flags], 1).double()
        m = table.numel()
        flat = torch.cat(
            [
                table.reshape(-1),
                attn.reshape(-1).double().to(table.device),
                self._logits.double().to(table.device),
            ]
        )
        gathered = self.ranks.gather(flat).reshape(-1, flat.numel())  # [W, m + attn + 2]
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
        shared = (
            torch.nonzero(every[..., nf + nb + 1].amin(0) > 0).flatten().tolist()
        )  # shared on every rank
        if shared:
            grads = [self.shared[i] for i in shared]
            total = self.ranks.sum(torch.cat([g.reshape(-1) for g in grads]))
            for i, g in zip(shared, total.split([g.numel() for g in grads]), strict=True):
                st = _stats(g, with_subnormal=False).double()
                bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
        att = att_r[0].clone() if att_r.shape[0] else attn.double()
        if att.numel():
            att[..., 0] = att_r[..., 0].amax(0)
            att[..., 1:] = att_r[..., 1:].nansum(0)
        logits = logit_r.nansum(0)
        return fwd.float(), bwd.float(), att.float(), logits.float()

    def remove(self) -> None:
        if (
            self._watching
            and self.watch is not None
            and (self._whole or (self._depth > 0 and not self._patch_only))
        ):
            self.watch.__exit__(None, None, None)
        if self._patched is not None:
            self._patched.uninstall()
        self._watching, self._whole, self._depth = False, False, 0
        for h in self._handles + self._stack_handles + self._scope_handles:
            h.remove()
        self._handles.clear()
        self._stack_handles.clear()
        self._scope_handles.clear()
        self._scope = frozenset()


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
    r = g2.div_(
        v.float().add(eps * eps / c)
    )  # g2 is our own temporary; r = c g^2 / (v_hat + eps^2)
    return torch.stack([total, r.sum() / c, (r > 5000).sum().float()])


# Elements of gradient one `param_grad_table` chunk converts to fp32 temporaries at a time
# (two of them: 512 MiB), so the foreach pass never holds a second copy of every gradient.
_PARAM_CHUNK = 1 << 26


def param_grad_table(
    grads: list[torch.Tensor], states: list[dict], groups: list[dict], sums: bool = False
) -> torch.Tensor:
    """`param_grad_stats` of every parameter at once, and whether its gradient is finite:
    [P, 4] = [RMS(g), RMS_t, SPAM spike count, finite (1 / 0)] on the gradients' device
    (`sums`: `param_grad_sums`' [sum g^2, sum g^2 / v_hat, spikes] instead of the first
    three, for ranks to add up). The same figures as one call per parameter, within float
    rounding, in a dozen `torch._foreach_*` ops over chunks of the parameters instead of a
    dozen ops per parameter; one host read screens for the rare gradient that holds a
    NaN or an overflow, whose parameters are then counted one by one.
    """
    if not grads:
        return torch.zeros(0, 4)
    dev = grads[0].device
    g = [x.detach() for x in grads]
    g = [x.to_local() if hasattr(x, "to_local") else x for x in g]
    adam: dict[int, tuple[torch.Tensor, float, float]] = {}  # index -> (v, eps^2 / c, c)
    for k, (st, grp) in enumerate(zip(states, groups, strict=True)):
        v = st.get("exp_avg_sq")
        if v is None or float(st.get("step", 0)) <= 0 or "betas" not in grp:
            continue
        v = v.to_local() if hasattr(v, "to_local") else v
        c = 1.0 / (1 - grp["betas"][1] ** float(st["step"]))
        adam[k] = (v, grp["eps"] * grp["eps"] / c, c)
    # [sum g^2, sum g^2 / v_hat, spikes] per parameter: NaN / 0 without Adam state, zeros
    # for an empty gradient; filled a chunk of parameters at a time.
    table = torch.zeros(len(g), 4, device=dev)
    table[:, 1] = math.nan
    table[list(adam), 1] = 0.0
    plain = [k for k in range(len(g)) if k not in adam and g[k].numel()]
    for part in _chunked(plain, g):
        gf = [g[k].float() for k in part]
        table[part, 0] = torch.stack(torch._foreach_norm(torch._foreach_mul(gf, gf), 1))
    for part in _chunked([k for k in adam if g[k].numel()], g):
        gf = [g[k].float() for k in part]
        g2 = torch._foreach_mul(gf, gf)
        sq = torch._foreach_norm(g2, 1)
        denom = torch._foreach_add([adam[k][0].float() for k in part], [adam[k][1] for k in part])
        torch._foreach_div_(g2, denom)  # r = c g^2 / (v_hat + eps^2)
        rs = torch._foreach_norm(g2, 1)
        # Spikes: sign(max(r - 5000, 0)) is 1 where r > 5000, else 0 (r - 5000 is exact
        # near 5000), NaN where r is: such a count is redone below.
        torch._foreach_sub_(g2, 5000.0)
        torch._foreach_clamp_min_(g2, 0.0)
        torch._foreach_sign_(g2)
        count = torch._foreach_norm(g2, 1)
        cs = torch.tensor([adam[k][2] for k in part], device=dev)
        table[part, :3] = torch.stack(
            [torch.stack(sq), torch.stack(rs) / cs, torch.stack(count)], 1
        )
    # One read: a NaN spike count (an element of r is NaN) is counted again, and a sum of
    # g^2 that is not finite (a non-finite element, or a finite one whose square
    # overflows) is checked element by element; every other gradient is finite.
    table[:, 3] = 1.0
    screen = table[:, [2, 0]].cpu().tolist()
    for k, (count, total) in enumerate(screen):
        if math.isnan(count):
            table[k, 2] = param_grad_sums(g[k], states[k], groups[k])[2]
        if not math.isfinite(total):
            table[k, 3] = torch.isfinite(g[k]).all().float()
    if not sums:
        n = torch.tensor([float(max(x.numel(), 1)) for x in g], device=dev)
        table[:, 0] = (table[:, 0] / n).sqrt()
        table[:, 1] = (table[:, 1] / n).sqrt()
    return table


def _chunked(ks: list[int], g: list[torch.Tensor]) -> list[list[int]]:
    """`ks` in runs of at most `_PARAM_CHUNK` elements of gradient (a larger one alone)."""
    out: list[list[int]] = []
    size = 0
    for k in ks:
        if not out or size + g[k].numel() > _PARAM_CHUNK:
            out.append([])
            size = 0
        out[-1].append(k)
        size += g[k].numel()
    return out
