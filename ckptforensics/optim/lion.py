"""Lion (lion-pytorch): recognised by its lone `exp_avg` beside `betas`, a sign update that
moves every element by exactly lr, replayed with lion-pytorch's own class."""

from __future__ import annotations

from typing import Any

from ckptforensics.core.errors import ForensicsError
from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import constructor_args, group_values
from ckptforensics.optim.updates import StepBound

__all__ = ["FAMILY"]


def recognise(keys: set[str], group: dict[str, Any]) -> tuple[str, str] | None:
    return ("lion", "lion-pytorch") if keys == {"exp_avg"} and "betas" in group else None


def _bound(*, lr: float, wd: float, options: dict[str, Any], **_: Any) -> StepBound:
    """update = sign(...): |Δw_i| = lr exactly, plus the decoupled decay lr wd |w_i|
    (Chen et al. 2023, arXiv 2302.06675, Alg. 2; lion-pytorch `update_fn`)."""
    wd_eff = (
        wd / options["init_lr"]
        if options.get("decoupled_weight_decay") and options.get("init_lr")
        else wd
    )
    return StepBound(
        "lion",
        lr,
        lr * wd_eff,
        lr,
        True,
        "Lion: sign update, |dw| = lr (1 + wd |w|) (Chen et al. 2023)",
    )


def _class(impl: str) -> Any:
    try:
        from lion_pytorch import Lion
    except ImportError:
        raise ForensicsError("replaying Lion needs its package: pip install lion-pytorch") from None
    return Lion


_KEYS = ("lr", "betas", "weight_decay")


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    return constructor_args(group_values(h, h.eps), _KEYS)


FAMILY = Family(
    name="lion",
    title="Lion",
    recognise=recognise,
    options=("decoupled_weight_decay",),
    bound=_bound,
    replay_class=_class,
    replay_args=_args,
    replay_label=lambda impl: "lion_pytorch.Lion",
)
