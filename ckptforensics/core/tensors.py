"""Dtype limits, bit-level helpers and the LR-growth bound shared by diff, replay and detectors.

The robust statistics that lived here are in `ckptforensics.core.stats`; their names are
re-exported below because record/monitor.py, engine/whatif.py, engine/replay/run.py and the diff and
replay detectors import them from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ckptforensics.core.stats import (  # noqa: F401  (re-exported: modules outside stats/ import them from here)
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    CURVE_SHORT,
    CURVE_WINDOW,
    LOSS_FOLLOW,
    MAD_TO_SIGMA,
    TrendBaseline,
    log_curve,
    loss_follows,
    robust_z,
    trend_z,
)

__all__ = [
    "DtypeLimits",
    "dtype_limits",
    "dtype_name",
    "float_bits",
    "flip_bit",
    "bit_role",
    "robust_z",
    "adam_ratio_bound",
]


@dataclass(frozen=True, slots=True)
class DtypeLimits:
    """Range of a floating dtype.

    Attributes:
        max: largest finite value.
        tiny: smallest positive normal value.
        eps: machine epsilon (spacing at 1.0).
        bits: storage width in bits.
        mantissa_bits: explicit mantissa bits; the exponent sits above them.
    """

    max: float
    tiny: float
    eps: float
    bits: int
    mantissa_bits: int


def dtype_limits(dtype: torch.dtype) -> DtypeLimits | None:
    """Limits of a floating dtype, or None for integer/bool dtypes."""
    if not dtype.is_floating_point:
        return None
    fi = torch.finfo(dtype)
    mant = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}.get(
        dtype, 0
    )
    return DtypeLimits(
        max=float(fi.max), tiny=float(fi.tiny), eps=float(fi.eps), bits=fi.bits, mantissa_bits=mant
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'torch.bfloat16' -> 'bf16' style short names used in reports."""
    return {
        torch.float32: "fp32",
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.float64: "fp64",
    }.get(dtype, str(dtype).replace("torch.", ""))


_INT_OF = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """Reinterpret a float tensor's storage as signed integers of the same width."""
    return x.view(_INT_OF[x.dtype])


def flip_bit(value: float, bit: int, dtype: torch.dtype) -> float:
    """Value obtained by flipping bit `bit` (0 = LSB) of `value` stored in `dtype`."""
    t = torch.tensor([value], dtype=dtype)
    width = torch.finfo(dtype).bits
    as_int = t.view(_INT_OF[dtype]).to(torch.int64) & ((1 << width) - 1)
    flipped = as_int ^ (1 << bit)
    # Back to the signed container of the dtype's width.
    if flipped.item() >= 1 << (width - 1):
        flipped = flipped - (1 << width)
    return float(flipped.to(_INT_OF[dtype]).view(dtype).to(torch.float64).item())


def bit_role(bit: int, dtype: torch.dtype) -> str:
    """Name of the field a bit belongs to: 'sign', 'exponent' or 'mantissa'."""
    lim = dtype_limits(dtype)
    assert lim is not None
    if bit == lim.bits - 1:
        return "sign"
    return "exponent" if bit >= lim.mantissa_bits else "mantissa"


# A linear warmup from zero multiplies the LR by step_b / step_a between two steps at most;
# growth beyond LR_GROWTH_MARGIN times that is no schedule (docs/signatures.md#update-weight-ratio).
LR_GROWTH_MARGIN = 2.0


def lr_growth_limit(step_a: int, step_b: int, margin: float = LR_GROWTH_MARGIN) -> float:
    """The largest LR ratio lr(step_b) / lr(step_a) any warmup-then-decay schedule gives."""
    return margin * max(1.0, step_b / max(step_a, 1))


@lru_cache(maxsize=1024)  # the same (betas, window) for every tensor of a group
def adam_ratio_bound(beta1: float, beta2: float, t_first: int, t_last: int) -> float:
    """Largest |m_hat| / sqrt(v_hat) any Adam step t in [t_first, t_last] can produce.

    Cauchy-Schwarz on the two EMAs gives, for step t with r = beta1^2 / beta2,
    |m_t| / sqrt(v_t) <= (1-beta1)/sqrt(1-beta2) * sqrt(sum_{j<t} r^j), and bias
    correction multiplies by sqrt(1-beta2^t)/(1-beta1^t). As t grows this tends to
    (1-beta1)/sqrt((1-beta2)(1-beta1^2/beta2)), 1.16 at (0.9, 0.95). No gradient,
    however large, moves an element further than lr times this bound per step.
    """
    t_first = max(1, int(t_first))
    t_last = max(t_first, int(t_last))
    # Evaluate on a bounded set of steps: the bound is smooth and monotone in t for
    # t beyond a few hundred, so the tail is represented by its endpoint.
    ts = np.unique(np.concatenate([np.arange(t_first, min(t_last, t_first + 4096) + 1), [t_last]]))
    r = beta1 * beta1 / beta2
    if abs(1 - r) < 1e-12:
        geo = ts.astype(np.float64)
    else:
        geo = (1 - np.power(r, ts.astype(np.float64))) / (1 - r)
    raw = (1 - beta1) / math.sqrt(1 - beta2) * np.sqrt(np.maximum(geo, 0.0))
    corr = np.sqrt(1 - np.power(beta2, ts.astype(np.float64))) / (
        1 - np.power(beta1, ts.astype(np.float64))
    )
    return float(np.max(raw * corr))
