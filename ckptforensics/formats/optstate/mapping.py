"""Optimizer ids onto parameter names by the grouping rules trainers use, each verified by
the saved state's shapes; the `OptimizerView` the mapping keys by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptforensics import optim
from ckptforensics.core.errors import CorruptCheckpoint, OptimizerMappingError
from ckptforensics.formats.base import GroupHyper, OptimizerView
from ckptforensics.formats.optstate.order import Param, order_preserving
from ckptforensics.optim import bnb
from ckptforensics.optim.families import group_family, group_hyper, is_number, optimizer_kind

# A rule that splits a model's parameters into two param groups: (name, shape) -> True for
# the second (no-decay) group.
GroupRule = Callable[[str, tuple[int, ...]], bool]


def _dim_rule(name: str, shape: tuple[int, ...]) -> bool:
    """nanoGPT's rule: tensors of dim < 2 (biases, norms) skip decay."""
    return len(shape) < 2


# The two-group rules tried, in order: (order, label, rule). The dim rule is built in; a
# trainer registers its own (`register_group_rule`) as its package loads.
_GROUP_RULES: list[tuple[float, str, GroupRule]] = [(2.0, "dim>=2 / dim<2 groups", _dim_rule)]


def register_group_rule(label: str, rule: GroupRule, order: float = 1.0) -> None:
    """Add a trainer's rule for splitting its parameters into two groups (its label names the
    mapping it gives); asked in `order` (the dim rule's is 2). Registering a label again
    changes nothing."""
    if any(lb == label for _, lb, _ in _GROUP_RULES):
        return
    _GROUP_RULES.append((order, label, rule))
    _GROUP_RULES.sort(key=lambda e: e[0])


_FULL_SHAPED = ("exp_avg", "exp_avg_sq", "momentum_buffer", "variance", "state1")


def param_shape_of(st: dict[str, Any] | None) -> tuple[int, ...] | None:
    """The parameter's shape as its optimizer state shows it: a full-shaped moment, or
    Adafactor's factored rows and columns (torch: [.., R, 1] and [.., 1, C];
    transformers: [.., R] and [.., C])."""
    if not st:
        return None
    for k in _FULL_SHAPED:
        t = st.get(k)
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.dtype != torch.uint8:
            return tuple(t.shape)
    r, c = st.get("row_var"), st.get("col_var")
    if isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) and r.dim() >= 2:
        return tuple(r.shape[:-1]) + tuple(c.shape[-1:])
    r, c = st.get("exp_avg_sq_row"), st.get("exp_avg_sq_col")
    if isinstance(r, torch.Tensor) and isinstance(c, torch.Tensor) and r.dim() >= 1:
        return tuple(r.shape) + tuple(c.shape[-1:])
    return None


def _partitions(params: Sequence[Param], sizes: list[int]) -> list[tuple[str, list[list[Param]]]]:
    """Candidate assignments of the model's parameters to the saved param groups."""
    out: list[tuple[str, list[list[Param]]]] = []
    if len(sizes) == 1:
        out.append(("single group", [list(params)]))
        return out
    if len(sizes) == 2:
        for _, label, rule in _GROUP_RULES:
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
        raise CorruptCheckpoint(
            f"{source}: not a torch optimizer state_dict (no 'state'/'param_groups')"
        )
    osd = {**osd, "state": {pid: bnb.unwrap(st) for pid, st in osd["state"].items()}}
    state: dict[Any, dict[str, Any]] = osd["state"]
    groups: list[dict[str, Any]] = osd["param_groups"]
    hypers = [group_hyper(g, i, group_family(g, state)) for i, g in enumerate(groups)]
    kind = optimizer_kind(state, groups)

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
    if verified and all(m == verified[0][1] for _, m in verified[1:]):
        return _view(kind, state, groups, hypers, verified[0][1], verified[0][0])
    # 2) Any grouping whose groups list parameters in model order (name filters in
    # `configure_optimizers`: no-decay, per-module LR, embeddings apart): every
    # assignment consistent with the shapes of the saved state.
    ids = [list(g["params"]) for g in groups]
    if sum(sizes) == len(params):
        found = order_preserving(params, ids, state_shapes(state))
        if found.mapping is not None:
            return _view(
                kind,
                state,
                groups,
                hypers,
                found.mapping,
                "groups in model order by shape (unique)",
            )
        if found.ambiguous:
            raise AmbiguousMapping(
                PendingMapping(
                    osd=osd, params=list(params), source=source, ambiguous=found.ambiguous
                ),
                f"{source}: optimizer ids map ambiguously: {name_ambiguous(found.ambiguous)} have same-shaped "
                "candidates in several groups; the pair's own updates settle it (diff/replay with --after)",
            )
        failures.append(f"no order-preserving assignment by shape ({found.why})")
    elif not verified:
        failures.append(f"the groups hold {sum(sizes)} ids for {len(params)} trainable parameters")
    if not verified:
        raise OptimizerMappingError(
            f"{source}: cannot map optimizer ids to parameter names ({len(params)} trainable parameters, "
            f"groups of {sizes}); {failures[0]}. Pass the matching model (--model) or a checkpoint that stores param_names"
        )
    first_label, first = verified[0]
    label, other = next((lb, m) for lb, m in verified[1:] if m != first)
    diff = next(i for i in first if first[i] != other.get(i))
    raise OptimizerMappingError(
        f"{source}: optimizer ids map ambiguously ({first_label} gives id {diff} = {first[diff]}, "
        f"{label} gives {other.get(diff)}); refusing to guess"
    )


