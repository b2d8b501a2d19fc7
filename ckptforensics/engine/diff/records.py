"""The diff's records and what names a tensor: its config (`DiffConfig`), a tensor pair's
statistics (`TensorDiff`, `Candidate`), the pair's facts (`PairInfo`), the whole result
(`DiffResult`), and a tensor's role and optimizer family."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptforensics import optim
from ckptforensics.trainers.fused import Heads

__all__ = [
    "optimizer_steps",
    "DiffConfig",
    "Candidate",
    "TensorDiff",
    "ExpertStats",
    "PairInfo",
    "DiffResult",
    "tensor_role",
    "tensor_family",
    "scalar",
    "adam_step",
    "trainer_steps",
    "window_lr",
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
class ExpertStats:
    """One fused expert tensor's statistics, one entry per expert (index = expert id).

    Attributes:
        experts: E, the tensor's leading dim (the model config's expert count).
        numel: elements per expert.
        w_norm_a: ||w_A|| of each expert's slice.
        dw_norm: ||w_B - w_A|| of each slice.
        update_ratio: ||dw|| / ||w_A|| / k (per step, dimensionless).
        step_rms: RMS(dw) / (k lr): the mean step of an element in units of the LR; Adam's
            sign-like regime moves every element by ~lr (1), a noisy stationary gradient by
            ~sqrt((1 - beta1) / (1 + beta1)) (0.23 at beta1 0.9). NaN without an LR.
        mean_v_a, mean_v_b: mean exp_avg_sq of the slice (gradient units squared); NaN weights-only.
        r_v: implied mean g^2 over the window / bias-corrected v_A (1 = stationary, 0 = no gradient).
        decayed: every element of both moments within rounding of the decay no gradient
            leaves (v_B = beta2^k v_A, m_B = beta1^k m_A): no token reached the expert.
    """

    experts: int
    numel: int
    w_norm_a: tuple[float, ...]
    dw_norm: tuple[float, ...]
    update_ratio: tuple[float, ...]
    step_rms: tuple[float, ...]
    mean_v_a: tuple[float, ...] = ()
    mean_v_b: tuple[float, ...] = ()
    r_v: tuple[float, ...] = ()
    decayed: tuple[bool, ...] = ()

    @property
    def has_moments(self) -> bool:
        return len(self.decayed) == self.experts


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
    # A fused Mixture-of-Experts tensor ([E, ...]): its statistics per expert (None otherwise).
    experts: ExpertStats | None = None


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
    # The model's attention shape (its config): names the q/k/v or gate/up part of a fused
    # tensor an element finding points into (`trainers.fused.part_of`).
    heads: Heads | None = None
    # The model's routed experts per MoE layer (its config's `num_experts` / `num_local_experts`):
    # a tensor whose leading dim holds them is read per expert (`engine.diff.experts`).
    n_experts: int | None = None


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


def optimizer_steps(optimizer: Any) -> int | None:
    """An optimizer state's own step counter: the largest over its parameters (None without
    one). The diff's resume rule and the replay's resume variant read it alike."""
    if optimizer is None:
        return None
    vals = [s for s in (adam_step(st) for st in optimizer.state.values()) if s is not None]
    return max(vals) if vals else None


def tensor_family(hyper: Any, state: dict[str, Any]) -> str:
    """The family of the optimizer that updated a tensor: its group's, or Adam's
    (`optim.DEFAULT`) where a reader that maps state itself (DCP, DeepSpeed, Megatron) saw
    Adam's two moments."""
    fam = getattr(hyper, "family", "") or ""
    if (
        fam in ("", "none")
        and isinstance(state.get("exp_avg"), torch.Tensor)
        and isinstance(state.get("exp_avg_sq"), torch.Tensor)
    ):
        return optim.DEFAULT.name
    return fam


def window_lr(ha: Any, hb: Any, pair: PairInfo, step_a: int, step_b: int) -> float:
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


def trainer_steps(pair: PairInfo) -> int | None:
    if pair.step_a is None or pair.step_b is None or pair.step_b <= pair.step_a:
        return None
    return pair.step_b - pair.step_a
