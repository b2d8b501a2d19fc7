"""A saved optimizer's families, each group told apart by what its own code saves (the
registry's `marks` and `recognise`), each group's options read as a `GroupHyper`; several
optimizers' state_dicts merged into one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.registry import DEFAULT, FAMILIES, OPTIONS

__all__ = [
    "FAMILIES",
    "optimizer_family",
    "optimizer_kind",
    "group_family",
    "group_hyper",
    "merge_optimizers",
    "is_number",
]


def optimizer_family(keys: set[str], group: dict[str, Any] | None = None) -> tuple[str, str]:
    """(family, implementation) of one param group from its options and its state's keys.

    Group options decide first (Adafactor with `beta1` saves `exp_avg` and `exp_avg_sq` for
    vectors, as Adam does; LAMB saves Adam's moments): each family's `marks`; then the
    state's keys, each family's `recognise` (Adam's `exp_avg` + `exp_avg_sq`, Lion's lone
    `exp_avg`, Adafactor's factored rows/columns, a momentum buffer, bitsandbytes'
    quantised `state1`/`state2`), in registry order. 'none' for a group without state or
    options that say; 'unknown:<keys>' otherwise.
    """
    g = set(group or ())
    for f in FAMILIES.values():
        for marks, impl in f.marks:
            if marks <= g:
                return f.name, impl
    for f in FAMILIES.values():
        found = f.recognise(keys, group or {})
        if found is not None:
            return found
    if not keys:
        return "none", ""
    return f"unknown:{','.join(sorted(keys))}", ""


def optimizer_kind(
    state: dict[Any, dict[str, Any]], groups: list[dict[str, Any]] | None = None
) -> str:
    """The families of a state_dict's groups joined by '+' in group order ('adam',
    'muon+adam'); groups without state take the family their options name, or none."""
    keys: set[str] = set()
    for s in state.values():
        keys.update(s)
    if not groups:
        return optimizer_family(keys)[0]
    fams = [group_family(g, state)[0] for g in groups]
    known = [f for f in fams if f != "none"]
    return "+".join(dict.fromkeys(known)) if known else "none"


def group_family(group: dict[str, Any], state: dict[Any, dict[str, Any]]) -> tuple[str, str]:
    keys: set[str] = set()
    for pid in group.get("params", ()):
        keys.update(state.get(pid) or ())
    if not keys and not any(m <= set(group) for f in FAMILIES.values() for m, _ in f.marks):
        # A group without state yet (no step taken): the family of the state saved elsewhere.
        for s in state.values():
            keys.update(s)
    return optimizer_family(keys, group)


def group_hyper(
    group: dict[str, Any], index: int, family: tuple[str, str] | None = None
) -> GroupHyper:
    """One saved param group as a GroupHyper, whatever its family.

    Adafactor's `eps` is a pair (eps1 for the second moment, eps2 the floor of the
    parameter scale): eps1 becomes `eps` (NaN where torch leaves it None: the dtype's
    machine epsilon) and eps2 an option. transformers' Adafactor with `relative_step`
    saves `lr=None`: NaN here, its step size is a function of the step (`tensors`).
    """
    betas = group.get("betas")
    eps = group.get("eps", 1e-8)
    opts = {k: _plain(group[k]) for k in OPTIONS if k in group}
    if isinstance(eps, (tuple, list)):
        opts["eps2"] = _opt_num(eps[1]) if len(eps) > 1 else None
        eps = eps[0]
    fam, impl = family or optimizer_family(set(), group)
    if family is None and fam == "none" and betas is not None:
        # Readers that map state themselves (DCP, DeepSpeed, Megatron) hold Adam's.
        fam = DEFAULT.name
    opts["implementation"] = impl
    return GroupHyper(
        lr=_opt_num(group.get("lr", 0.0), math.nan),
        betas=(float(_num(betas[0])), float(_num(betas[1])))
        if isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_number(b) for b in betas)
        else None,
        eps=_opt_num(eps, math.nan),
        weight_decay=_opt_num(group.get("weight_decay", 0.0), 0.0),
        initial_lr=float(_num(group["initial_lr"])) if is_number(group.get("initial_lr")) else None,
        max_lr=float(_num(group["max_lr"])) if is_number(group.get("max_lr")) else None,
        index=index,
        fused=bool(group["fused"]) if isinstance(group.get("fused"), bool) else None,
        family=fam,
        options=opts,
        optimizer=int(group.get(_OPTIMIZER_KEY, 0)),
    )


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _opt_num(x: Any, default: float = math.nan) -> float:
    """A number that may be None (torch Adafactor's eps1, HF Adafactor's relative-step lr)."""
    if x is None or isinstance(x, bool):
        return default
    try:
        return _num(x)
    except (TypeError, ValueError):
        return default


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else None
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else repr(x)


# Marks the optimizer a group came from when several are merged (`merge_optimizers`).
_OPTIMIZER_KEY = "__ckptforensics_optimizer__"


def merge_optimizers(osds: Sequence[dict[str, Any]], source: str) -> dict[str, Any]:
    """Several optimizers' state_dicts (a Muon run's Muon + AdamW, Lightning's
    `optimizer_states`) as one: groups in order, ids renumbered past the previous
    optimizer's, each group marked with its optimizer's position."""
    state: dict[Any, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    offset = 0
    for i, osd in enumerate(osds):
        if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
            raise CorruptCheckpoint(
                f"{source}[{i}]: not a torch optimizer state_dict (no 'state'/'param_groups')"
            )
        ids = [pid for g in osd["param_groups"] for pid in g["params"]]
        remap = {pid: offset + j for j, pid in enumerate(ids)}
        for pid, st in osd["state"].items():
            if pid in remap:
                state[remap[pid]] = st
        for g in osd["param_groups"]:
            groups.append({**g, "params": [remap[p] for p in g["params"]], _OPTIMIZER_KEY: i})
        offset += len(ids)
    return {"state": state, "param_groups": groups}


def is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (
        isinstance(x, torch.Tensor) and x.numel() == 1
    )