def name_ambiguous(amb: dict[str, list[Any]]) -> str:
    names = sorted(amb)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def state_shapes(state: dict[Any, dict[str, Any]]) -> dict[Any, tuple[int, ...]]:
    out = {}
    for pid, st in state.items():
        shape = param_shape_of(st)
        if shape is not None:
            out[pid] = shape
    return out


@dataclass(slots=True)
class PendingMapping:
    """An optimizer state_dict that several order-preserving assignments explain.

    Settled by `settle_by_evidence` from a pair of checkpoints of the same run.
    """

    osd: dict[str, Any]
    params: list[Param]
    source: str
    ambiguous: dict[str, list[Any]]


class AmbiguousMapping(OptimizerMappingError):
    """Same-shaped tensors in several groups: the ids need the pair's evidence."""

    def __init__(self, pending: PendingMapping, message: str) -> None:
        super().__init__(message)
        self.pending = pending


def view_from_ids(pending: PendingMapping, id_to_name: dict[Any, str], label: str) -> OptimizerView:
    """The OptimizerView of a pending state_dict under a settled id -> name mapping."""
    osd = pending.osd
    groups = osd["param_groups"]
    hypers = [group_hyper(g, i, group_family(g, osd["state"])) for i, g in enumerate(groups)]
    return _view(
        optimizer_kind(osd["state"], groups), osd["state"], groups, hypers, id_to_name, label
    )


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
            got = param_shape_of(state.get(pid))
            if got is not None and got != tuple(shape):
                return (
                    None,
                    f"id {pid} in group {gi} has state of shape {got} but {name} is {tuple(shape)}",
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
                by_name[name] = _readable(state[pid], g, hypers[gi].family)
    return OptimizerView(kind=kind, state=by_name, hyper=hyper, groups=hypers, mapping=label)


def _readable(st: dict[str, Any], group: dict[str, Any], family: str) -> dict[str, Any]:
    """One parameter's state as the checks read it: bitsandbytes' 8-bit codes with Adam's
    moments dequantised beside them (`bnb.with_moments`); the step counter of optimizers
    that keep it in the param group (pytorch_optimizer's and apex's LAMB) copied in."""
    fam = optim.find(family)
    if fam is not None and fam.bnb_state:
        st = bnb.with_moments(st)
    if "step" not in st and is_number(group.get("step")):
        st = {**st, "step": group["step"]}
    return st


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


_BUFFER_SUFFIXES = (
    "inv_freq",
    "running_mean",
    "running_var",
    "num_batches_tracked",
    "masked_bias",
    ".attn.bias",
    "_float_tensor",
)


def _is_buffer_name(name: str) -> bool:
    """Buffers that state_dicts carry but optimizers never see."""
    return name.endswith(_BUFFER_SUFFIXES)
