"""Element-level evidence: the elements that moved further than the optimizer can move them
(the per-element bound, factored second moments, isolated changes), and the bit flip that
explains each."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ckptforensics.core.tensors import bit_role, dtype_limits, flip_bit
from ckptforensics.engine.diff.chunks import Acc, Pair, f32
from ckptforensics.engine.diff.records import Candidate, DiffConfig
from ckptforensics.optim import bnb

__all__ = [
    "bound_check",
    "code_flips",
    "collect",
    "factored_floor",
    "isolated_chunk",
    "storage_eps",
]


def storage_eps(t: torch.Tensor) -> float:
    """The relative rounding of a stored moment's dtype beyond fp32's (0 for fp32 and wider)."""
    if not t.dtype.is_floating_point or t.dtype in (torch.float32, torch.float64):
        return 0.0
    return float(torch.finfo(t.dtype).eps)


def factored_floor(
    sa: dict[str, Any],
    sb: dict[str, Any],
    keys: tuple[str, ...],
    floor: float | None,
    restart_floor: float | None,
    acc: Acc,
    cands: list[Candidate],
    counts: dict[str, int],
    cfg: DiffConfig,
) -> None:
    """A family's second moments (`keys`, its `Family.second_moments`: Adafactor's rows,
    columns, vector variances) against their decay floor; with the counter reset, the share
    under the trainer's step delta's floor."""
    for key in keys:
        xa, xb = sa.get(key), sb.get(key)
        if (
            not isinstance(xa, torch.Tensor)
            or not isinstance(xb, torch.Tensor)
            or xa.shape != xb.shape
        ):
            continue
        va, vb = xa.reshape(-1).float(), xb.reshape(-1).float()
        if restart_floor is not None:
            acc.add(
                restart_low=torch.count_nonzero((vb < va * restart_floor) & (va > 0)),
                restart_n=torch.count_nonzero(va > 0),
            )
            continue
        assert floor is not None
        f = floor * (1 - 1e-6 * 8) * (1 - 2 * storage_eps(xb))
        low = vb < va * f
        acc.add(
            restart_low=torch.count_nonzero(low & (va > 0)), restart_n=torch.count_nonzero(va > 0)
        )
        if bool(low.any()):
            idx = torch.nonzero(low).flatten()
            collect(
                cands,
                counts,
                "vfloor",
                key,
                idx,
                va,
                vb,
                "at_least",
                va[idx] * f,
                0,
                tuple(xb.shape),
                xb.dtype,
                cfg,
            )


def bound_check(
    w: Pair,
    dmax: float | None,
    per_step: float,
    decay: float,
    ulp: float,
    lo: int,
    shape: tuple[int, ...],
    cands: list[Candidate],
    counts: dict[str, int],
    cfg: DiffConfig,
) -> None:
    """|dw| <= per_step + decay |w| (both over the window, slack included), plus one storage
    ulp each side; only elements past the weight-free part need the full bound, and a chunk
    whose max |dw| is under it (the fused kernel's, or torch's) is done without a pass."""
    if dmax is not None and dmax <= f32(per_step):
        return
    ad, fa, fb = w.ad, w.fa, w.fb
    coarse = ad > per_step
    if bool(coarse.any()):
        idx = torch.nonzero(coarse).flatten()
        wmax = torch.maximum(fa[idx].abs(), fb[idx].abs())
        bound = wmax * (decay + 2 * ulp) + per_step
        over = ad[idx] > bound
        collect(
            cands,
            counts,
            "bound",
            "weight",
            idx[over],
            fa,
            fb,
            "near",
            bound[over],
            lo,
            shape,
            w.wb.dtype,
            cfg,
        )


def isolated_chunk(
    w: Pair,
    dmax: float | None,
    ulp: float,
    bufs: tuple[torch.Tensor, torch.Tensor] | None,
    klr: float,
    lo: int,
    shape: tuple[int, ...],
    cands: list[Candidate],
    counts: dict[str, int],
    cfg: DiffConfig,
) -> None:
    """`_isolated` on a chunk that can hold such an element (decided from the fused
    kernel's sums where it ran: most chunks need no torch pass)."""
    if w.wa.numel() >= 64 and (dmax is None or w.maybe_outliers(dmax, ulp)):
        _isolated(w.fa, w.fb, w.ad, ulp, bufs, klr, lo, shape, w.wb.dtype, cands, counts, cfg)


def _isolated(
    fa: torch.Tensor,
    fb: torch.Tensor,
    ad: torch.Tensor,
    ulp: float,
    bufs: tuple[torch.Tensor, torch.Tensor] | None,
    klr: float,
    lo: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    cands: list[Candidate],
    counts: dict[str, int],
    cfg: DiffConfig,
) -> None:
    """No sharp bound to test against (weights only, Adafactor, SGD, LAMB's norm-wide bound,
    8-bit Adam's quantised state): an element counts when its change dwarfs the tensor's
    typical change *and* one stored bit flipped back brings it within the typical change
    (a weight merely shrinking to ~0 cannot be told from a legitimate update)."""
    if fa.numel() < 64:
        return
    fin = torch.isfinite(ad)
    scale = (
        torch.where(fin, ad, 0).mean() + ulp * torch.where(torch.isfinite(fa), fa.abs(), 0).mean()
    )
    flagged = ad > 16 * scale
    if bufs is not None:
        # SGD moves an element by lr times its momentum buffer each step: a large move its
        # buffers at both ends account for is training (tuning run sgd-healthy: a weight
        # tripled by a buffer of its size), not a flip.
        flagged &= ad > 16 * klr * torch.maximum(*bufs)
    n_flag = int(flagged.sum())
    if 0 < n_flag <= 256:
        idx = torch.nonzero(flagged).flatten()
        limits = (4 * scale).expand(n_flag)
        collect(
            cands,
            counts,
            "outlier",
            "weight",
            idx,
            fa,
            fb,
            "near",
            limits,
            lo,
            shape,
            dtype,
            cfg,
            only_flips=True,
        )


def code_flips(
    quant: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lo: int
) -> Callable[[int, float, Callable[[float], bool]], tuple[str, int | None, str | None]]:
    """The flip test of an 8-bit second moment's element: its stored code's bits."""
    codes, qmap, scale = quant
    flat = codes.reshape(-1)
    bs = bnb.blocksize(flat.numel(), scale.numel())

    def explain(
        i: int, before: float, ok: Callable[[float], bool]
    ) -> tuple[str, int | None, str | None]:
        j = lo + i
        return bnb.explain_code_flip(int(flat[j]), qmap, float(scale[j // bs]), before, ok)

    return explain


def _acceptable(mode: str, value: float, before: float, limit: float) -> bool:
    """Could Adam have produced `value`? 'near': within `limit` of the previous value
    (weights); 'at_least': at or above the v floor; 'abs_within': |m| <= C sqrt(v)."""
    if mode == "near":
        return abs(value - before) <= limit
    if mode == "at_least":
        return value >= limit
    return abs(value) <= limit


def collect(
    cands: list[Candidate],
    counts: dict[str, int],
    counter: str,
    where: str,
    idx: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    mode: str,
    limits: torch.Tensor,
    offset: int,
    shape: tuple[int, ...],
    stored: torch.dtype,
    cfg: DiffConfig,
    only_flips: bool = False,
    explain: Callable[[int, float, Callable[[float], bool]], tuple[str, int | None, str | None]]
    | None = None,
) -> None:
    """Count the elements at chunk positions `idx` and keep the first few as evidence.

    Each kept element is tested for a single stored-bit flip whose result Adam could
    have produced (`mode`, `limits` aligned with `idx`). With `only_flips`, an element
    counts only when such a flip explains it. `explain` (chunk position, before, ok) tests
    a stored form other than the value's own bits (an 8-bit code).
    """
    n = idx.numel()
    if n == 0:
        return
    if not only_flips:
        counts[counter] += n
    take = n if only_flips else max(cfg.max_candidates - len(cands), 0)
    for i, lim in zip(idx[:take].tolist(), limits[:take].tolist(), strict=True):
        bv, av = float(before[i]), float(after[i])
        ok = lambda v, bv=bv, lim=lim: _acceptable(mode, v, bv, lim)  # noqa: E731
        kind, bit, fld = (
            explain(i, bv, ok) if explain is not None else _explain_flip(av, bv, ok, stored)
        )
        if only_flips:
            if kind != "bit_flip":
                continue
            counts[counter] += 1
        if len(cands) >= cfg.max_candidates:
            continue
        cands.append(
            Candidate(
                where=where,
                index=_unravel(offset + i, shape),
                before=bv,
                after=av,
                bound=lim,
                kind=kind,
                bit=bit,
                bit_field=fld,
            )
        )


def _explain_flip(
    after: float, before: float, ok: Callable[[float], bool], dtype: torch.dtype
) -> tuple[str, int | None, str | None]:
    """Is `after` one stored bit away from a value Adam could have produced?

    Among the bits whose flip yields an acceptable value, prefer the one that
    restores the element's previous magnitude (tiny values admit several).
    """

    lim = dtype_limits(dtype)
    if lim is None:
        return "out_of_bound", None, None
    best: tuple[float, int] | None = None
    for bit in range(lim.bits):
        cand = flip_bit(after, bit, dtype)
        if not math.isfinite(cand) or not ok(cand):
            continue
        mag = abs(math.log2(abs(cand) + lim.tiny) - math.log2(abs(before) + lim.tiny))
        if best is None or mag < best[0]:
            best = (mag, bit)
    if best is None:
        return "out_of_bound", None, None
    return "bit_flip", best[1], bit_role(best[1], dtype)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return tuple(reversed(out))
