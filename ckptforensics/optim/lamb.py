"""LAMB, told apart per implementation by its own group options (DeepSpeed's FusedLamb,
pytorch_optimizer's Lamb, apex's FusedLAMB; each saves Adam's two moments), bounded through
its trust ratio, replayed with pytorch_optimizer's Lamb (the other two are CUDA ops)."""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.tensors import adam_ratio_bound
from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import construct, constructor_args, group_values
from ckptforensics.optim.updates import StepBound, ema_floor, raw_ratio_bound

__all__ = ["FAMILY"]


def _bound(
    *,
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


def _floor(betas: Any, options: dict[str, Any], t_first: int, t_last: int) -> float:
    return ema_floor(betas, t_first, t_last)


def _class(impl: str) -> Any:
    if impl.startswith("pytorch_optimizer"):
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ForensicsError(
                "replaying pytorch_optimizer's Lamb needs its package: pip install pytorch_optimizer"
            ) from None
        return Lamb
    if impl:
        raise ForensicsError(
            f"replaying {impl} needs its CUDA op (a fused kernel; no CPU build): the replay rebuilds pytorch_optimizer's Lamb "
            "only; `ckptforensics diff` still checks its LAMB bounds"
        )
    return None


# pytorch_optimizer's Lamb; `pre_norm` is an attribute, not saved: its default (False).
_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "weight_decouple",
    "fixed_decay",
    "rectify",
    "grad_averaging",
    "max_grad_norm",
    "adam",
)


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    return constructor_args(group_values(h, h.eps), _KEYS)


def _optimizer(
    cls: Any, param_groups: list[dict[str, Any]], hypers: list[GroupHyper], where: str
) -> Any:
    o = construct(cls, param_groups, hypers, where)
    for g, h in zip(o.param_groups, hypers, strict=True):
        step = h.options.get("step")
        if isinstance(step, (int, float)):
            # pytorch_optimizer counts steps in the group (its bias correction).
            g["step"] = int(step)
    return o


FAMILY = Family(
    name="lamb",
    title="LAMB",
    marks=(
        (frozenset({"max_coeff", "min_coeff"}), "deepspeed.ops.lamb.FusedLamb"),
        (
            frozenset({"weight_decouple", "rectify", "adam", "max_grad_norm"}),
            "pytorch_optimizer.Lamb",
        ),
        (frozenset({"grad_averaging", "max_grad_norm"}), "apex.optimizers.FusedLAMB"),
    ),
    options=(
        "max_coeff",
        "min_coeff",
        "bias_correction",
        "max_grad_norm",
        "grad_averaging",
        "weight_decouple",
        "fixed_decay",
        "rectify",
        "adam",
        "adam_w_mode",
        "use_nvlamb",
        # pytorch_optimizer's and apex's step counter, kept in the group.
        "step",
    ),
    moments=True,
    second_moments=("exp_avg_sq",),
    bound=_bound,
    floor=_floor,
    weight_scale=lambda options: True,  # the trust ratio's ||w||
    replay_class=_class,
    replay_args=_args,
    replay_optimizer=_optimizer,
    replay_label=lambda impl: impl,
)
