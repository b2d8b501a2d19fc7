"""Streaming one tensor pair in flat chunks: the staging buffers, the pair and its moments as
chunked views, the running sums (`Acc`), and each chunk's statistics (fused kernels or torch
ops)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ckptforensics.core import fused
from ckptforensics.engine.diff.records import DiffConfig
from ckptforensics.formats import integrity
from ckptforensics.formats.base import Checkpoint

__all__ = [
    "Acc",
    "Moments",
    "Pair",
    "Staging",
    "flat_chunks",
    "f32",
    "load_kernels",
    "moment_stats_fused",
    "moment_stats_torch",
    "prefetch",
    "release_all",
    "sqrt32",
    "weight_stats",
]


def flat_chunks(t: torch.Tensor, size: int) -> Iterator[tuple[int, torch.Tensor]]:
    flat = t.reshape(-1)
    for lo in range(0, flat.numel(), size):
        yield lo, flat[lo : lo + size]


class Acc:
    """Running sums/maxima of one tensor, combined across chunks in fp64 on the host.

    Values are tensors (read back together: one host sync per call) or numbers."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add(self, **kv: torch.Tensor | float) -> None:
        for k, v in _host(kv).items():
            self.sums[k] = self.sums.get(k, 0.0) + v

    def max(self, **kv: torch.Tensor | float) -> None:
        for k, v in _host(kv).items():
            self.maxes[k] = max(self.maxes.get(k, -math.inf), v)


def _host(kv: dict[str, torch.Tensor | float]) -> dict[str, float]:
    keys = [k for k, v in kv.items() if isinstance(v, torch.Tensor)]
    out = {k: float(v) for k, v in kv.items() if not isinstance(v, torch.Tensor)}
    if keys:
        vals = torch.stack([kv[k].to(torch.float64) for k in keys]).tolist()  # type: ignore[union-attr]
        out.update(zip(keys, vals, strict=True))
    return out


def f32(x: float) -> float:
    """A Python scalar as torch rounds it to compare it with an fp32 tensor."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def load_kernels(cfg: DiffConfig) -> fused.Kernels | None:
    """The fused kernels a diff under `cfg` uses (None: torch ops). Called once before
    worker processes fork, they inherit the loaded library rather than each build it."""
    return fused.load() if cfg.fused and torch.device(cfg.device).type == "cpu" else None


class Staging:
    """Chunks on their way to the statistics' device: read on the host into a pinned
    buffer (one per stream), copied to the device without blocking the host; a buffer
    is refilled only once the device has its previous contents. On the CPU, the chunk."""

    def __init__(self, device: str | torch.device, *, always: bool = False) -> None:
        self.device = torch.device(device)
        self.active = always or self.device.type != "cpu"
        self._pin = self.device.type == "cuda"
        self._bufs: dict[int, torch.Tensor] = {}
        self._done: dict[int, Any] = {}

    def __call__(self, t: torch.Tensor, slot: int) -> torch.Tensor:
        if not self.active:
            return t
        n = t.numel()
        buf = self._bufs.get(slot)
        if buf is None or buf.dtype != t.dtype or buf.numel() < n:
            buf = torch.empty(max(n, 1), dtype=t.dtype, pin_memory=self._pin)
            self._bufs[slot] = buf
        elif slot in self._done:
            self._done.pop(slot).synchronize()
        host = buf[:n]
        host.copy_(t.reshape(-1))  # the read: file pages (or page cache) -> staging buffer
        out = host.to(self.device, non_blocking=self._pin)
        if self._pin:
            ev = torch.cuda.Event()
            ev.record()
            self._done[slot] = ev
        elif out.data_ptr() == host.data_ptr():
            out = out.clone()  # the buffer is refilled with the next chunk
        return out


class Pair:
    """One chunk of a weight pair; its fp32 views on the statistics' device, made when
    first asked for (the fused kernel reads the stored values directly)."""

    def __init__(self, wa: torch.Tensor, wb: torch.Tensor, stage: Staging) -> None:
        self.wa, self.wb, self._stage = wa, wb, stage
        self.sums: tuple[float, float] | None = None  # fp64 sum |dw|, sum |w_A| (fused kernel)

    @cached_property
    def fa(self) -> torch.Tensor:
        return self._stage(self.wa, 0).float()

    @cached_property
    def fb(self) -> torch.Tensor:
        return self._stage(self.wb, 1).float()

    @cached_property
    def d(self) -> torch.Tensor:
        return self.fb - self.fa

    @cached_property
    def ad(self) -> torch.Tensor:
        return self.d.abs()

    def maybe_outliers(self, dmax: float, eps: float) -> bool:
        """Could an element pass the outlier test |dw| > 16 (mean |dw| + eps mean |w_A|)?
        Decided from the fused sums with a margin (1e-4) far above the fp32 rounding of
        the torch means the test itself uses; False only when no element can."""
        if self.sums is None:
            return True
        n = self.wa.numel()
        scale = self.sums[0] / n + eps * self.sums[1] / n
        return dmax > 16 * scale * (1 - 1e-4)


class Moments:
    """One chunk of Adam's moments (m_A, m_B, v_A, v_B) as stored; their fp32 views on the
    statistics' device when first asked for."""

    def __init__(self, raw: list[torch.Tensor], stage: Staging) -> None:
        self.raw, self._stage = raw, stage

    def _get(self, i: int) -> torch.Tensor:
        return self._stage(self.raw[i], 2 + i).float()

    ma = cached_property(lambda self: self._get(0))
    mb = cached_property(lambda self: self._get(1))
    va = cached_property(lambda self: self._get(2))
    vb = cached_property(lambda self: self._get(3))


