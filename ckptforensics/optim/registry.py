"""The optimizer families the tool knows: one ordered registry of `Family` records (one module
each, `optim/<family>.py`) that refuses duplicates, and what reads it by a family's name:
the per-step bound, the second moment's floor, a rebuilt group's bound for the replay.

A new optimizer family is one module and one line in `FAMILIES` below."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ckptforensics.optim import adafactor, adam, adam8bit, lamb, lion, muon, sgd
from ckptforensics.optim.base import Family
from ckptforensics.optim.updates import StepBound, unbounded

__all__ = [
    "FAMILIES",
    "DEFAULT",
    "OPTIONS",
    "family",
    "find",
    "registry",
    "step_bound",
    "second_moment_floor",
    "replay_bound",
]


def registry(*families: Family) -> Mapping[str, Family]:
    """The families by name, in the order given (read-only).

    Raises:
        ValueError: two families share a name, or claim the same group options.
    """
    out: dict[str, Family] = {}
    marks: dict[frozenset[str], str] = {}
    for f in families:
        if f.name in out:
            raise ValueError(f"optimizer family {f.name!r} registered twice")
        for m, _ in f.marks:
            if m in marks:
                raise ValueError(
                    f"optimizer families {marks[m]!r} and {f.name!r} both claim the group options {sorted(m)}"
                )
            marks[m] = f.name
        out[f.name] = f
    return MappingProxyType(out)


# In the order reports list them. Recognition asks them in this order too: group options
# first, then state keys; no two families' marks or state layouts overlap in what their
# optimizers save (tests/unit/test_optim_registry.py), so the order decides nothing there.
FAMILIES = registry(
    adam.FAMILY,
    lamb.FAMILY,
    lion.FAMILY,
    adafactor.FAMILY,
    muon.FAMILY,
    sgd.FAMILY,
    adam8bit.FAMILY,
)

# The family of a state that shows Adam's two moments and nothing else, and of a group that
# names no family: readers that map state themselves (DCP, DeepSpeed, Megatron) hold Adam's.
DEFAULT = adam.FAMILY

# Every option any family reads, read from every group (`families.group_hyper`).
OPTIONS = tuple(dict.fromkeys(o for f in FAMILIES.values() for o in f.options))


def family(name: str) -> Family:
    """The registered family called `name`.

    Raises:
        KeyError: no family of that name (names the known ones).
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"no optimizer family {name!r} (known: {', '.join(FAMILIES)})") from None


def find(name: str | None) -> Family | None:
    """The registered family called `name`; None for 'none', 'unknown:...' and ''."""
    return FAMILIES.get(name) if name else None


def step_bound(
    name: str,
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
    """The per-step bound of family `name` over optimizer steps t_first..t_last
    (`Family.update_bound`); none for a family the tool does not know."""
    f = find(name)
    if f is None:
        return unbounded(name)
    return f.update_bound(
        lr=lr, weight_decay=weight_decay, betas=betas, options=options, t_first=t_first,
        t_last=t_last, shape=shape, rms_w=rms_w,
    )  # fmt: skip


def second_moment_floor(
    name: str,
    betas: tuple[float, float] | None,
    options: dict[str, Any],
    t_first: int,
    t_last: int,
) -> float | None:
    """The least factor family `name`'s second moment can keep over optimizer steps
    t_first..t_last (`Family.second_moment_floor`): Adam / LAMB beta2^k, Adafactor
    prod_t (1 - t^c); None where the family keeps none or is not known."""
    f = find(name)
    if f is not None:
        return f.second_moment_floor(betas, options, t_first, t_last)
    return 1.0 if int(t_last) < max(1, int(t_first)) else None


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
    name = str(group.get("family", DEFAULT.name))
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
        name, lr=lr_, weight_decay=float(group.get("weight_decay") or 0.0), betas=tuple(group["betas"]) if group.get("betas") else None,  # type: ignore[arg-type]
        options=options, t_first=max(1, t_end - k + 1), t_last=t_end, shape=shape, rms_w=rms_w,
    )  # fmt: skip
    return b.per_step / lr_, b.decay / lr_
