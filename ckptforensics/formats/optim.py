"""Map a torch optimizer state_dict (integer ids) onto parameter names, verified by shape.

Over 400 lines: one mapping, optimizer ids onto parameter names, whose family rules, shape
matching and evidence-based settling share a dozen private helpers; split, they would become
API between modules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpoint, OptimizerMappingError
from . import bnb
from .base import GroupHyper, OptimizerView

__all__ = [
    "FAMILIES",
    "map_optimizer",
    "merge_optimizers",
    "optimizer_family",
    "param_shape_of",
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
_HF_NO_DECAY = re.compile(
    r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE
)


def hf_no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """HF Trainer's decay rule by name (LayerNorm/RMSNorm params and biases skip decay)."""
    return bool(_HF_NO_DECAY.search(name))


def _dim_rule(name: str, shape: tuple[int, ...]) -> bool:
    """nanoGPT's rule: tensors of dim < 2 (biases, norms) skip decay."""
    return len(shape) < 2


# The optimizer families the tool knows, each told apart by what its own code saves: the
# state keys it creates per parameter and the options it puts in every param group.
FAMILIES = ("adam", "lamb", "lion", "adafactor", "muon", "sgd", "adam8bit")

# Group options that name a family outright (each the optimizer's own constructor argument).
_GROUP_MARKS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("muon", frozenset({"ns_coefficients", "ns_steps"}), "torch.optim.Muon"),
    ("adafactor", frozenset({"beta2_decay", "d"}), "torch.optim.Adafactor"),
    (
        "adafactor",
        frozenset({"clip_threshold", "decay_rate"}),
        "transformers.optimization.Adafactor",
    ),
    ("lamb", frozenset({"max_coeff", "min_coeff"}), "deepspeed.ops.lamb.FusedLamb"),
    (
        "lamb",
        frozenset({"weight_decouple", "rectify", "adam", "max_grad_norm"}),
        "pytorch_optimizer.Lamb",
    ),
    ("lamb", frozenset({"grad_averaging", "max_grad_norm"}), "apex.optimizers.FusedLAMB"),
    ("sgd", frozenset({"dampening"}), "torch.optim.SGD"),
)


def optimizer_family(keys: set[str], group: dict[str, Any] | None = None) -> tuple[str, str]:
    """(family, implementation) of one param group from its options and its state's keys.

    Group options decide first (Adafactor with `beta1` saves `exp_avg` and `exp_avg_sq` for
    vectors, as Adam does; LAMB saves Adam's moments); then the state's keys: bitsandbytes'
    quantised `state1`/`state2`, Adam's `exp_avg` + `exp_avg_sq`, Lion's lone `exp_avg`
    (lion-pytorch), Adafactor's factored rows/columns, a momentum buffer (SGD).
    'none' for a group without state or options that say; 'unknown:<keys>' otherwise.
    bitsandbytes' 2-state optimizers save `alpha` / `t_alpha` / `t_beta3` in every group
    (`Optimizer2State`): Adam(W)8bit with alpha 0, AdEMAMix with its mixing alpha; a
    `unorm_vec` is its LAMB8bit / LARS8bit (update-norm clipping), not Adam's rule.
    """
    g = set(group or ())
    for fam, marks, impl in _GROUP_MARKS:
        if marks <= g:
            return fam, impl
    bnb_group = {"t_alpha", "t_beta3"} <= g
    if (
        {"state1", "qmap1"} <= keys
        or {"state1", "absmax1"} <= keys
        or ({"state1", "state2"} <= keys and bnb_group)
    ):
        adam_rule = "state2" in keys and "unorm_vec" not in keys and not (group or {}).get("alpha")
        return (
            ("adam8bit", "bitsandbytes")
            if adam_rule
            else (f"unknown:bitsandbytes {','.join(sorted(keys))}", "bitsandbytes")
        )
    if {"exp_avg", "exp_avg_sq"} <= keys:
        # torch's Adam and AdamW save `amsgrad` in every group; apex's FusedAdam and
        # DeepSpeed's (CPU)Adam save `bias_correction` instead, with the same moments.
        return (
            "adam",
            "torch.optim.Adam(W)"
            if "amsgrad" in g
            else "apex/DeepSpeed Adam"
            if "bias_correction" in g
            else "Adam",
        )
    if keys & {"row_var", "col_var", "variance"}:
        return "adafactor", "torch.optim.Adafactor"
    if keys & {"exp_avg_sq_row", "exp_avg_sq_col"}:
        return "adafactor", "transformers.optimization.Adafactor"
    if keys == {"exp_avg"} and "betas" in g:
        return "lion", "lion-pytorch"
    if "momentum_buffer" in keys:
        return "sgd", "torch.optim.SGD"
    if not keys:
        return ("adam", "Adam") if "betas" in g and "amsgrad" in g else ("none", "")
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
    fams = [_group_family(g, state)[0] for g in groups]
    known = [f for f in fams if f != "none"]
    return "+".join(dict.fromkeys(known)) if known else "none"


