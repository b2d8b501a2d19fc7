"""Map a torch optimizer state_dict (integer ids) onto parameter names, verified by shape."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import CorruptCheckpoint, OptimizerMappingError
from .base import GroupHyper, OptimizerView

__all__ = ["map_optimizer", "hf_no_decay", "group_hyper", "optimizer_kind"]

Param = tuple[str, tuple[int, ...]]

# transformers' Trainer puts these names in the no-decay group (FORMATS.md).
_HF_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def hf_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """HF Trainer's decay rule by name (LayerNorm/RMSNorm params and biases skip decay)."""
    return bool(_HF_NO_DECAY.search(name))


def _dim_rule(name: str, shape: tuple[int, ...]) -> bool:
    """nanoGPT's rule: tensors of dim < 2 (biases, norms) skip decay."""
    return len(shape) < 2


def optimizer_kind(state: dict[Any, dict[str, Any]]) -> str:
    """'adam' when the state holds both Adam moments, 'sgd' for momentum buffers."""
    keys: set[str] = set()
    for s in state.values():
        keys.update(s)
    if {"exp_avg", "exp_avg_sq"} <= keys:
        return "adam"
    if "momentum_buffer" in keys or not keys:
        return "sgd" if keys else "none"
    return "+".join(sorted(keys))


def group_hyper(group: dict[str, Any], index: int) -> GroupHyper:
    betas = group.get("betas")
    return GroupHyper(
        lr=float(_num(group.get("lr", 0.0))),
        betas=(float(_num(betas[0])), float(_num(betas[1]))) if betas is not None else None,
        eps=float(_num(group.get("eps", 1e-8))),
        weight_decay=float(_num(group.get("weight_decay", 0.0))),
        initial_lr=float(_num(group["initial_lr"])) if group.get("initial_lr") is not None else None,
        max_lr=float(_num(group["max_lr"])) if group.get("max_lr") is not None else None,
        index=index,
    )


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _partitions(params: Sequence[Param], sizes: list[int]) -> list[tuple[str, list[list[Param]]]]:
    """Candidate assignments of the model's parameters to the saved param groups."""
    out: list[tuple[str, list[list[Param]]]] = []
    if len(sizes) == 1:
        out.append(("single group", [list(params)]))
        return out
    if len(sizes) == 2:
        for label, rule in (("HF decay/no-decay groups", hf_no_decay), ("dim>=2 / dim<2 groups", _dim_rule)):
            g0 = [p for p in params if not rule(*p)]
            g1 = [p for p in params if rule(*p)]
            out.append((label, [g0, g1]))
    # Groups built by walking the model in order (per-layer LR groups and the like).
    chunks, i = [], 0
    for n in sizes:
        chunks.append(list(params[i : i + n]))
        i += n
    out.append(("groups in model order", chunks))
    return out


