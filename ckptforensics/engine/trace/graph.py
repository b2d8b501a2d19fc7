"""The autograd graph below the logits, and the walks along it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

# Ops that read a parameter at positions an input gives (token ids): their output is an
# activation, not a view of the parameter.
_READS_DATA = (
    "EmbeddingBackward",
    "EmbeddingBagBackward",
    "IndexBackward",
    "IndexSelectBackward",
    "GatherBackward",
)
# Nodes a graph walk visits at most (a walk that finds no stop within them gives up).
WALK_LIMIT = 200_000


class Graph:
    """The autograd graph below the logits: inputs of each node, the nodes consuming each,
    and which inputs are weights (>= 2-D parameters through parameter-only ops)."""

    def __init__(self, root: Any) -> None:
        self.inputs: dict[Any, list[Any]] = {}
        self.consumers: dict[Any, list[Any]] = defaultdict(list)
        seen = {root}
        todo = [root]
        while todo and len(seen) < WALK_LIMIT:
            n = todo.pop()
            ins = [f for f, _ in getattr(n, "next_functions", ()) if f is not None]
            self.inputs[n] = ins
            for f in ins:
                self.consumers[f].append(n)
                if f not in seen:
                    seen.add(f)
                    todo.append(f)
        self._param: dict[Any, torch.Tensor | None] = {}

    def param_of(self, n: Any) -> torch.Tensor | None:
        """The parameter a node carries through parameter-only ops, else None."""
        if n in self._param:
            return self._param[n]
        var = getattr(n, "variable", None)
        if isinstance(var, torch.Tensor):
            out: torch.Tensor | None = var
        elif type(n).__name__.startswith(_READS_DATA):
            out = None  # an embedding lookup: a parameter read at the input's indices is an activation
        else:
            ins = self.inputs.get(n)
            if ins is None:
                ins = [f for f, _ in getattr(n, "next_functions", ()) if f is not None]
            out = self.param_of(ins[0]) if len(ins) == 1 else None
        self._param[n] = out
        return out

    def weights(self, n: Any) -> list[torch.Tensor]:
        """>= 2-D parameters a node takes directly (through parameter-only ops)."""
        out = []
        for f in self.inputs.get(n, ()):
            p = self.param_of(f)
            if p is not None and p.dim() >= 2:
                out.append(p)
        return out

    def data(self, n: Any) -> list[Any]:
        """Inputs of a node that are not parameters."""
        return [f for f in self.inputs.get(n, ()) if self.param_of(f) is None]


def back_to(g: Graph, starts: Iterable[Any], stop: Any) -> list[Any]:
    """Walk back from `starts` until `stop(node)` is truthy; the nodes it stopped at (a path
    that runs out without a stop adds nothing)."""
    found, seen = [], set()
    todo = [s for s in starts if s is not None]
    while todo and len(seen) < WALK_LIMIT:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if stop(n):
            found.append(n)
            continue
        todo.extend(g.data(n))
    return found


def forward_to(g: Graph, start: Any, stop: Any) -> Any:
    """Breadth-first from `start` along consumers to the first node where `stop` holds."""
    seen, frontier = {start}, [start]
    while frontier and len(seen) < WALK_LIMIT:
        nxt = []
        for n in frontier:
            for c in g.consumers.get(n, ()):
                if c in seen:
                    continue
                if stop(c):
                    return c
                seen.add(c)
                nxt.append(c)
        frontier = nxt
    return None


def is_add(n: Any) -> bool:
    return type(n).__name__.startswith("AddBackward")


def walk_between(g: Graph, out: Any, inp: Any) -> list[Any]:
    """Nodes from `out` back to (not including) `inp`."""
    found, seen, todo = [], set(), [out]
    while todo and len(seen) < 10_000:
        n = todo.pop()
        if n in seen or n is inp:
            continue
        seen.add(n)
        found.append(n)
        todo.extend(g.data(n))
    return found


def tanh_before(g: Graph, start: Any, stop_at_weights: bool = False) -> bool:
    """A tanh on the path back from `start` before the first node with weights."""
    seen, todo = set(), [start]
    while todo and len(seen) < 10_000:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__.startswith("TanhBackward"):
            return True
        if g.weights(n):
            continue
        todo.extend(g.data(n))
    return False


def descends(g: Graph, node: Any, ancestor: Any) -> bool:
    """Whether `ancestor` is reached walking back from `node` (through data inputs)."""
    seen, todo = set(), [node]
    while todo and len(seen) < WALK_LIMIT:
        n = todo.pop()
        if n is None or n in seen:
            continue
        if n is ancestor:
            return True
        seen.add(n)
        todo.extend(g.data(n))
    return False