def _group_family(group: dict[str, Any], state: dict[Any, dict[str, Any]]) -> tuple[str, str]:
    keys: set[str] = set()
    for pid in group.get("params", ()):
        keys.update(state.get(pid) or ())
    if not keys and not any(m <= set(group) for _, m, _ in _GROUP_MARKS):
        # A group without state yet (no step taken): the family of the state saved elsewhere.
        for s in state.values():
            keys.update(s)
    return optimizer_family(keys, group)


# Options each family saves in its groups that its bounds and its replay read.
_OPTIONS = (
    "beta2_decay",
    "d",
    "clip_threshold",
    "decay_rate",
    "relative_step",
    "scale_parameter",
    "warmup_init",
    "beta1",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "ns_steps",
    "adjust_lr_fn",
    "dampening",
    "max_coeff",
    "min_coeff",
    "bias_correction",
    "max_grad_norm",
    "grad_averaging",
    "amsgrad",
    "maximize",
    "decoupled_weight_decay",
    "foreach",
    "optim_bits",
    "percentile_clipping",
    "block_wise",
    "weight_decouple",
    "fixed_decay",
    "rectify",
    "adam",
    "adam_w_mode",
    "use_nvlamb",
    "step",
)


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
    opts = {k: _plain(group[k]) for k in _OPTIONS if k in group}
    if isinstance(eps, (tuple, list)):
        opts["eps2"] = _opt_num(eps[1]) if len(eps) > 1 else None
        eps = eps[0]
    fam, impl = family or optimizer_family(set(), group)
    if family is None and fam == "none" and betas is not None:
        fam = "adam"  # readers that map state themselves (DCP, DeepSpeed, Megatron) hold Adam's
    opts["implementation"] = impl
    return GroupHyper(
        lr=_opt_num(group.get("lr", 0.0), math.nan),
        betas=(float(_num(betas[0])), float(_num(betas[1])))
        if isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(_is_number(b) for b in betas)
        else None,
        eps=_opt_num(eps, math.nan),
        weight_decay=_opt_num(group.get("weight_decay", 0.0), 0.0),
        initial_lr=float(_num(group["initial_lr"]))
        if _is_number(group.get("initial_lr"))
        else None,
        max_lr=float(_num(group["max_lr"])) if _is_number(group.get("max_lr")) else None,
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


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (
        isinstance(x, torch.Tensor) and x.numel() == 1
    )


def _partitions(params: Sequence[Param], sizes: list[int]) -> list[tuple[str, list[list[Param]]]]:
    """Candidate assignments of the model's parameters to the saved param groups."""
    out: list[tuple[str, list[list[Param]]]] = []
    if len(sizes) == 1:
        out.append(("single group", [list(params)]))
        return out
    if len(sizes) == 2:
        for label, rule in (
            ("HF decay/no-decay groups", hf_no_decay),
            ("dim>=2 / dim<2 groups", _dim_rule),
        ):
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
    hypers = [group_hyper(g, i, _group_family(g, state)) for i, g in enumerate(groups)]
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
        found = order_preserving(params, ids, _state_shapes(state))
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
        shape = param_shape_of(st)
        if shape is not None:
            out[pid] = shape
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
        layer_edges[i] = [
            (st, to, pid) for st in layers[i] for to, pid in moves(i, st) if to in live
        ]
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
            rival = max(
                (fwd[a] + weight(i, pid) + bwd[b] for a, b, pid in es if pid != chosen[name]),
                default=-math.inf,
            )
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
    need = {
        n: 2 * _EVIDENCE_MARGIN if cos(n, chosen[n]) < _EVIDENCE_MIN else _EVIDENCE_MARGIN
        for n in found.ambiguous
    }
    unclear = [n for n in found.ambiguous if found.margins[n] < need[n]]
    if unclear:
        raise OptimizerMappingError(
            f"{pending.source}: optimizer ids map ambiguously and the pair's updates do not settle it "
            f"({_name_ambiguous(dict.fromkeys(unclear, []))}: the assignment whose -m/(sqrt(v)+eps) best explains the "
            f"weight change is not {_EVIDENCE_MARGIN} clear, in summed correlation, of one giving them other ids); "
            "pass a checkpoint that stores param_names"
        )
    return (
        found.mapping,
        f"groups in model order by shape; {len(found.ambiguous)} same-shaped tensors settled by the pair's updates",
    )


def view_from_ids(pending: PendingMapping, id_to_name: dict[Any, str], label: str) -> OptimizerView:
    """The OptimizerView of a pending state_dict under a settled id -> name mapping."""
    osd = pending.osd
    groups = osd["param_groups"]
    hypers = [group_hyper(g, i, _group_family(g, osd["state"])) for i, g in enumerate(groups)]
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
    if family == "adam8bit":
        st = bnb.with_moments(st)
    if "step" not in st and _is_number(group.get("step")):
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