def map_optimizer(
    osd: dict[str, Any],
    params: Sequence[Param],
    source: str,
) -> OptimizerView:
    """Key a `torch.optim` state_dict by parameter name.

    Args:
        osd: `optimizer.state_dict()` as saved: `state` keyed by int ids, `param_groups`.
        params: trainable parameters in the model's `named_parameters()` order
            (tied weights once), with shapes.
        source: file name for error messages.

    Returns:
        The OptimizerView. Ids are matched by each group's order against the model's
        order under the grouping rules trainers use; every id with state is verified
        by shape, and the rules that verify must agree.

    Raises:
        OptimizerMappingError: no rule verifies, or two rules verify and disagree.
        CorruptCheckpoint: the state_dict lacks `state` / `param_groups`.
    """
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise CorruptCheckpoint(f"{source}: not a torch optimizer state_dict (no 'state'/'param_groups')")
    state: dict[Any, dict[str, Any]] = osd["state"]
    groups: list[dict[str, Any]] = osd["param_groups"]
    hypers = [group_hyper(g, i) for i, g in enumerate(groups)]
    kind = optimizer_kind(state)

    # 1) Names saved with the groups (torch optimizers built from named parameters).
    if all(g.get("param_names") for g in groups):
        id_to_name = {}
        for g in groups:
            id_to_name.update(dict(zip(g["params"], g["param_names"], strict=True)))
        return _view(kind, state, groups, hypers, id_to_name, "param_names")

    sizes = [len(g["params"]) for g in groups]
    verified: list[tuple[str, dict[Any, str]]] = []
    failures: list[str] = []
    for label, parts in _partitions(params, sizes):
        mapping, why = _try(parts, groups, state)
        if mapping is None:
            failures.append(f"{label}: {why}")
        else:
            verified.append((label, mapping))
    if not verified:
        raise OptimizerMappingError(
            f"{source}: cannot map optimizer ids to parameter names ({len(params)} trainable parameters, "
            f"groups of {sizes}); {failures[0]}. Pass the matching model (--model) or a checkpoint that stores param_names"
        )
    first_label, first = verified[0]
    for label, other in verified[1:]:
        if other != first:
            diff = next(i for i in first if first[i] != other.get(i))
            raise OptimizerMappingError(
                f"{source}: optimizer ids map ambiguously ({first_label} gives id {diff} = {first[diff]}, "
                f"{label} gives {other.get(diff)}); refusing to guess"
            )
    return _view(kind, state, groups, hypers, first, first_label)


def _try(
    parts: list[list[Param]],
    groups: list[dict[str, Any]],
    state: dict[Any, dict[str, Any]],
) -> tuple[dict[Any, str] | None, str]:
    mapping: dict[Any, str] = {}
    for gi, (part, g) in enumerate(zip(parts, groups, strict=True)):
        ids = g["params"]
        if len(part) != len(ids):
            return None, f"group {gi} holds {len(ids)} ids, the rule gives {len(part)} parameters"
        for pid, (name, shape) in zip(ids, part, strict=True):
            st = state.get(pid)
            if st:
                t = st.get("exp_avg", st.get("momentum_buffer"))
                if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(shape):
                    return None, (
                        f"id {pid} in group {gi} has state of shape {tuple(t.shape)} but {name} is {tuple(shape)}"
                    )
            mapping[pid] = name
    return mapping, ""


def _view(
    kind: str,
    state: dict[Any, dict[str, Any]],
    groups: list[dict[str, Any]],
    hypers: list[GroupHyper],
    id_to_name: dict[Any, str],
    label: str,
) -> OptimizerView:
    by_name: dict[str, dict[str, Any]] = {}
    hyper: dict[str, GroupHyper] = {}
    for gi, g in enumerate(groups):
        for pid in g["params"]:
            name = id_to_name[pid]
            hyper[name] = hypers[gi]
            if pid in state and state[pid]:
                by_name[name] = state[pid]
    return OptimizerView(kind=kind, state=by_name, hyper=hyper, groups=hypers, mapping=label)


def trainable_order(
    names: Sequence[str],
    meta: Callable[[str], tuple[tuple[int, ...], torch.dtype]],
    aliases: dict[str, str],
) -> list[Param]:
    """Parameter order from a state_dict's order: floats only, tied aliases once.

    `aliases` maps a name to the earlier name sharing its storage (tied weights);
    named_parameters() yields a shared parameter once, at its first owner.
    """
    out: list[Param] = []
    for n in names:
        if n in aliases:
            continue
        shape, dtype = meta(n)
        if not dtype.is_floating_point or _is_buffer_name(n):
            continue
        out.append((n, shape))
    return out


_BUFFER_SUFFIXES = ("inv_freq", "running_mean", "running_var", "num_batches_tracked", "masked_bias", ".attn.bias", "_float_tensor")


def _is_buffer_name(name: str) -> bool:
    """Buffers that state_dicts carry but optimizers never see."""
    return name.endswith(_BUFFER_SUFFIXES)
