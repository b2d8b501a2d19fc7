"""The per-tensor kernel of the diff and its records: statistics of one tensor pair
(weights and Adam moments), streamed in flat chunks so memory stays near a few chunks.

Pure: no process, thread or rank logic (that is `diff` and `shard`, which both import this).
Every statistic is a sum, count or max that composes across chunks; element-level evidence
(bound violations) keeps at most `max_candidates` per tensor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from . import fused
from .errors import IncompatibleCheckpoints
from .formats import bnb
from .formats.base import Checkpoint
from .tensors import dtype_limits, dtype_name, flip_bit
from .updates import (
    MOMENT_FAMILIES,
    SECOND_MOMENTS,
    quantised_floor_allowance,
    raw_ratio_bound,
    second_moment_floor,
    step_bound,
)

__all__ = [
    "DiffConfig",
    "Candidate",
    "TensorDiff",
    "PairInfo",
    "DiffResult",
    "tensor_role",
    "tensor_family",
    "diff_tensor",
    "prefetch",
    "scalar",
    "adam_step",
    "load_kernels",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DiffConfig:
    """Options of a diff.

    Attributes:
        chunk_elems: elements per streamed chunk; small enough to stay in cache
            (memory ~ 20 fp32 chunks), large enough to amortise per-op overhead.
        max_candidates: element-level evidence kept per tensor.
        rho_threshold: |m|/(sqrt(v)+eps) above which an update is called sign-like (Molybog 2304.09871).
        bound_slack: relative slack on the Adam update bound (rounding of fp32 arithmetic).
        share_stride: the share statistics (sign-like, vanished second moment)
            of chunks of 64K elements and more are estimated on every share_stride-th
            element (a sample of 16K+ per chunk: standard error < 0.4 points); the
            bounds that locate single elements always see every element.
        device: where the statistics are computed ('cpu', 'cuda', 'cuda:1'): the
            tensors are read on the host and each chunk is copied to the device.
        fused: on the CPU, compute each chunk's statistics in one fused pass (`fused`);
            torch ops where the kernel is unavailable, and on other devices.
    """

    chunk_elems: int = 1 << 19
    max_candidates: int = 64
    rho_threshold: float = 0.9
    bound_slack: float = 1e-3
    share_stride: int = 4
    device: str = "cpu"
    fused: bool = True


@dataclass(frozen=True, slots=True)
class Candidate:
    """One element that broke a bound no Adam step can break.

    Attributes:
        where: 'weight', 'exp_avg' or 'exp_avg_sq'.
        index: position in the tensor (unravelled).
        before, after: stored values.
        bound: the largest |change| Adam allows here (same unit as the values).
        kind: 'bit_flip' when flipping one stored bit of `after` brings it within the
            bound, else 'out_of_bound'.
        bit: that bit (0 = least significant) and its field.
    """

    where: str
    index: tuple[int, ...]
    before: float
    after: float
    bound: float
    kind: str
    bit: int | None = None
    bit_field: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorDiff:
    """Statistics of one tensor between *before* (A) and *after* (B).

    Ratios are dimensionless; `k` is the Adam step delta; `lr` the largest LR recorded
    for the window; NaN marks a statistic that needs state the checkpoints lack.
    """

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    w_norm_a: float
    dw_norm: float
    dw_max_abs: float
    update_ratio: float  # ||dw|| / ||w_A|| / steps
    max_abs_b: float
    headroom_b: float  # dtype max / max|w_B|
    nonfinite_a: int
    nonfinite_b: int
    group: int | None = None  # optimizer param group index
    eps: float = math.nan  # Adam epsilon of its group
    has_moments: bool = False
    k: int = 0
    lr: float = math.nan
    r_v: float = math.nan  # implied gradient energy over the window / v_A (1 = stationary)
    rho_share_a: float = math.nan
    rho_share_b: float = math.nan
    vanished_share_a: float = math.nan  # share of sqrt(v) < 10 eps
    vanished_share_b: float = math.nan
    nonfinite_m_b: int = 0
    nonfinite_v_b: int = 0
    max_abs_m_b: float = math.nan
    max_v_b: float = math.nan
    moment_headroom_b: float = math.nan
    bound_violations: int = 0
    vfloor_violations: int = 0
    mbound_violations: int = 0
    outlier_changes: int = 0  # weights-only: isolated changes far above the tensor's own
    norm_violations: int = (
        0  # the tensor's update RMS past its family's bound (Adafactor's clipping)
    )
    family: str = ""  # the optimizer family that updated it ('adam', 'lion', 'adafactor', ...)
    # Share of second-moment elements under the floor the trainer's step delta allows
    # (v_B < beta2^g v_A, g trainer steps): ~0 in any healthy run, most elements when the
    # moments restarted from zero (optimizer state lost at a resume).
    restart_share: float = math.nan
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class PairInfo:
    """What the pair says as a whole: steps, skipped steps, loss scale, LR per group."""

    step_a: int | None
    step_b: int | None
    adam_step_a: int | None
    adam_step_b: int | None
    loss_scale_a: float | None
    loss_scale_b: float | None
    lr_a: tuple[float, ...]
    lr_b: tuple[float, ...]
    base_lr: tuple[float | None, ...]
    warmup_iters: int | None = None  # the schedule's warmup length, where the run records it
    optimizer: str | None
    betas: tuple[float, float] | None
    weights_only: bool
    notes: tuple[str, ...] = ()
    skip_optimizer: str | None = (
        None  # an optimizer that skips outlier steps itself (OLMo-core's SkipStep*)
    )
    scheduler_a: dict[str, Any] | None = None  # the LR scheduler's state (last_epoch, _step_count)
    scheduler_b: dict[str, Any] | None = None
    scaler_a: dict[str, Any] | None = (
        None  # the loss scaler's state (scale, _growth_tracker, growth_interval)
    )
    scaler_b: dict[str, Any] | None = None


@dataclass(slots=True)
class DiffResult:
    """A diff: pair-level info and one TensorDiff per compared tensor."""

    pair: PairInfo
    tensors: list[TensorDiff] = field(default_factory=list)


_ROLES = (
    ("embedding", re.compile(r"embed|wte|wpe|tok_emb|word_emb|position_emb|shared\.weight")),
    ("head", re.compile(r"lm_head|output\.weight$|(^|\.)head\.")),
    ("norm", re.compile(r"norm|ln_|(^|\.)ln\d*\.|layernorm")),
    ("attention", re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj|qkv|query|key|value")),
    ("mlp", re.compile(r"mlp|ffn|feed_forward|fc|gate|up_proj|down_proj|dense|experts")),
)


def tensor_role(name: str, shape: tuple[int, ...]) -> str:
    """Comparable-tensor class for robust statistics: role plus 'bias'/'vector' for 1-D."""
    base = next((r for r, rx in _ROLES if rx.search(name)), "other")
    if len(shape) < 2 and base != "norm":
        return f"{base}-vector"
    return base


def scalar(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.item())
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def adam_step(state: dict[str, Any]) -> int | None:
    s = scalar(state.get("step"))
    return int(s) if s is not None else None


def _chunks(t: torch.Tensor, size: int) -> Iterator[tuple[int, torch.Tensor]]:
    flat = t.reshape(-1)
    for lo in range(0, flat.numel(), size):
        yield lo, flat[lo : lo + size]


class _Acc:
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


def _f32(x: float) -> float:
    """A Python scalar as torch rounds it to compare it with an fp32 tensor."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def load_kernels(cfg: DiffConfig) -> fused.Kernels | None:
    """The fused kernels a diff under `cfg` uses (None: torch ops). Called once before
    worker processes fork, they inherit the loaded library rather than each build it."""
    return fused.load() if cfg.fused and torch.device(cfg.device).type == "cpu" else None


