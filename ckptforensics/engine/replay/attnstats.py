"""The attention statistics the watch (`engine/replay/attention.py`) records: per head of an
attention call, its largest pre-softmax logit and its normalised attention entropy,
recomputed from q and k in fp32 piecewise (`_ATTN_CHUNK`), never held whole; a model's
layers of one shape measured together.
"""

from __future__ import annotations

import math

import torch

from ckptforensics.core import fused

__all__ = [
    "ATTN_STATS",
    "attention_logit_stats",
    "attention_logit_stats_many",
    "softmax_logit_stats",
]

# Per head of one attention call: its largest pre-softmax logit, and its attention entropy
# over each query row divided by log(keys the row may attend to), averaged over the rows
# with more than one key (1 = uniform, 0 = one-hot: Zhai et al. 2023's entropy collapse).
ATTN_STATS = ("max_logit", "entropy")

# Elements of logits one chunk of the attention statistics materialises (fp32: 16 MiB): the
# score matrix is recomputed piecewise, never held whole for a long sequence.
_ATTN_CHUNK = 1 << 22


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
# counted, the mask as an fp32 bias of 0 / -inf): made once (a few KiB each).
_Causal = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]
_CAUSAL: dict[tuple[int, int, int, torch.device], _Causal] = {}


def _causal(t0: int, t1: int, sk: int, device: torch.device) -> _Causal:
    """Rows t0:t1 of SDPA's top-left causal mask over `sk` keys, as `_accumulate` takes it."""
    key = (t0, t1, sk, torch.device(device))
    hit = _CAUSAL.get(key)
    if hit is None:
        valid = torch.ones(t1, sk, dtype=torch.bool, device=device).tril()[t0:t1]
        n = valid.sum(-1)
        use = n > 1
        w = torch.where(use, 1.0 / n.clamp_min(2).float().log(), 0.0)
        bias = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))
        hit = _CAUSAL[key] = (~valid, w, int(use.sum()), bias)
    return hit


def _causal_masked(s: torch.Tensor, causal: _Causal) -> tuple[torch.Tensor, torch.Tensor]:
    """(s with -inf where the causal mask forbids, its max over dims -4, -2, -1). fp32 on CPU:
    by adding the mask's bias (~9x faster than `masked_fill` there), the same unless a masked
    logit is NaN or +inf (the sum NaN): a NaN in the max (a host check, free on CPU) falls
    back to `masked_fill`, which sets those to -inf."""
    if s.device.type == "cpu" and s.dtype == torch.float32:
        added = s + causal[3]
        top = added.amax(dim=(-4, -2, -1))
        if not bool(top.isnan().any()):
            return added, top
    s = s.masked_fill(causal[0], float("-inf"))
    return s, s.amax(dim=(-4, -2, -1))


def _accumulate(
    s: torch.Tensor,
    valid: torch.Tensor | None,
    causal: _Causal | None = None,
    top: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., H, 3] = [max logit, sum of row entropy / log(keys), rows counted] of a block of
    logits s [..., b, H, t, S] (leading dims: attention calls batched together), reduced
    over b and t. Where a query may attend: `valid` (broadcastable to s) and / or `causal`
    (`_causal`: the mask, row weights and row count cached per shape, for when the causal
    mask is all there is). Rows with one key or none are not counted; a row whose logits
    hold a NaN counts entropy 0 (its max logit is NaN). With `top` (their max over dims
    -4, -2, -1), s has the causal mask added already (`_causal_grouped`)."""
    if causal is not None and valid is not None:
        valid = valid & ~causal[0]
        causal = None
    if top is not None:
        pass
    elif causal is not None:
        s, top = _causal_masked(s, causal)
    else:
        if valid is not None:
            s = s.masked_fill(~valid, float("-inf"))
        top = s.amax(dim=(-4, -2, -1))
    # Each row's entropy: -sum p log p with log p from log_softmax, by `nansum` (a masked
    # key's 0 * -inf is NaN: skipped, as entr(0) = 0; a row of -inf, nothing to attend,
    # or one holding a NaN is NaN throughout: 0). entr(softmax) takes a scalar log per
    # element on CPU: ~1.6x the time of the two vectorised softmaxes. Logits in half
    # precision (under autocast the recomputation runs in its dtype) keep entr(softmax),
    # where the two forms differ by that dtype's rounding, not fp32's.
    if s.dtype == torch.float32:
        ent = torch.softmax(s, -1).mul_(torch.log_softmax(s, -1)).nansum(-1).neg_()
    else:
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
    kg = torch.stack([_as4(x.detach()) for x in ks])
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    m4 = _as4(attn_mask.detach()) if attn_mask is not None else None
    causal = _causal(0, t, sk, q.device) if is_causal else None
    k: torch.Tensor | None = None
    step = max(1, _ATTN_CHUNK // (b * h * t * sk))
    parts = []
    for l0 in range(0, n, step):
        got = (
            _causal_grouped(q[l0 : l0 + step], kg[l0 : l0 + step], sc, causal)
            if causal is not None and m4 is None
            else None
        )
        if got is None:
            k = _heads(q, kg) if k is None else k
            s = torch.matmul(q[l0 : l0 + step].float(), k[l0 : l0 + step].float().transpose(-1, -2))
            s, valid = _masked(s * sc, m4)
            got = _accumulate(s, valid, causal)
        parts.append(got)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# Per (query rows, keys, query heads per key head, device): the causal mask's 0 / -inf bias
# repeated for each query head of a group, as `_causal_grouped`'s product lays out its rows.
_GROUPED: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}


def _causal_grouped(
    q: torch.Tensor, k: torch.Tensor, sc: float, causal: _Causal
) -> torch.Tensor | None:
    """[L, H, 3] of L causal calls without a mask, q [L, b, H, t, D] and k [L, b, Hk, S, D]
    fp32 on CPU (else None: the caller's general path): the query heads that share a key
    head stacked as rows of one product, [G t, D] x [D, S] per key head (no keys repeated),
    the scale and the mask's bias applied by the product itself (`baddbmm`). The statistics
    of those logits by the C kernel where there is one (`fused.Kernels.causal_attention`:
    one pass, a third of the time of `_accumulate`'s dozen ops at a replayed step's
    size), else in place by `_accumulate`: the same figures (the kernel's entropies within
    ~1e-7 relative on random logits, and nearer an fp64 computation than torch's fp32 where
    rows are near one-hot). None too where a masked logit is NaN or +inf (the bias makes it
    NaN: `masked_fill`'s path, which sets it to -inf)."""
    n, b, h, t, d = q.shape
    hk, sk = k.shape[2], k.shape[3]
    if (
        q.device.type != "cpu"
        or q.dtype != torch.float32
        or k.dtype != torch.float32
        or h % hk
        or torch.is_autocast_enabled("cpu")
    ):
        return None
    g = h // hk
    key = (t, sk, g, q.device)
    bias = _GROUPED.get(key)
    if bias is None:
        bias = _GROUPED[key] = causal[3].repeat(g, 1)
    s = torch.baddbmm(
        bias,
        q.reshape(n * b * hk, g * t, d),
        k.reshape(n * b * hk, sk, d).transpose(1, 2),
        alpha=sc,
    ).view(n, b, h, t, sk)
    kernels = fused.load()
    if kernels is not None:
        out = torch.empty(n, h, 3)
        done = kernels.causal_attention(s, causal[1], float(causal[2] * b), out)
        if done is not None:
            return out if done else None
    top = s.amax(dim=(-4, -2, -1))
    if bool(top.isnan().any()):
        return None
    return _accumulate(s, None, causal, top=top)


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
