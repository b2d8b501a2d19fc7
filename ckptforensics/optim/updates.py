"""The arithmetic every optimizer family's bound shares: the `StepBound` record, the raw Adam
EMAs' ratio bound, the second moment's EMA floor and its 8-bit allowance, and the bound of a
step that scales with the gradient (none).

Pure arithmetic on hyper-parameters (no tensors). Each family's own bound lives in its module
(`optim/<family>.py`), with its source beside it and in
docs/signatures.md#optimizer-update-bounds; `optim.step_bound` finds it by the family's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "StepBound",
    "unbounded",
    "ema_floor",
    "raw_ratio_bound",
    "quantised_floor_allowance",
]


@dataclass(frozen=True, slots=True)
class StepBound:
    """What one step of the family can do to a weight, whatever the gradient.

    |Δw_i| <= per_step + decay * |w_i| for every element and step (absolute units of the
    weight), and RMS(Δw) <= rms + decay * RMS(w) per step where the family bounds the
    tensor's update as a whole (Adafactor's update clipping).

    Attributes:
        family: the optimizer family.
        per_step: the weight-free part of the per-element bound (inf: none).
        decay: the per-step coefficient on |w_i| (weight decay as the family applies it).
        rms: the per-step bound on the update's RMS over the tensor (None: not bounded so).
        sharp: the per-element bound is tight enough to locate a corrupted element by
            itself; otherwise elements are located among the tensor's own changes.
        source: where the bound comes from.
    """

    family: str
    per_step: float
    decay: float
    rms: float | None
    sharp: bool
    source: str


def unbounded(family: str) -> StepBound:
    """No bound: SGD with momentum and optimizers the tool does not know (a gradient is
    unbounded, so is the step)."""
    return StepBound(
        family, math.inf, 0.0, None, False, "no bound: the step scales with the gradient"
    )


def ema_floor(betas: tuple[float, float] | None, t_first: int, t_last: int) -> float:
    """The least factor an EMA of squares keeps over steps t_first..t_last: v_B >= beta2^k v_A
    (each step adds (1 - beta2) g^2 >= 0; Adam, LAMB, 8-bit Adam)."""
    b2 = (betas or (0.9, 0.999))[1]
    return b2 ** (t_last - t_first + 1)


def raw_ratio_bound(beta1: float, beta2: float, t: int) -> float:
    """sup |m_t| / sqrt(v_t) for the raw (uncorrected) Adam EMAs after t steps (Cauchy-Schwarz:
    (1 - b1) / sqrt(1 - b2) sqrt(sum_{j<t} (b1^2 / b2)^j)), increasing in t."""
    r = beta1 * beta1 / beta2
    geo = t if abs(1 - r) < 1e-12 else (1 - r**t) / (1 - r)
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(max(geo, 0.0))


def quantised_floor_allowance(k: int, gap: float) -> float:
    """How far below b2^k v_A an 8-bit second moment may sit after k steps, in units of the
    block's absmax at the window's end.

    Each step computes V_t = b2 D_{t-1} + (1 - b2) g^2 >= b2 D_{t-1} in fp32 and stores
    D_t >= V_t - gap A_t (A_t the block's absmax, a code `gap` wide at most). The block's
    largest element is stored exactly (code 1.0), so A_{t+1} >= b2 A_t and A_t <= A_k b2^-(k-t).
    Unrolled: D_k >= b2^k D_0 - sum_t b2^(k-t) gap A_t >= b2^k D_0 - k gap A_k."""
    return max(0, int(k)) * gap