class _Staging:
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


class _Pair:
    """One chunk of a weight pair; its fp32 views on the statistics' device, made when
    first asked for (the fused kernel reads the stored values directly)."""

    def __init__(self, wa: torch.Tensor, wb: torch.Tensor, stage: _Staging) -> None:
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


class _Moments:
    """One chunk of Adam's moments (m_A, m_B, v_A, v_B) as stored; their fp32 views on the
    statistics' device when first asked for."""

    def __init__(self, raw: list[torch.Tensor], stage: _Staging) -> None:
        self.raw, self._stage = raw, stage

    def _get(self, i: int) -> torch.Tensor:
        return self._stage(self.raw[i], 2 + i).float()

    ma = cached_property(lambda self: self._get(0))
    mb = cached_property(lambda self: self._get(1))
    va = cached_property(lambda self: self._get(2))
    vb = cached_property(lambda self: self._get(3))


def _weight_stats(w: _Pair, kern: fused.Kernels | None, acc: _Acc) -> float | None:
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


def _moment_stats_torch(mo: _Moments, acc: _Acc, st: int, thr: float, eps: float) -> None:
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


def _sqrt32(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (the fused kernel's, IEEE's): torch's fp32
    sqrt on the CPU is off by one ulp on about a fifth of the elements (measured, torch
    2.13 AVX-512), which moves elements across a bound; through fp64 it rounds once."""
    return v.double().sqrt().float() if v.dtype == torch.float32 else v.sqrt()


def _rho_count(am: torch.Tensor, v: torch.Tensor, thr: float, eps: float) -> torch.Tensor:
    """Elements with |m| - thr sqrt(v) > thr eps, as the fused kernel counts them: in
    fp64, where thr sqrt(v) of fp32 values is exact, so a fused multiply-add and a
    multiply then subtract round alike (in fp32 they differ on ties, and which one torch
    runs depends on its build and the strides)."""
    return torch.count_nonzero(am.double() - _f32(thr) * _sqrt32(v).double() > _f32(thr * eps))


def _moment_stats_fused(ms: fused.MomentStats, mo: _Moments, acc: _Acc) -> None:
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


def tensor_family(hyper: Any, state: dict[str, Any]) -> str:
    """The family of the optimizer that updated a tensor: its group's, or Adam's where a
    reader that maps state itself (DCP, DeepSpeed, Megatron) saw Adam's two moments."""
    fam = getattr(hyper, "family", "") or ""
    if (
        fam in ("", "none")
        and isinstance(state.get("exp_avg"), torch.Tensor)
        and isinstance(state.get("exp_avg_sq"), torch.Tensor)
    ):
        return "adam"
    return fam


def _window_lr(ha: Any, hb: Any, pair: PairInfo, step_a: int, step_b: int) -> float:
    """The largest LR the window can have run at: the larger stored LR of its ends, or the
    schedule's base where the window holds the end of warmup (the LR peaked in between)."""
    lr = max(hb.lr, ha.lr if ha else 0.0) if math.isfinite(hb.lr) else math.nan
    base = pair.base_lr[hb.index] if hb.index < len(pair.base_lr) else None
    w = pair.warmup_iters
    over_peak = (w is not None and step_a < w <= step_b) or (
        w is None and ha is not None and ha.lr < hb.lr
    )
    if over_peak and base is not None and base > lr:
        lr = base
    return lr


def _trainer_steps(pair: PairInfo) -> int | None:
    if pair.step_a is None or pair.step_b is None or pair.step_b <= pair.step_a:
        return None
    return pair.step_b - pair.step_a


def diff_tensor(
    a: Checkpoint, b: Checkpoint, name: str, pair: PairInfo, cfg: DiffConfig
) -> TensorDiff:
    meta = a.meta(name)
    wa_full, wb_full = a.tensor(name), b.tensor(name)
    role = tensor_role(name, meta.shape)
    lim = dtype_limits(meta.dtype)
    sa, sb = a.optim_state(name), b.optim_state(name)
    ha, hb = a.hyper(name), b.hyper(name)
    family = tensor_family(hb, sb) if hb is not None and not pair.weights_only else ""
    g_steps = _trainer_steps(pair)
    moments = (
        not pair.weights_only
        and lim is not None
        and family in MOMENT_FAMILIES
        and isinstance(sa.get("exp_avg"), torch.Tensor)
        and isinstance(sb.get("exp_avg"), torch.Tensor)
        and isinstance(sa.get("exp_avg_sq"), torch.Tensor)
        and isinstance(sb.get("exp_avg_sq"), torch.Tensor)
        and hb is not None
        and hb.betas is not None
    )
    k = 0
    step_a = step_b = 0
    restart = False  # both ends hold Adam's moments but the counter did not advance: a reset
    if moments:
        step_a, step_b = adam_step(sa) or 0, adam_step(sb) or 0
        k = step_b - step_a
        restart = k <= 0 and g_steps is not None
        moments = k > 0
    # Families other than Adam's: a per-step bound on the weight, and (Adafactor) a floor
    # on the factored second moment; steps from the optimizer's counter, else the trainer's.
    other = (
        not pair.weights_only
        and lim is not None
        and hb is not None
        and family not in MOMENT_FAMILIES
        and family not in ("", "none")
        and not family.startswith("unknown")
        and bool(sb)
    )
    obound = None
    o_k = 0
    o_floor: float | None = None
    o_restart_floor: float | None = None
    o_lr = math.nan
    if other:
        assert hb is not None
        ca, cb = adam_step(sa), adam_step(sb)
        if ca is not None and cb is not None:
            o_k, step_a, step_b = cb - ca, ca, cb
        elif g_steps is not None:
            o_k = g_steps
            step_a, step_b = pair.step_a or 0, pair.step_b or 0
        o_lr = _window_lr(ha, hb, pair, step_a, step_b)
        rms_w = 0.0
        if family == "adafactor" and (hb.options.get("scale_parameter", True) or "d" in hb.options):
            rms_w = max(_rms(wa_full), _rms(wb_full))
        if o_k > 0:
            obound = step_bound(
                family, lr=o_lr if math.isfinite(o_lr) else 1.0, weight_decay=hb.weight_decay, betas=hb.betas, options=hb.options,
                t_first=step_a + 1, t_last=step_b, shape=meta.shape, rms_w=rms_w,
            )  # fmt: skip
            if not math.isfinite(o_lr) and not (
                family == "adafactor" and hb.options.get("relative_step")
            ):
                obound = None  # no LR recorded: nothing to bound against
            o_floor = second_moment_floor(family, hb.betas, hb.options, step_a + 1, step_b)
        elif ca is not None and cb is not None and cb <= ca and g_steps is not None:
            o_restart_floor = second_moment_floor(
                family, hb.betas, hb.options, ca + 1, ca + g_steps
            )
    sgd_bufs = None
    if other and family == "sgd" and o_k > 0 and math.isfinite(o_lr):
        ba_, bb_ = sa.get("momentum_buffer"), sb.get("momentum_buffer")
        if (
            isinstance(ba_, torch.Tensor)
            and isinstance(bb_, torch.Tensor)
            and ba_.shape == bb_.shape
            and ba_.numel() == meta.numel
        ):
            sgd_bufs = (ba_, bb_)
    acc = _Acc()
    cands: list[Candidate] = []
    counts = {"bound": 0, "vfloor": 0, "mbound": 0, "outlier": 0, "norm": 0}
    lr = math.nan
    restart_floor = None
    restart_allow: torch.Tensor | None = None
    if restart:
        assert hb is not None and hb.betas is not None and g_steps is not None
        restart_floor = hb.betas[1] ** g_steps
        q = bnb.quant_parts(sb, 2) if family == "adam8bit" else None
        if q is not None:
            restart_allow = bnb.per_element(q[2], meta.numel) * quantised_floor_allowance(
                g_steps, bnb.code_gap(q[1])
            )
    if moments:
        assert hb is not None and hb.betas is not None
        beta1, beta2 = hb.betas
        lr = _window_lr(ha, hb, pair, step_a, step_b)
        eps, wd = hb.eps, hb.weight_decay
        # 8-bit state (bitsandbytes): the moments are the dequantised codes (`formats.bnb`).
        quant = bnb.quant_parts(sb, 2) if family == "adam8bit" else None
        rms_w = max(_rms(wa_full), _rms(wb_full)) if family == "lamb" else 0.0
        mbound_ = step_bound(
            family, lr=lr, weight_decay=wd, betas=hb.betas, options={**hb.options, "quantised": quant is not None},
            t_first=step_a + 1, t_last=step_b, shape=meta.shape, rms_w=rms_w,
        ) if math.isfinite(lr) else None  # fmt: skip
        if mbound_ is not None and mbound_.rms is not None:
            obound, o_k = mbound_, k  # the tensor's norm bound (LAMB's trust ratio), checked below
        c_raw_b = raw_ratio_bound(beta1, beta2, step_b)
        # |m| <= C_raw sqrt(v) needs both EMAs of one history: not through 8-bit rounding,
        # nor for an EMA without its (1 - b1) (apex LAMB's grad_averaging=False).
        check_m = quant is None and hb.options.get("grad_averaging") is not False
        v_allow: torch.Tensor | None = None
        if quant is not None:
            codes, qmap, scale = quant
            v_allow = bnb.per_element(scale, meta.numel) * quantised_floor_allowance(
                k, bnb.code_gap(qmap)
            )
        decay_k = beta2**k
        # Moments stored in a narrow dtype (torchtitan's bf16 optimizer states, Megatron's
        # --exp-avg-dtype) are rounded once per save: their bounds widen by that rounding.
        store_eps = max(
            _storage_eps(sa["exp_avg_sq"]),
            _storage_eps(sb["exp_avg_sq"]),
            _storage_eps(sb["exp_avg"]),
        )
    if moments or restart:
        streams = [sa["exp_avg"], sb["exp_avg"], sa["exp_avg_sq"], sb["exp_avg_sq"]]
        for t in streams:
            if tuple(t.shape) != meta.shape:
                raise IncompatibleCheckpoints(
                    f"{name}: optimizer moment of shape {list(t.shape)} for a parameter of shape {list(meta.shape)}"
                )
    is_float = lim is not None
    kern = load_kernels(cfg)
    stage = _Staging(cfg.device)
    moment_streams = [t.reshape(-1) for t in streams] if moments or restart else []
    for lo, wa in _chunks(wa_full, cfg.chunk_elems):
        hi = lo + wa.numel()
        wb = wb_full.reshape(-1)[lo:hi]
        if not is_float:
            acc.add(changed=(stage(wa, 0) != stage(wb, 1)).sum())
            _release_all(a, b, wa, wb)
            continue
        w = _Pair(wa, wb, stage)
        dmax = _weight_stats(w, kern, acc)  # max |dw| of the chunk where every dw is finite
        if restart:
            assert restart_floor is not None
            va, vb = (stage(t[lo:hi], 4 + i).float() for i, t in enumerate(moment_streams[2:]))
            allow = restart_allow[lo:hi] if restart_allow is not None else 0.0
            acc.add(
                restart_low=torch.count_nonzero((vb < va * restart_floor - allow) & (va > 0)),
                restart_n=torch.count_nonzero(va > 0),
            )
            _release_all(a, b, *(t[lo:hi] for t in moment_streams))
        if moments:
            raw = [t[lo:hi] for t in moment_streams]
            st = cfg.share_stride if wa.numel() >= 1 << 16 else 1
            thr = cfg.rho_threshold
            slack = 1 + cfg.bound_slack + 2 * store_eps
            # v floor: v_B >= beta2^k v_A; fp32 rounding allows a few ulps per step, a
            # narrow storage dtype its rounding at every step (Megatron's precision-aware
            # optimizer and pure-bf16 AdamW store the moment in bf16 after each update),
            # 8-bit codes k code gaps of the block's absmax (`quantised_floor_allowance`).
            floor_k = decay_k * (1 - 1e-6 * (k + 4)) * (1 - (k + 1) * store_eps)
            c_mb = c_raw_b * slack
            ms = (
                kern.moments(*raw, stride=st, thr=thr, eps=eps, floor_k=floor_k, c_mb=c_mb)
                if kern is not None
                else None
            )
            mo = _Moments(raw, stage)
            if ms is None:
                _moment_stats_torch(mo, acc, st, thr, eps)
            else:
                _moment_stats_fused(ms, mo, acc)
            if mbound_ is not None and mbound_.sharp:
                # Update bound: |dw| <= k (per_step + decay |w|), plus one storage ulp each
                # side. Only elements past the weight-free part need the full bound.
                _bound_check(
                    w,
                    dmax,
                    k * mbound_.per_step * slack,
                    k * mbound_.decay * slack,
                    lim.eps,
                    lo,
                    meta.shape,
                    cands,
                    counts,
                    cfg,
                )
            elif mbound_ is not None:
                _isolated_chunk(w, dmax, lim.eps, None, 0.0, lo, meta.shape, cands, counts, cfg)
            # The kernel's count of v_B < floor_k v_A is a superset of the elements under
            # the floor less the 8-bit allowance: torch reruns the exact test, and keeps
            # the evidence, only on a chunk where it is not 0.
            if ms is None or ms.low:
                va, vb = mo.va, mo.vb
                allow = v_allow[lo:hi] if v_allow is not None else 0.0
                low = vb < va * floor_k - allow
                if bool(low.any()):
                    idx = torch.nonzero(low).flatten()
                    limits = va[idx] * floor_k - (
                        allow[idx] if isinstance(allow, torch.Tensor) else 0.0
                    )
                    _collect(
                        cands, counts, "vfloor", "exp_avg_sq", idx, va, vb, "at_least", limits, lo, meta.shape, sb["exp_avg_sq"].dtype, cfg,
                        explain=_code_flips(quant, lo) if quant is not None else None,
                    )  # fmt: skip
            # |m_B| <= C_raw sqrt(v_B): the raw EMAs obey Cauchy-Schwarz at every step.
            if check_m and (ms is None or ms.big):
                ma, mb, sq_b = mo.ma, mo.mb, _sqrt32(mo.vb)
                big = mb.abs() > sq_b * c_mb
                if bool(big.any()):
                    idx = torch.nonzero(big).flatten()
                    _collect(
                        cands,
                        counts,
                        "mbound",
                        "exp_avg",
                        idx,
                        ma,
                        mb,
                        "abs_within",
                        sq_b[idx] * c_mb,
                        lo,
                        meta.shape,
                        sb["exp_avg"].dtype,
                        cfg,
                    )
            _release_all(a, b, *raw)
        elif obound is not None and math.isfinite(obound.per_step) and obound.sharp:
            # The family's own per-element bound (Lion's exact lr, Muon's spectral norm).
            slack = 1 + cfg.bound_slack
            _bound_check(
                w,
                dmax,
                o_k * obound.per_step * slack,
                o_k * obound.decay * slack,
                lim.eps,
                lo,
                meta.shape,
                cands,
                counts,
                cfg,
            )
        else:
            bufs = (
                tuple(
                    stage(x.reshape(-1)[lo:hi], 2 + i).float().abs() for i, x in enumerate(sgd_bufs)
                )
                if sgd_bufs is not None
                else None
            )
            _isolated_chunk(w, dmax, lim.eps, bufs, o_k * o_lr, lo, meta.shape, cands, counts, cfg)  # type: ignore[arg-type]
        _release_all(a, b, wa, wb)

    if other and (o_floor is not None or o_restart_floor is not None):
        _factored_floor(sa, sb, family, o_floor, o_restart_floor, acc, cands, counts, cfg)
    a.forget(name)
    b.forget(name)
    s, m = acc.sums, acc.maxes
    kk = k if k > 0 else o_k
    steps = (
        kk
        if kk > 0
        else max(1, (pair.step_b or 1) - (pair.step_a or 0))
        if pair.step_a is not None
        else 1
    )
    w_norm = math.sqrt(s.get("wa2", 0.0))
    dw_norm = math.sqrt(s.get("d2", 0.0))
    bmax = m.get("bmax", 0.0)
    if obound is not None and obound.rms is not None and meta.numel > 0:
        # The tensor as a whole: RMS(dw) <= k (rms + decay RMS(w)) (Adafactor's update clipping).
        rms_w = max(w_norm / math.sqrt(meta.numel), _rms(wb_full))
        allowed = (
            o_k * (obound.rms + obound.decay * rms_w) * (1 + cfg.bound_slack) + 2 * lim.eps * rms_w
            if lim
            else math.inf
        )
        if dw_norm / math.sqrt(meta.numel) > allowed:
            counts["norm"] += 1
    out: dict[str, Any] = dict(
        name=name,
        role=role,
        shape=meta.shape,
        dtype=dtype_name(meta.dtype),
        numel=meta.numel,
        w_norm_a=w_norm,
        dw_norm=dw_norm,
        dw_max_abs=m.get("dmax", 0.0),
        update_ratio=dw_norm / w_norm / steps if w_norm > 0 else math.nan,
        max_abs_b=bmax,
        headroom_b=(lim.max / bmax) if lim and bmax > 0 else math.inf,
        nonfinite_a=int(s.get("nfa", 0)),
        nonfinite_b=int(s.get("nfb", 0)),
        bound_violations=counts["bound"],
        vfloor_violations=counts["vfloor"],
        mbound_violations=counts["mbound"],
        outlier_changes=counts["outlier"],
        norm_violations=counts["norm"],
        candidates=tuple(cands),
        group=hb.index if hb is not None else None,
        eps=hb.eps if hb is not None else math.nan,
        family=family,
        k=kk if kk > 0 else 0,
        lr=o_lr if other else math.nan,
    )
    if restart and s.get("restart_n", 0) > 0:
        out["restart_share"] = s["restart_low"] / s["restart_n"]
    if other and "restart_n" in s and s["restart_n"] > 0:
        out["restart_share"] = s["restart_low"] / s["restart_n"]
    if moments:
        # r_v = sum(v_B - b2^k v_A) / sum((1 - b2^k) v_hat_A): the mean g^2 the window
        # implies over the running average before it; v_A is bias-corrected, as it is
        # (1 - b2^t) times too small early in training.
        den = (1 - decay_k) * s["sum_va"] / (1 - beta2**step_a) if step_a > 0 else math.inf
        out.update(
            has_moments=True,
            k=k,
            lr=lr,
            r_v=(s["sum_vb"] - decay_k * s["sum_va"]) / den if den > 0 else math.inf,
            rho_share_a=s["rho_a"] / s["sampled"],
            rho_share_b=s["rho_b"] / s["sampled"],
            vanished_share_a=s["van_a"] / s["sampled"],
            vanished_share_b=s["van_b"] / s["sampled"],
            nonfinite_m_b=int(s.get("nfm", 0)),
            nonfinite_v_b=int(s.get("nfv", 0)),
            max_abs_m_b=m["mmax"],
            max_v_b=m["vmax"],
            moment_headroom_b=torch.finfo(torch.float32).max / m["vmax"]
            if m["vmax"] > 0
            else math.inf,
        )
        if g_steps is not None and g_steps == k and s.get("v_n", 0) > 0:
            out["restart_share"] = counts["vfloor"] / s["v_n"]
    return TensorDiff(**out)


def _rms(t: torch.Tensor) -> float:
    n = t.numel()
    return float(torch.linalg.vector_norm(t.float())) / math.sqrt(n) if n else 0.0


def _storage_eps(t: torch.Tensor) -> float:
    """The relative rounding of a stored moment's dtype beyond fp32's (0 for fp32 and wider)."""
    if not t.dtype.is_floating_point or t.dtype in (torch.float32, torch.float64):
        return 0.0
    return float(torch.finfo(t.dtype).eps)


def _factored_floor(
    sa: dict[str, Any],
    sb: dict[str, Any],
    family: str,
    floor: float | None,
    restart_floor: float | None,
    acc: _Acc,
    cands: list[Candidate],
    counts: dict[str, int],
    cfg: DiffConfig,
) -> None:
    """Adafactor's second moments (rows, columns, vector variances) against their decay
    floor; with the counter reset, the share under the trainer's step delta's floor."""
    for key in SECOND_MOMENTS.get(family, ()):
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
        f = floor * (1 - 1e-6 * 8) * (1 - 2 * _storage_eps(xb))
        low = vb < va * f
        acc.add(
            restart_low=torch.count_nonzero(low & (va > 0)), restart_n=torch.count_nonzero(va > 0)
        )
        if bool(low.any()):
            idx = torch.nonzero(low).flatten()
            _collect(
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


def _bound_check(
    w: _Pair,
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
    if dmax is not None and dmax <= _f32(per_step):
        return
    ad, fa, fb = w.ad, w.fa, w.fb
    coarse = ad > per_step
    if bool(coarse.any()):
        idx = torch.nonzero(coarse).flatten()
        wmax = torch.maximum(fa[idx].abs(), fb[idx].abs())
        bound = wmax * (decay + 2 * ulp) + per_step
        over = ad[idx] > bound
        _collect(
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


def _isolated_chunk(
    w: _Pair,
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
        _collect(
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


def _code_flips(
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


def _release_all(a: Checkpoint, b: Checkpoint, *ts: torch.Tensor) -> None:
    for t in ts:
        a.release(t)
        b.release(t)


def _acceptable(mode: str, value: float, before: float, limit: float) -> bool:
    """Could Adam have produced `value`? 'near': within `limit` of the previous value
    (weights); 'at_least': at or above the v floor; 'abs_within': |m| <= C sqrt(v)."""
    if mode == "near":
        return abs(value - before) <= limit
    if mode == "at_least":
        return value >= limit
    return abs(value) <= limit


def _collect(
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
    from .tensors import bit_role

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
