"""How far each optimizer family can move a weight in one step, and how fast its second
moment can decay: the bounds the integrity checks of `diff` and `replay` test against.

Pure arithmetic on the optimizer's own hyper-parameters (no tensors): each bound is what the
family's own update rule allows whatever the gradient, with its source beside it and in
docs/signatures.md#optimizer-update-bounds.

Over 400 lines: one bound per optimizer family, each with its source; split, the families'
bounds would no longer read side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from ckptforensics.core.tensors import adam_ratio_bound

__all__ = [
    "StepBound",
    "step_bound",
    "second_moment_floor",
    "adafactor_step_size",
    "ns_sup",
    "SHARP_FAMILIES",
    "MOMENT_FAMILIES",
    "SECOND_MOMENTS",
    "replay_bound",
    "raw_ratio_bound",
    "quantised_floor_allowance",
]

# Families whose per-element bound can be tight enough to locate a flipped element on its own
# (Adam 1.16 lr; Lion lr exactly; LAMB within DeepSpeed's trust-ratio clamp; Muon the spectral
# norm; 8-bit Adam where its state is fp32). `StepBound.sharp` says so per tensor.
SHARP_FAMILIES = ("adam", "lamb", "lion", "muon", "adam8bit")
# Families with Adam's two full-shaped moments (exp_avg, exp_avg_sq).
MOMENT_FAMILIES = ("adam", "lamb", "adam8bit")

# bfloat16's unit roundoff (2^-8): torch's Muon runs Newton-Schulz in bf16, each iteration
# rounding its product once (torch/optim/_muon.py `_zeropower_via_newtonschulz`).
_BF16_U = 2.0**-8


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


def step_bound(
    family: str,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] | None,
    options: dict[str, Any],
    t_first: int,
    t_last: int,
    shape: tuple[int, ...],
    rms_w: float = 0.0,
) -> StepBound:
    """The per-step bound of `family` over optimizer steps t_first..t_last (1-based).

    Args:
        lr: the largest LR the window ran at (NaN for transformers' relative-step Adafactor).
        options: the group's saved options (`GroupHyper.options`).
        shape: the parameter's shape (Muon's LR adjustment, Adafactor's n).
        rms_w: the larger RMS of the weight at the window's ends (Adafactor's parameter scale).
    """
    wd = weight_decay or 0.0
    t_first = max(1, int(t_first))
    t_last = max(t_first, int(t_last))
    if family == "adam8bit" and options.get("quantised"):
        # bitsandbytes updates from its dequantised state (`optimizer_update_8bit_blockwise`):
        # m = b1 deq(m) + (1 - b1) g, v = b2 deq(v) + (1 - b2) g^2, then re-quantises. The
        # two EMAs no longer share one history, so Cauchy-Schwarz does not bound m / sqrt(v):
        # a second moment rounded to code 0 under a first moment that is not moves an
        # element by up to lr |m| / eps. No per-element bound: located among its own changes.
        return StepBound(
            family,
            math.inf,
            lr * wd,
            None,
            False,
            "8-bit Adam: no per-element bound through the quantised state (bitsandbytes `optimizer_update_8bit_blockwise`)",
        )
    if family in ("adam", "adam8bit"):
        # (8-bit Adam's tensors under min_8bit_size keep fp32 state and Adam's update exactly.)
        b1, b2 = betas or (0.9, 0.999)
        c = adam_ratio_bound(b1, b2, t_first, t_last)
        return StepBound(
            family,
            lr * c,
            lr * wd,
            None,
            True,
            "Adam: |m_hat|/sqrt(v_hat) <= C (Kingma & Ba 2015; Cauchy-Schwarz on the EMAs)",
        )
    if family == "lamb":
        return _lamb_bound(lr, wd, betas, options, t_first, t_last, shape, rms_w)
    if family == "lion":
        # update = sign(...): |Δw_i| = lr exactly, plus the decoupled decay lr wd |w_i|
        # (Chen et al. 2023, arXiv 2302.06675, Alg. 2; lion-pytorch `update_fn`).
        wd_eff = (
            wd / options["init_lr"]
            if options.get("decoupled_weight_decay") and options.get("init_lr")
            else wd
        )
        return StepBound(
            family,
            lr,
            lr * wd_eff,
            lr,
            True,
            "Lion: sign update, |dw| = lr (1 + wd |w|) (Chen et al. 2023)",
        )
    if family == "muon":
        return _muon_bound(lr, wd, options, shape)
    if family == "adafactor":
        return _adafactor_bound(lr, wd, options, t_first, shape, rms_w)
    # SGD with momentum and unknown optimizers: a gradient is unbounded, so is the step.
    return StepBound(
        family, math.inf, 0.0, None, False, "no bound: the step scales with the gradient"
    )


def raw_ratio_bound(beta1: float, beta2: float, t: int) -> float:
    """sup |m_t| / sqrt(v_t) for the raw (uncorrected) Adam EMAs after t steps (Cauchy-Schwarz:
    (1 - b1) / sqrt(1 - b2) sqrt(sum_{j<t} (b1^2 / b2)^j)), increasing in t."""
    r = beta1 * beta1 / beta2
    geo = t if abs(1 - r) < 1e-12 else (1 - r**t) / (1 - r)
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(max(geo, 0.0))


def _lamb_bound(
    lr: float,
    wd: float,
    betas: tuple[float, float] | None,
    options: dict[str, Any],
    t_first: int,
    t_last: int,
    shape: tuple[int, ...],
    rms_w: float,
) -> StepBound:
    """LAMB: w <- w - s * phi * u, u Adam's direction (weight decay inside it, or decoupled),
    phi the trust ratio ||w|| / ||u|| per tensor. Per implementation:

    - DeepSpeed FusedLamb (`max_coeff`; csrc/lamb/fused_lamb_cuda_kernel.cu): phi clamped to
      [min_coeff, max_coeff], s = lr sqrt(1 - b2^t) / (1 - b1^t) with bias_correction else
      lr, u = m / (sqrt(v) + eps) + wd w: |dw_i| <= lr max_coeff (C + wd |w_i|), C Adam's
      ratio bound (or the raw EMAs' without bias correction). Sharp.
    - pytorch_optimizer's Lamb (`pytorch_optimizer/optimizer/lamb.py`): phi = min(||w||, 10) /
      (||u|| + eps), s = lr / (1 - b1^t), decay decoupled (w (1 - lr wd)): phi |u_i| <= phi ||u||
      <= min(||w||, 10), so |dw_i| <= s min(||w||, 10) + lr wd |w_i| (phi = 1 where a norm is 0,
      `adam=True`: s C_raw).
    - apex FusedLAMB (`multi_tensor_lamb.cu`): phi = ||w|| / ||u|| unclamped (where decay or
      use_nvlamb), u with the decay inside: |dw_i| <= lr max(||w||, C).

    ||w|| within the window is at most an end's / (1 - s)^k (each step moves the tensor by at
    most s ||w||, forward or back; no bound where s >= 1). The per-element part is sqrt(n) times the typical step
    except DeepSpeed's: located among the tensor's own changes, the tensor held to its
    norm bound (RMS(dw) <= per-element bound / sqrt(n)).
    """
    b1, b2 = betas or (0.9, 0.999)
    k = t_last - t_first + 1
    impl = str(options.get("implementation", ""))
    top = options.get("max_coeff")
    bias = options.get("bias_correction", True)
    c = (
        adam_ratio_bound(b1, b2, t_first, t_last)
        if bias not in (False, 0)
        else raw_ratio_bound(b1, b2, t_last)
    )
    if options.get("grad_averaging") is False:
        c /= 1 - b1  # m = b1 m + g: the EMA without its (1 - b1)
    if isinstance(top, (int, float)) and not isinstance(top, bool) and top > 0:
        return StepBound(
            "lamb",
            lr * c * top,
            lr * wd * top,
            None,
            True,
            "LAMB: trust ratio <= max_coeff times Adam's bound (DeepSpeed FusedLamb)",
        )
    n = max(1, math.prod(shape))
    pyopt = impl.startswith("pytorch_optimizer")
    s = lr / (1 - b1**t_first) if pyopt else lr
    norm = math.sqrt(n) * rms_w / (1 - s) ** k if s < 1 else math.inf
    if pyopt:
        c_raw = raw_ratio_bound(b1, b2, t_last) / (
            1 if options.get("grad_averaging", True) else 1 - b1
        )
        reach = max(min(norm, 10.0), c_raw) if not options.get("adam") else c_raw
        per = s * reach
        decay = lr * wd if options.get("weight_decouple", True) else 0.0
        return StepBound(
            "lamb",
            per,
            decay,
            per / math.sqrt(n),
            False,
            "LAMB: |dw| <= lr/(1-b1^t) min(||w||, 10) per step (pytorch_optimizer Lamb, You et al. 2020 Alg. 2)",
        )
    per = lr * max(norm, c)
    return StepBound(
        "lamb",
        per,
        0.0,
        per / math.sqrt(n),
        False,
        "LAMB: ||dw|| <= lr ||w|| per step (apex FusedLAMB, unclamped trust ratio; You et al. 2020 Alg. 2)",
    )


def quantised_floor_allowance(k: int, gap: float) -> float:
    """How far below b2^k v_A an 8-bit second moment may sit after k steps, in units of the
    block's absmax at the window's end.

    Each step computes V_t = b2 D_{t-1} + (1 - b2) g^2 >= b2 D_{t-1} in fp32 and stores
    D_t >= V_t - gap A_t (A_t the block's absmax, a code `gap` wide at most). The block's
    largest element is stored exactly (code 1.0), so A_{t+1} >= b2 A_t and A_t <= A_k b2^-(k-t).
    Unrolled: D_k >= b2^k D_0 - sum_t b2^(k-t) gap A_t >= b2^k D_0 - k gap A_k."""
    return max(0, int(k)) * gap


def _muon_bound(lr: float, wd: float, options: dict[str, Any], shape: tuple[int, ...]) -> StepBound:
    """torch.optim.Muon: w <- w (1 - lr wd) - lr_adj O, O the Newton-Schulz orthogonalisation
    of the momentum. O's singular values are the NS polynomial iterated on values in [0, 1]
    (the input is normalised by its Frobenius norm), so every element |O_ij| <= ||O||_2 <=
    sup p^(n)([0, 1]) (1.2024 for torch's default coefficients, Keller Jordan's), widened by
    bf16's roundoff per iteration."""
    coeffs = tuple(options.get("ns_coefficients") or (3.4445, -4.7750, 2.0315))
    steps = int(options.get("ns_steps") or 5)
    sigma = ns_sup(coeffs, steps) * (1 + steps * _BF16_U)  # type: ignore[arg-type]
    a, b = (shape[0], shape[1]) if len(shape) >= 2 else (1, 1)
    fn = options.get("adjust_lr_fn")
    # torch/optim/_muon.py `_adjust_lr`: 'original' sqrt(max(1, A/B)); 'match_rms_adamw' 0.2 sqrt(max(A, B)).
    adj = 0.2 * math.sqrt(max(a, b)) if fn == "match_rms_adamw" else math.sqrt(max(1.0, a / b))
    return StepBound(
        "muon",
        lr * adj * sigma,
        lr * wd,
        lr * adj * sigma,
        True,
        "Muon: |O_ij| <= ||O||_2 <= sup of the Newton-Schulz polynomial (torch.optim.Muon)",
    )


@lru_cache(maxsize=8)
def ns_sup(coeffs: tuple[float, float, float], steps: int) -> float:
    """sup over x in [0, 1] of the quintic Newton-Schulz map x -> a x + b x^3 + c x^5 applied
    `steps` times: the largest singular value Muon's orthogonalised update can have."""
    a, b, c = coeffs
    x = np.linspace(0.0, 1.0, 200_001)
    y = x.copy()
    for _ in range(steps):
        y = a * y + b * y**3 + c * y**5
    return float(np.abs(y).max())


def adafactor_step_size(options: dict[str, Any], lr: float, t: int, rms_w: float) -> float:
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


def _adafactor_bound(
    lr: float,
    wd: float,
    options: dict[str, Any],
    t_first: int,
    shape: tuple[int, ...],
    rms_w: float,
) -> StepBound:
    """Adafactor clips its update to RMS <= d (torch) / clip_threshold (transformers) before the
    step size (Shazeer & Stern 2018, §6 update clipping); a first moment (transformers'
    beta1) averages clipped updates, so its RMS stays under the same bound. Per element
    |x_i| <= sqrt(n) RMS(x): loose, so a corrupted element is located among the tensor's own
    changes, and the tensor as a whole is held to the RMS bound."""
    alpha = adafactor_step_size(
        options, lr, t_first, rms_w
    )  # decreasing in t: the first step's is the largest
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


def second_moment_floor(
    family: str,
    betas: tuple[float, float] | None,
    options: dict[str, Any],
    t_first: int,
    t_last: int,
) -> float | None:
    """The least factor a second moment can keep over optimizer steps t_first..t_last.

    Adam / LAMB: v_B >= beta2^k v_A (each step adds (1 - beta2) g^2 >= 0). Adafactor: each
    step mixes with weight 1 - beta2_t = t^c (c = beta2_decay / decay_rate, -0.8), so its
    rows, columns and vector variances keep at least prod_t (1 - t^c) (Shazeer & Stern
    2018, §7; torch `lerp_`, transformers `mul_(beta2t)`). None where the family has none.
    """
    t_first = max(1, int(t_first))
    t_last = int(t_last)
    if t_last < t_first:
        return 1.0
    if family in MOMENT_FAMILIES:
        b2 = (betas or (0.9, 0.999))[1]
        return b2 ** (t_last - t_first + 1)
    if family == "adafactor":
        c = float(options.get("beta2_decay", options.get("decay_rate", -0.8)))
        ts = np.arange(t_first, t_last + 1, dtype=np.float64)
        return float(np.prod(1.0 - np.power(ts, c)))
    return None


# The second-moment tensors each family keeps (Adafactor: torch's row_var / col_var / variance,
# transformers' exp_avg_sq_row / exp_avg_sq_col / exp_avg_sq).
SECOND_MOMENTS = {
    "adam": ("exp_avg_sq",),
    "lamb": ("exp_avg_sq",),
    "adam8bit": ("exp_avg_sq",),
    "adafactor": (
        "row_var",
        "col_var",
        "variance",
        "exp_avg_sq_row",
        "exp_avg_sq_col",
        "exp_avg_sq",
    ),
}


def replay_bound(
    group: dict[str, Any],
    state: dict[str, Any],
    k: int,
    lr: float,
    shape: tuple[int, ...],
    rms_w: float = 0.0,
) -> tuple[float, float]:
    """(c, wd) of a rebuilt optimizer's param group such that k steps move an element by at
    most k lr (c + wd |w|): the bound `replay` holds its replayed weights to (the group's
    `family`, set by `replay.optimizer.build_optimizer`; Adam where it is absent)."""
    family = str(group.get("family", "adam"))
    end = group.get("step", state.get("step"))  # pytorch_optimizer counts in the group
    t_end = int(float(end)) if end is not None else k
    options = {
        kk: v
        for kk, v in group.items()
        if kk not in ("params", "lr", "betas", "weight_decay", "eps")
    }
    eps = group.get("eps")
    if isinstance(eps, (tuple, list)):
        options["eps2"] = eps[1]
    lr_ = lr if lr and math.isfinite(lr) and lr > 0 else 1.0
    b = step_bound(
        family, lr=lr_, weight_decay=float(group.get("weight_decay") or 0.0), betas=tuple(group["betas"]) if group.get("betas") else None,  # type: ignore[arg-type]
        options=options, t_first=max(1, t_end - k + 1), t_last=t_end, shape=shape, rms_w=rms_w,
    )  # fmt: skip
    return b.per_step / lr_, b.decay / lr_
