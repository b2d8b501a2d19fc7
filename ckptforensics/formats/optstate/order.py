"""Parameters assigned, in model order, to param groups whose id lists keep model order:
every assignment the saved state's shapes allow, or the one evidence scores best."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Param = tuple[str, tuple[int, ...]]


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
