"""Map a torch optimizer state_dict (integer ids) onto parameter names, verified by shape."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpoint, OptimizerMappingError
from .base import GroupHyper, OptimizerView

__all__ = [
    "map_optimizer",
    "hf_no_decay",
    "group_hyper",
    "optimizer_kind",
    "order_preserving",
    "AmbiguousMapping",
    "PendingMapping",
    "settle_by_evidence",
    "view_from_ids",
]

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
    group = _numbers_only(group)
    betas = group.get("betas")
    return GroupHyper(
        lr=float(_num(group.get("lr", 0.0))),
        betas=(float(_num(betas[0])), float(_num(betas[1]))) if betas is not None else None,
        eps=float(_num(group.get("eps", 1e-8))),
        weight_decay=float(_num(group.get("weight_decay", 0.0))),
        initial_lr=float(_num(group["initial_lr"])) if group.get("initial_lr") is not None else None,
        max_lr=float(_num(group["max_lr"])) if group.get("max_lr") is not None else None,
        index=index,
        fused=bool(group["fused"]) if isinstance(group.get("fused"), bool) else None,
    )


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (isinstance(x, torch.Tensor) and x.numel() == 1)


def _numbers_only(group: dict[str, Any]) -> dict[str, Any]:
    """The group with hyper-parameters that are not plain numbers (Adafactor's `eps` pair,
    its relative-step `lr=None`) read as unknown: NaN for lr, eps and weight decay, absent
    for the optional ones, no betas unless a pair of numbers. Never a TypeError."""
    out = dict(group)
    for k in ("lr", "eps", "weight_decay"):
        if k in out and not _is_number(out[k]):
            out[k] = math.nan
    for k in ("initial_lr", "max_lr"):
        if out.get(k) is not None and not _is_number(out[k]):
            del out[k]
    b = out.get("betas")
    if b is not None and not (isinstance(b, (tuple, list)) and len(b) == 2 and all(_is_number(x) for x in b)):
        out["betas"] = None
    return out


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
    if verified and all(m == verified[0][1] for _, m in verified[1:]):
        return _view(kind, state, groups, hypers, verified[0][1], verified[0][0])
    # 2) Any grouping whose groups list parameters in model order (name filters in
    # `configure_optimizers`: no-decay, per-module LR, embeddings apart): every
    # assignment consistent with the shapes of the saved state.
    ids = [list(g["params"]) for g in groups]
    if sum(sizes) == len(params):
        found = order_preserving(params, ids, _state_shapes(state))
        if found.mapping is not None:
            return _view(kind, state, groups, hypers, found.mapping, "groups in model order by shape (unique)")
        if found.ambiguous:
            raise AmbiguousMapping(
                PendingMapping(osd=osd, params=list(params), source=source, ambiguous=found.ambiguous),
                f"{source}: optimizer ids map ambiguously: {_name_ambiguous(found.ambiguous)} have same-shaped "
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


def _name_ambiguous(amb: dict[str, list[Any]]) -> str:
    names = sorted(amb)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _state_shapes(state: dict[Any, dict[str, Any]]) -> dict[Any, tuple[int, ...]]:
    out = {}
    for pid, st in state.items():
        t = st.get("exp_avg", st.get("momentum_buffer")) if st else None
        if isinstance(t, torch.Tensor):
            out[pid] = tuple(t.shape)
    return out


@dataclass(frozen=True, slots=True)
class Assignment:
    """Result of `order_preserving`.

    Attributes:
        mapping: id -> name when exactly one assignment fits (or evidence chose one).
        ambiguous: name -> the ids it could hold, when several assignments fit.
        why: why none fits.
        margins: with a score, name -> how much the best assignment beats the best one
            that gives this name another id.
    """

    mapping: dict[Any, str] | None
    ambiguous: dict[str, list[Any]]
    why: str = ""
    margins: dict[str, float] = field(default_factory=dict)


_MAX_STATES = 2_000_000


def order_preserving(
    params: Sequence[Param],
    ids: list[list[Any]],
    shapes: dict[Any, tuple[int, ...]],
    score: Callable[[str, Any], float] | None = None,
) -> Assignment:
    """Assign parameters (model order) to groups whose id lists keep model order.

    A state is how far each group's id list has been consumed; parameter i = the sum
    of those counts goes to any group whose next id has its shape (an id without state
    fits any shape). The graph has at most prod(len(group)+1) states. With `score`
    (evidence for name holding id), the assignment of highest total score is returned.

    Returns:
        Assignment: the mapping if unique (or chosen by score), else the candidates.
    """
    k = len(ids)
    sizes = tuple(len(g) for g in ids)
    if math.prod(s + 1 for s in sizes) > _MAX_STATES:
        return Assignment(None, {}, f"{k} groups of {list(sizes)} are too many to enumerate")

    State = tuple[int, ...]

    def moves(i: int, st: State) -> list[tuple[State, Any]]:
        """(next state, id) for each group whose next id can hold parameter i."""
        out = []
        for g in range(k):
            c = st[g]
            if c < sizes[g]:
                want = shapes.get(ids[g][c])
                if want is None or want == tuple(params[i][1]):
                    out.append((st[:g] + (c + 1,) + st[g + 1 :], ids[g][c]))
        return out

    # Forward: the states reachable after assigning the first i parameters.
    start: State = (0,) * k
    layers: list[set[State]] = [{start}]
    for i in range(len(params)):
        nxt = {to for st in layers[-1] for to, _ in moves(i, st)}
        if not nxt:
            name, shape = params[i]
            return Assignment(None, {}, f"{name} {tuple(shape)} fits no group's next id")
        layers.append(nxt)
    if sizes not in layers[-1]:
        return Assignment(None, {}, "the groups' ids cannot all be consumed")
    # Backward: keep the moves that still reach the end; they list each parameter's ids.
    live: set[State] = {sizes}
    layer_edges: list[list[tuple[State, State, Any]]] = [[] for _ in params]
    for i in range(len(params) - 1, -1, -1):
        layer_edges[i] = [(st, to, pid) for st in layers[i] for to, pid in moves(i, st) if to in live]
        live = {st for st, _, _ in layer_edges[i]}
    cand = [{pid for _, _, pid in es} for es in layer_edges]
    ambiguous = {params[i][0]: sorted(v, key=str) for i, v in enumerate(cand) if len(v) > 1}
    if ambiguous and score is None:
        return Assignment(None, ambiguous)

    # One path (or the best-scoring one): forward and backward best scores over the live
    # moves; the best path through a move is F(from) + w + G(to), so each parameter's
    # margin (best path minus the best that gives it another id) costs no extra search.
    def weight(i: int, pid: Any) -> float:
        name = params[i][0]
        return score(name, pid) if score is not None and name in ambiguous else 0.0

    fwd: dict[State, float] = {start: 0.0}
    back: dict[State, tuple[State, Any]] = {}
    for i, es in enumerate(layer_edges):
        for st, to, pid in es:
            v = fwd[st] + weight(i, pid)
            if to not in fwd or v > fwd[to]:
                fwd[to] = v
                back[to] = (st, pid)
    bwd: dict[State, float] = {sizes: 0.0}
    for i in range(len(params) - 1, -1, -1):
        for st, to, pid in layer_edges[i]:
            v = bwd[to] + weight(i, pid)
            if st not in bwd or v > bwd[st]:
                bwd[st] = v
    mapping: dict[Any, str] = {}
    st = sizes
    for i in range(len(params) - 1, -1, -1):
        st, pid = back[st]
        mapping[pid] = params[i][0]
    total = fwd[sizes]
    chosen = {n: pid for pid, n in mapping.items()}
    margins: dict[str, float] = {}
    for i, es in enumerate(layer_edges):
        name = params[i][0]
        if name in ambiguous:
            rival = max((fwd[a] + weight(i, pid) + bwd[b] for a, b, pid in es if pid != chosen[name]), default=-math.inf)
            margins[name] = total - rival
    return Assignment(mapping, ambiguous, margins=margins)


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


# Evidence thresholds. Over k Adam steps, Δw ≈ -lr Σ m̂/(√v̂+ε) - lr·wd·Σw. The ends' directions
# u = m/(√v+ε) of *before* and *after* bracket the sum, so -Δw correlates with u_A + u_B of the
# right id; centred (Pearson), since same-role tensors of different layers (norm gains) share a
# common drift. Measured on the zoo's real Lightning pair (10 steps): right ids 0.5-0.97 for
# weights and norms, wrong ones below 0.5; noisy biases fall lower. A name is settled when the
# best assignment beats every assignment that gives it another id by 0.1 in summed cosine
# (0.2 where its own cosine is under 0.2); otherwise it is refused, never guessed.
_EVIDENCE_MIN = 0.2
_EVIDENCE_MARGIN = 0.1


def _direction(st: dict[str, Any] | None) -> torch.Tensor | None:
    m, v = (st or {}).get("exp_avg"), (st or {}).get("exp_avg_sq")
    if not isinstance(m, torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    return (m.double() / (v.double().sqrt() + 1e-8)).flatten()


def settle_by_evidence(
    pending: PendingMapping,
    delta: Callable[[str], torch.Tensor],
    after_osd: dict[str, Any],
    before_osd: dict[str, Any] | None = None,
) -> tuple[dict[Any, str], str]:
    """Choose the assignment whose Adam directions explain the weights' change.

    Args:
        pending: the ambiguous state_dict (ids are the same in both checkpoints).
        delta: name -> w_after - w_before.
        after_osd: the *after* checkpoint's optimizer state_dict (its m, v).
        before_osd: *before*'s, keyed by the same ids (sharpens the evidence), or None.

    Returns:
        (id -> name, how it was settled).

    Raises:
        OptimizerMappingError: the evidence does not single out one assignment; names
            the tensors still ambiguous.
    """
    after, before = after_osd["state"], (before_osd or {}).get("state", {})
    cache: dict[tuple[str, Any], float] = {}

    def cos(name: str, pid: Any) -> float:
        key = (name, pid)
        if key not in cache:
            ub, ua = _direction(after.get(pid)), _direction(before.get(pid))
            if ub is None:
                cache[key] = 0.0
            else:
                u = ub + ua if ua is not None and ua.shape == ub.shape else ub
                d = -delta(name).double().flatten()
                u, d = u - u.mean(), d - d.mean()
                den = float(u.norm() * d.norm())
                cache[key] = float(u @ d) / den if den > 0 else 0.0
        return cache[key]

    groups = pending.osd["param_groups"]
    ids = [list(g["params"]) for g in groups]
    found = order_preserving(pending.params, ids, _state_shapes(pending.osd["state"]), score=cos)
    assert found.mapping is not None
    chosen = {n: pid for pid, n in found.mapping.items()}
    need = {n: 2 * _EVIDENCE_MARGIN if cos(n, chosen[n]) < _EVIDENCE_MIN else _EVIDENCE_MARGIN for n in found.ambiguous}
    unclear = [n for n in found.ambiguous if found.margins[n] < need[n]]
    if unclear:
        raise OptimizerMappingError(
            f"{pending.source}: optimizer ids map ambiguously and the pair's updates do not settle it "
            f"({_name_ambiguous(dict.fromkeys(unclear, []))}: the assignment whose -m/(sqrt(v)+eps) best explains the "
            f"weight change is not {_EVIDENCE_MARGIN} clear, in summed correlation, of one giving them other ids); "
            "pass a checkpoint that stores param_names"
        )
    return found.mapping, f"groups in model order by shape; {len(found.ambiguous)} same-shaped tensors settled by the pair's updates"


def view_from_ids(pending: PendingMapping, id_to_name: dict[Any, str], label: str) -> OptimizerView:
    """The OptimizerView of a pending state_dict under a settled id -> name mapping."""
    osd = pending.osd
    groups = osd["param_groups"]
    hypers = [group_hyper(g, i) for i, g in enumerate(groups)]
    return _view(optimizer_kind(osd["state"]), osd["state"], groups, hypers, id_to_name, label)


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