def weight_stats(w: Pair, kern: fused.Kernels | None, acc: Acc) -> float | None:
    """||w_A||^2, ||dw||^2, max |dw|, max |w_B| and the non-finite counts of one chunk;
    returns max |dw| when every dw is finite (the bound checks start from it)."""
    ws = kern.weights(w.wa, w.wb) if kern is not None else None
    if ws is not None and math.isfinite(ws.sum_a2) and math.isfinite(ws.sum_d2):
        # fp64 sums of squares of fp32 values cannot overflow: finite sums mean finite data.
        acc.add(wa2=ws.sum_a2, d2=ws.sum_d2)
        acc.max(dmax=ws.max_abs_d, bmax=ws.max_abs_b)
        w.sums = (ws.sum_abs_d, ws.sum_abs_a)
        return ws.max_abs_d
    fa, fb, d, ad = w.fa, w.fb, w.d, w.ad
    # Fast path: plain sums and extrema; any NaN/inf shows in them, and only then is
    # the chunk recomputed with masks (non-finite values are rare, and data).
    bmin, bmax = torch.aminmax(fb)
    fast = torch.stack([torch.dot(fa, fa), torch.dot(d, d), ad.max(), torch.maximum(-bmin, bmax)])
    vals = fast.tolist()
    if all(math.isfinite(v) for v in vals):
        acc.add(wa2=vals[0], d2=vals[1])
        acc.max(dmax=vals[2], bmax=vals[3])
        return vals[2]
    fin_a, fin_b = torch.isfinite(fa), torch.isfinite(fb)
    acc.add(wa2=_finite_sq_sum(fa), d2=_finite_sq_sum(d), nfa=(~fin_a).sum(), nfb=(~fin_b).sum())
    dmax = float(_finite_absmax(d))
    acc.max(dmax=dmax, bmax=_finite_absmax(fb))
    # Finite data whose squares overflowed fp32 (a flipped exponent bit) still has a max.
    return dmax if bool(torch.isfinite(d).all()) else None


