"""Optimizer families: each recognised from the state its own code saves, its
hyper-parameters, its update bound (for the diff) and its torch class (for the replay).

One module per family (`adam`, `lamb`, `lion`, `adafactor`, `muon`, `sgd`, `adam8bit`), each
giving one `Family` record; `registry` holds them in one ordered mapping that refuses
duplicates. Code outside asks the registry, never a family's name:

    from ckptforensics import optim
    optim.family("lion").update_bound(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.99),
                                      options={}, t_first=21, t_last=30, shape=(128, 32))

Shared parts: `hyper` (a group's settings as saved), `families` (a saved optimizer's groups
told apart, read, merged), `updates` (the bounds' shared arithmetic), `rebuild` (the
replay's shared construction), `bnb` (bitsandbytes' 8-bit state).
"""

from __future__ import annotations

from ckptforensics.optim.base import Family
from ckptforensics.optim.families import (
    group_family,
    group_hyper,
    merge_optimizers,
    optimizer_family,
    optimizer_kind,
)
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.registry import (
    DEFAULT,
    FAMILIES,
    family,
    find,
    replay_bound,
    second_moment_floor,
    step_bound,
)
from ckptforensics.optim.updates import StepBound

__all__ = [
    "Family",
    "FAMILIES",
    "DEFAULT",
    "family",
    "find",
    "step_bound",
    "second_moment_floor",
    "replay_bound",
    "StepBound",
    "GroupHyper",
    "optimizer_family",
    "optimizer_kind",
    "group_family",
    "group_hyper",
    "merge_optimizers",
]
