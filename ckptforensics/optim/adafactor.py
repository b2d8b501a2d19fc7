"""Adafactor, torch's and transformers': recognised by its options or its factored second
moment, bounded by its update clipping, its rows, columns and vector variances held to their
decay floor; replayed with the implementation's own class."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import (
    constructor_args,
    finite_or,
    float_state,
    group_values,
    state_with_step,
)
from ckptforensics.optim.updates import StepBound

__all__ = ["FAMILY", "step_size"]

_TORCH = "torch.optim.Adafactor"
_HF = "transformers.optimization.Adafactor"


def recognise(keys: set[str], group: dict[str, Any]) -> tuple[str, str] | None:
    if keys & {"row_var", "col_var", "variance"}:
        return "adafactor", _TORCH
    if keys & {"exp_avg_sq_row", "exp_avg_sq_col"}:
        return "adafactor", _HF
    return None


def step_size(options: dict[str, Any], lr: float, t: int, rms_w: float) -> float:
    """The step size alpha_t each Adafactor multiplies its clipped update by.

    torch.optim.Adafactor: min(lr, 1/sqrt(t)) * max(eps2, RMS(w)) (`_single_tensor_adafactor`).
    transformers' Adafactor: relative_step min(1e-2, 1/sqrt(t)) (1e-6 t with warmup_init)
    else lr, times max(eps2, RMS(w)) with scale_parameter (`Adafactor._get_lr`).
    """
    eps2 = options.get("eps2") or 1e-3
    if "beta2_decay" in options or "d" in options:  # torch
        return min(lr, 1.0 / math.sqrt(t)) * max(eps2, rms_w)
    rel = lr
    if options.get("relative_step"):
        rel = min(1e-6 * t if options.get("warmup_init") else 1e-2, 1.0 / math.sqrt(t))
    scale = max(eps2, rms_w) if options.get("scale_parameter", True) else 1.0
    return rel * scale


def _bound(
    *,
    lr: float,
    wd: float,
    options: dict[str, Any],
    t_first: int,
    shape: tuple[int, ...],
    rms_w: float,
    **_: Any,
) -> StepBound:
    """Adafactor clips its update to RMS <= d (torch) / clip_threshold (transformers) before the
    step size (Shazeer & Stern 2018, §6 update clipping); a first moment (transformers'
    beta1) averages clipped updates, so its RMS stays under the same bound. Per element
    |x_i| <= sqrt(n) RMS(x): loose, so a corrupted element is located among the tensor's own
    changes, and the tensor as a whole is held to the RMS bound."""
    # Decreasing in t: the first step's is the largest.
    alpha = step_size(options, lr, t_first, rms_w)
    d = float(options.get("d") or options.get("clip_threshold") or 1.0)
    n = max(1, math.prod(shape))
    torch_rule = "beta2_decay" in options or "d" in options
    # torch decays by lr wd (the group's lr); transformers by wd times its step size.
    decay = (lr if torch_rule else alpha) * wd
    return StepBound(
        "adafactor",
        alpha * d * math.sqrt(n),
        decay,
        alpha * d,
        False,
        "Adafactor: update clipping, RMS(u) <= d (Shazeer & Stern 2018)",
    )


def _floor(betas: Any, options: dict[str, Any], t_first: int, t_last: int) -> float:
    """Each step mixes with weight 1 - beta2_t = t^c (c = beta2_decay / decay_rate, -0.8), so
    its rows, columns and vector variances keep at least prod_t (1 - t^c) (Shazeer & Stern
    2018, §7; torch `lerp_`, transformers `mul_(beta2t)`)."""
    c = float(options.get("beta2_decay", options.get("decay_rate", -0.8)))
    ts = np.arange(t_first, t_last + 1, dtype=np.float64)
    return float(np.prod(1.0 - np.power(ts, c)))


def _transformers(impl: str) -> bool:
    return impl.startswith("transformers")


def _class(impl: str) -> Any:
    if not _transformers(impl):
        return torch.optim.Adafactor
    try:
        from transformers.optimization import Adafactor
    except ImportError:
        raise ForensicsError(
            "replaying transformers' Adafactor needs transformers (pip install 'ckptforensics[hf]')"
        ) from None
    return Adafactor


_KEYS_TORCH = ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize")
_KEYS_HF = (
    "lr",
    "eps",
    "clip_threshold",
    "decay_rate",
    "beta1",
    "weight_decay",
    "scale_parameter",
    "relative_step",
    "warmup_init",
)


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    """Its eps pair (eps1 None where torch left it so: NaN in `GroupHyper`); transformers'
    relative step takes lr=None (its own schedule), which the class takes as given."""
    o = h.options
    vals = group_values(h, (finite_or(h.eps, None), o.get("eps2", 1e-3)))
    if o.get("relative_step"):
        vals["lr"] = None
    if _transformers(impl):
        return constructor_args(vals, _KEYS_HF, keep_none=("lr",))
    return constructor_args(vals, _KEYS_TORCH)


def _state(st: dict[str, Any], p: torch.Tensor, impl: str) -> dict[str, Any]:
    """transformers' Adafactor counts its `step` in a Python int; torch's in a float tensor."""
    if _transformers(impl):
        return state_with_step(st, p, lambda v: int(float(v)))
    return float_state(st, p, impl)


FAMILY = Family(
    name="adafactor",
    title="Adafactor",
    marks=(
        (frozenset({"beta2_decay", "d"}), _TORCH),
        (frozenset({"clip_threshold", "decay_rate"}), _HF),
    ),
    recognise=recognise,
    options=(
        "beta2_decay",
        "d",
        "clip_threshold",
        "decay_rate",
        "relative_step",
        "scale_parameter",
        "warmup_init",
        "beta1",
        "maximize",
    ),
    second_moments=(
        "row_var",
        "col_var",
        "variance",
        "exp_avg_sq_row",
        "exp_avg_sq_col",
        "exp_avg_sq",
    ),
    bound=_bound,
    floor=_floor,
    # Its parameter scale max(eps2, RMS(w)) (torch always; transformers with scale_parameter).
    weight_scale=lambda options: options.get("scale_parameter", True) or "d" in options,
    own_step_size=lambda options: options.get("relative_step"),
    replay_class=_class,
    replay_args=_args,
    replay_state=_state,
    replay_label=lambda impl: impl,
)