def moment_stats_torch(mo: Moments, acc: Acc, st: int, thr: float, eps: float) -> None:
    """Sums, maxima and share counts of one chunk of Adam's moments, in torch ops."""
    ma, mb, va, vb = mo.ma, mo.mb, mo.va, mo.vb
    amb = mb.abs()
    # fp64 sums, as the kernel's: r_v subtracts beta2^k sum v_A from sum v_B, nearly equal
    # when gradients are small, and fp32 chunk sums left it off by up to 6e-4 (zoo lr_jump).
    mom = torch.stack(
        [
            va.sum(dtype=torch.float64),
            vb.sum(dtype=torch.float64),
            amb.max().double(),
            vb.max().double(),
        ]
    )
    if not bool(torch.isfinite(mom).all()):
        acc.add(nfm=(~torch.isfinite(mb)).sum(), nfv=(~torch.isfinite(vb)).sum())
        mom = torch.stack(
            [_finite_sum(va), _finite_sum(vb), _finite_absmax(mb), _finite_absmax(vb)]
        )
    ma_s, va_s, vb_s, amb_s = (x[::st] for x in (ma, va, vb, amb))
    acc.add(
        sum_va=mom[0],
        sum_vb=mom[1],
        sampled=float(ma_s.numel()),
        # |m| > thr (sqrt(v) + eps)  <=>  |m| - thr sqrt(v) > thr eps
        rho_a=_rho_count(ma_s.abs(), va_s, thr, eps),
        rho_b=_rho_count(amb_s, vb_s, thr, eps),
        # sqrt(v) < 10 eps  <=>  v < 100 eps^2
        van_a=torch.count_nonzero(va_s < 100 * eps * eps),
        van_b=torch.count_nonzero(vb_s < 100 * eps * eps),
        v_n=torch.count_nonzero(va > 0),
    )
    acc.max(mmax=mom[2], vmax=mom[3])


def sqrt32(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (the fused kernel's, IEEE's): torch's fp32
    sqrt on the CPU is off by one ulp on about a fifth of the elements (measured, torch
    2.13 AVX-512), which moves elements across a bound; through fp64 it rounds once."""
    return v.double().sqrt().float() if v.dtype == torch.float32 else v.sqrt()


def _rho_count(am: torch.Tensor, v: torch.Tensor, thr: float, eps: float) -> torch.Tensor:
    """Elements with |m| - thr sqrt(v) > thr eps, as the fused kernel counts them: in
    fp64, where thr sqrt(v) of fp32 values is exact, so a fused multiply-add and a
    multiply then subtract round alike (in fp32 they differ on ties, and which one torch
    runs depends on its build and the strides)."""
    return torch.count_nonzero(am.double() - f32(thr) * sqrt32(v).double() > f32(thr * eps))


def moment_stats_fused(ms: fused.MomentStats, mo: Moments, acc: Acc) -> None:
    """The same from the fused kernel's pass; only a chunk holding a non-finite moment
    has its sums and maxima recomputed with masks in torch ops."""
    if ms.nonfinite_mb == ms.nonfinite_va == ms.nonfinite_vb == 0:
        acc.add(sum_va=ms.sum_va, sum_vb=ms.sum_vb)
        acc.max(mmax=ms.max_abs_mb, vmax=ms.max_vb)
    else:
        mb, va, vb = mo.mb, mo.va, mo.vb
        acc.add(nfm=(~torch.isfinite(mb)).sum(), nfv=(~torch.isfinite(vb)).sum())
        mom = torch.stack(
            [_finite_sum(va), _finite_sum(vb), _finite_absmax(mb), _finite_absmax(vb)]
        )
        acc.add(sum_va=mom[0], sum_vb=mom[1])
        acc.max(mmax=mom[2], vmax=mom[3])
    acc.add(
        sampled=ms.sampled,
        rho_a=ms.rho_a,
        rho_b=ms.rho_b,
        van_a=ms.van_a,
        van_b=ms.van_b,
        v_n=ms.v_pos,
    )


def _finite_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of the finite elements, in fp64: finite fp32 values can sum past fp32's range
    (a second moment near its dtype's max), and the fused kernel sums in fp64 too."""
    return torch.where(torch.isfinite(x), x, 0).sum(dtype=torch.float64)


def _finite_sq_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of the finite elements, in fp64: a finite fp32 value past 1.8e19
    (one exponent bit flipped) squares past fp32's range; the fused kernel's is fp64 too."""
    x64 = torch.where(torch.isfinite(x), x, 0).double()
    return torch.dot(x64, x64)


def _finite_absmax(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return (
        torch.where(torch.isfinite(a), a, torch.zeros_like(a)).max()
        if a.numel()
        else torch.zeros(())
    )


def prefetch(a: Checkpoint, b: Checkpoint, name: str) -> None:
    a.prefetch(name)
    b.prefetch(name)


def release_all(a: Checkpoint, b: Checkpoint, *ts: torch.Tensor) -> None:
    """Chunks just read: each folded into its zip member's CRC-32 while in cache (a member
    whose bytes fail it raises DamagedCheckpoint: `integrity.consume`), then its pages let go."""
    for t in ts:
        integrity.consume(t)
        a.release(t)
        b.release(t)
