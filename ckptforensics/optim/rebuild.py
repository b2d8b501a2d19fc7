"""What the replay's rebuild of every family shares: a saved group's values under its class's
own argument names, the class built from the saved groups, a parameter's state in fp32 on
its device."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.optim.hyper import GroupHyper

__all__ = [
    "group_values",
    "constructor_args",
    "construct",
    "float_state",
    "state_with_step",
    "finite_or",
]

# State tensors saved with the parameter's shape (whatever the shape they were saved in).
_PARAM_SHAPED = ("exp_avg", "exp_avg_sq", "momentum_buffer", "variance")


def group_values(h: GroupHyper, eps: Any) -> dict[str, Any]:
    """A saved group's values by name: lr, betas, weight_decay, the family's options as
    saved, and `eps` as the class takes it."""
    return {
        "lr": h.lr,
        "betas": h.betas,
        "weight_decay": h.weight_decay,
        **{k: v for k, v in h.options.items() if k != "implementation"},
        "eps": eps,
    }


def constructor_args(
    vals: dict[str, Any], keys: Iterable[str], keep_none: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The constructor arguments among `vals` that the class takes (`keys`, its own names); a
    None means "the class's default" and is left out, except for the names in `keep_none`."""
    return {k: vals[k] for k in keys if k in vals and (vals[k] is not None or k in keep_none)}


def construct(
    cls: Any, param_groups: list[dict[str, Any]], hypers: list[GroupHyper], where: str
) -> torch.optim.Optimizer:
    """`cls(param_groups)`; a class that refuses the saved groups is named in one line.

    Raises:
        ForensicsError: the class refused the saved groups' arguments.
    """
    try:
        return cls(param_groups)
    except (TypeError, ValueError) as e:
        raise ForensicsError(
            f"{where}: cannot rebuild {cls.__name__} from the saved param groups ({e})"
        ) from None


def float_state(st: dict[str, Any], p: torch.Tensor, impl: str = "") -> dict[str, Any]:
    """One parameter's saved state as torch's classes keep it: tensors in fp32 on the
    parameter's device (moments saved in bf16 widened, a flattened moment in the parameter's
    shape), `step` a float tensor."""
    return state_with_step(st, p, lambda v: torch.tensor(float(v)))


def state_with_step(st: dict[str, Any], p: torch.Tensor, step: Any) -> dict[str, Any]:
    """`float_state` with `step` kept as `step(saved)` makes it (transformers' Adafactor: an int)."""
    out: dict[str, Any] = {}
    for k, v in st.items():
        if k == "step":
            out[k] = step(v)
        elif isinstance(v, torch.Tensor):
            t = v.to(p.device, torch.float32).clone()
            out[k] = t.view_as(p) if t.numel() == p.numel() and k in _PARAM_SHAPED else t
        else:
            out[k] = v
    return out


def finite_or(x: float, default: Any) -> Any:
    """x where it is finite, else `default` (an eps saved as None reads NaN: `GroupHyper.eps`)."""
    return x if math.isfinite(x) else default
