"""SGD with momentum (torch's): recognised by its `dampening` option or its momentum buffer;
no bound on a step (it scales with the gradient), an element's move held to its buffers;
replayed with torch's SGD."""

from __future__ import annotations

from typing import Any

import torch

from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import constructor_args, group_values
from ckptforensics.optim.updates import StepBound, unbounded

__all__ = ["FAMILY"]


def recognise(keys: set[str], group: dict[str, Any]) -> tuple[str, str] | None:
    return ("sgd", "torch.optim.SGD") if "momentum_buffer" in keys else None


def _bound(**_: Any) -> StepBound:
    return unbounded("sgd")


_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    return constructor_args(group_values(h, h.eps), _KEYS)


FAMILY = Family(
    name="sgd",
    title="SGD",
    marks=((frozenset({"dampening"}), "torch.optim.SGD"),),
    recognise=recognise,
    options=("momentum", "dampening", "nesterov", "maximize"),
    bound=_bound,
    update_buffer="momentum_buffer",
    replay_class=lambda impl: torch.optim.SGD,
    replay_args=_args,
    replay_label=lambda impl: "torch.optim.SGD",
)
