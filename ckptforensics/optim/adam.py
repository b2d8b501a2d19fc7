"""Adam and AdamW (torch's, fused and foreach; apex's FusedAdam and DeepSpeed's (CPU)Adam,
which save the same moments): recognised by `exp_avg` + `exp_avg_sq`, bounded by Adam's
ratio bound, replayed with torch's AdamW."""

from __future__ import annotations

from typing import Any

import torch

from ckptforensics.core.tensors import adam_ratio_bound
from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import constructor_args, group_values
from ckptforensics.optim.updates import StepBound, ema_floor

__all__ = ["FAMILY", "adam_bound"]


def recognise(keys: set[str], group: dict[str, Any]) -> tuple[str, str] | None:
    """Adam's two moments; torch's Adam and AdamW save `amsgrad` in every group, apex's
    FusedAdam and DeepSpeed's (CPU)Adam `bias_correction` instead. A torch Adam group
    without state yet (no step taken) is told by its options alone."""
    g = set(group)
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return (
            "adam",
            "torch.optim.Adam(W)"
            if "amsgrad" in g
            else "apex/DeepSpeed Adam"
            if "bias_correction" in g
            else "Adam",
        )
    if not keys and "betas" in g and "amsgrad" in g:
        return "adam", "Adam"
    return None


def adam_bound(
    family: str,
    lr: float,
    wd: float,
    betas: tuple[float, float] | None,
    t_first: int,
    t_last: int,
) -> StepBound:
    """|m_hat| / sqrt(v_hat) <= C over steps t_first..t_last, so |dw_i| <= lr C + lr wd |w_i|
    (Kingma & Ba 2015; Cauchy-Schwarz on the EMAs)."""
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


def _bound(*, lr: float, wd: float, betas: Any, t_first: int, t_last: int, **_: Any) -> StepBound:
    return adam_bound("adam", lr, wd, betas, t_first, t_last)


def _floor(betas: Any, options: dict[str, Any], t_first: int, t_last: int) -> float:
    return ema_floor(betas, t_first, t_last)


# The constructor arguments torch's AdamW takes from a saved group.
_KEYS = ("lr", "betas", "eps", "weight_decay")


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    return constructor_args(group_values(h, h.eps), _KEYS)


def _optimizer(
    cls: Any, param_groups: list[dict[str, Any]], hypers: list[GroupHyper], where: str
) -> torch.optim.Optimizer:
    """The saved implementation: HF Trainer's default is fused AdamW, whose rounding differs."""
    fused = all(h.fused for h in hypers)
    return cls(param_groups, fused=True) if fused else cls(param_groups)


FAMILY = Family(
    name="adam",
    title="Adam",
    recognise=recognise,
    # torch's `amsgrad`, `maximize`, `foreach`, `decoupled_weight_decay`; apex's and
    # DeepSpeed's `bias_correction`.
    options=("amsgrad", "maximize", "decoupled_weight_decay", "foreach", "bias_correction"),
    moments=True,
    second_moments=("exp_avg_sq",),
    bound=_bound,
    floor=_floor,
    replay_class=lambda impl: torch.optim.AdamW,
    replay_args=_args,
    replay_optimizer=_optimizer,
    replay_label=lambda impl: "AdamW",
    sharded_replay=True,
)
