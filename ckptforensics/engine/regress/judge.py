"""A's run-to-run noise and B's difference judged: which tensors part, where the code parts.

The rules (docs/signatures.md#regress-parting): a tensor of B parts from A where its relative
difference passes `NOISE_FACTOR` times the largest relative difference between A's two runs
up to it in the pass's order (any difference where A repeats itself bit for bit). The first
such tensor, in forward order then backward order, names where the code parts:
- a module's output differs while its input does not: the module's own forward;
- a module's input differs first: the code of its caller before the call (a functional op
  between two modules, `F.gelu`, an attention call, a cast);
- the gradient at a module's input differs while the one at its output does not: the
  module's own backward;
- the gradient at a module's output differs first: its caller's code that consumed it.
No module parts but the parameters after K steps do: the update parts (the optimizer, the clip).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptforensics.engine.regress.capture import BACKWARD, FORWARD, Event
from ckptforensics.engine.regress.compare import Across, TensorDelta, deltas
from ckptforensics.engine.regress.side import SideRun
from ckptforensics.engine.replay.distributed import World
from ckptforensics.engine.replay.records import StepRecord

__all__ = [
    "NOISE_FACTOR",
    "ModuleDiff",
    "ParamDiff",
    "StepDiff",
    "Parting",
    "Noise",
    "noise_of",
    "compare_sides",
    "step_diffs",
    "first_parting",
    "status_of",
]

# How far past A's own run-to-run difference B may be and still count as that noise: the
# largest of many rounding differences varies by well under 2x between two draws of the same
# nondeterministic kernel; 4x leaves room for that and names any real change larger than it.
NOISE_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class ModuleDiff:
    """One tensor of the first step's pass, B against A.

    Attributes:
        event: where it was taken (`capture.Event`).
        dtype, shape: side A's (under torchrun the whole batch's: its rows on every rank).
        delta: B against A (`compare.TensorDelta`).
        noise: A's second run against its first.
        exceeds: the difference is past `NOISE_FACTOR` times the noise (any difference where
            A repeats itself bit for bit).
    """

    event: Event
    dtype: str
    shape: tuple[int, ...]
    delta: TensorDelta
    noise: TensorDelta
    exceeds: bool


@dataclass(frozen=True, slots=True)
class ParamDiff:
    """One parameter after the K steps, B against A (as `ModuleDiff`)."""

    name: str
    delta: TensorDelta
    noise: TensorDelta
    exceeds: bool


@dataclass(frozen=True, slots=True)
class StepDiff:
    """One stepped step: each side's loss and pre-clip grad norm, and A's second run's."""

    step: int
    loss_a: float
    loss_b: float
    loss_a2: float
    grad_norm_a: float
    grad_norm_b: float
    grad_norm_a2: float

    def exceeds(self, floor: float) -> bool:
        """Past A's own noise on this step (or the pass's relative noise `floor`)."""
        return _past(self.loss_a, self.loss_b, self.loss_a2, floor) or _past(
            self.grad_norm_a, self.grad_norm_b, self.grad_norm_a2, floor
        )


@dataclass(frozen=True, slots=True)
class Parting:
    """Where B parts from A.

    Attributes:
        module: the module whose code it is (the model's own name; '' the model's forward).
        direction: 'forward', 'backward' or 'update' (no module parts; the parameters do).
        where: the rule that placed it, in words ("its own forward").
        key: the first tensor past the noise (event key, or the parameter's name).
        delta, noise: that tensor's difference and A's own.
    """

    module: str
    direction: str
    where: str
    key: str
    delta: TensorDelta
    noise: TensorDelta


def _past(a: float, b: float, a2: float, floor: float) -> bool:
    """b's relative distance from a is past the factor times a2's, or the pass's noise
    `floor` (any distance where both are 0)."""
    if math.isnan(a) and math.isnan(b):
        return False
    scale = max(abs(a), 1e-30)
    bound = max(abs(a2 - a) / scale, floor)
    return not (abs(b - a) / scale <= NOISE_FACTOR * bound) if bound > 0 else b != a


def _exceeds(d: TensorDelta, noise: TensorDelta, bound: float) -> bool:
    """Past the noise: a non-finite element A's second run did not have, else a relative
    difference past `NOISE_FACTOR` times `bound` (any difference where it is 0)."""
    if d.nonfinite > noise.nonfinite or not math.isfinite(d.max_abs):
        return True
    if bound == 0 and noise.identical:
        return not d.identical
    return d.max_rel > NOISE_FACTOR * bound


def _judged(pairs: list[tuple[TensorDelta, TensorDelta]], floor: float) -> tuple[list[bool], float]:
    """Each pair (B's delta, A's noise) judged against the largest relative noise of A so far,
    from `floor` on (the returned floor where the list ends). Noise flows downstream: a
    tensor that A's second run happens to repeat exactly, after a noisy one, is no proof
    that A repeats it, so the bound is the noise seen up to it in the pass's order."""
    out = []
    for d, n in pairs:
        if math.isfinite(n.max_rel):
            floor = max(floor, n.max_rel)
        out.append(_exceeds(d, n, floor))
    return out, floor


@dataclass(frozen=True, slots=True)
class Noise:
    """A's second run against its first, kept so that the second run's tensors need not be.

    Attributes:
        events: event key -> `TensorDelta` of the first step's pass.
        params: parameter name -> `TensorDelta` after the steps.
        records: the second run's step records (loss, grad norm).
    """

    events: dict[str, TensorDelta]
    params: dict[str, TensorDelta]
    records: list[StepRecord]


def _rows_of(a: SideRun, t: torch.Tensor) -> bool:
    """Whether `t` is this rank's rows of a pass's tensor (its leading dimension the rows A
    stepped), not one every rank holds whole (a position embedding's output; the gradient
    at it, each rank's sum over its rows)."""
    return t.dim() > 0 and t.shape[0] == a.rows


def _shape(a: SideRun, t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's shape over the whole batch (under torchrun a rank holds its rows)."""
    return (a.batch_rows, *t.shape[1:]) if _rows_of(a, t) else tuple(t.shape)


def _across(world: World | None, keys: Sequence[str], split: Sequence[bool] = ()) -> Across | None:
    return None if world is None else Across(world=world, keys=keys, split=split)


def _events(a: SideRun, keys: list[str], world: World | None) -> Across | None:
    """How a pass's tensors merge across the ranks: each rank's rows summed, whole ones not."""
    return _across(world, keys, [_rows_of(a, a.tensors[k]) for k in keys])


def noise_of(a: SideRun, a2: SideRun, world: World | None = None) -> Noise:
    """A's run-to-run difference, tensor by tensor (one `compare.table` pass each; under
    torchrun, `world`, each rank's rows and shards merged as `compare.table` merges them)."""
    keys = [e.key for e in a.events if e.key in a2.tensors]
    names = [n for n in a.params if n in a2.params]
    ev = deltas([(a.tensors[k], a2.tensors[k]) for k in keys], _events(a, keys, world))
    pa = deltas([(a.params[n], a2.params[n]) for n in names], _across(world, names))
    return Noise(dict(zip(keys, ev, strict=True)), dict(zip(names, pa, strict=True)), a2.records)


def compare_sides(
    a: SideRun, noise: Noise, b: SideRun, world: World | None = None
) -> tuple[list[ModuleDiff], list[ParamDiff], list[str], float]:
    """The first step's tensors (forward order, then backward) and the final parameters of B
    against A's, each judged against A's noise; the tensors one side lacks; the largest
    relative noise of A. Under torchrun (`world`) the differences are the ranks' merged, so
    every rank judges the same figures and reaches the same verdict."""
    keys = [e for e in a.events if e.key in b.tensors and e.key in noise.events]
    order = [e for e in keys if e.phase == FORWARD] + [e for e in keys if e.phase == BACKWARD]
    unmatched = sorted({e.key for e in a.events} ^ {e.key for e in b.events})
    ref = [a.tensors[e.key] for e in order]
    got_b = deltas(
        [(r, b.tensors[e.key]) for r, e in zip(ref, order, strict=True)],
        _events(a, [e.key for e in order], world),
    )
    got_n = [noise.events[e.key] for e in order]
    past, floor = _judged(list(zip(got_b, got_n, strict=True)), 0.0)
    mods = [
        ModuleDiff(e, str(r.dtype).removeprefix("torch."), _shape(a, r), d, n, x)
        for e, r, d, n, x in zip(order, ref, got_b, got_n, past, strict=True)
    ]
    names = [n for n in a.params if n in b.params and n in noise.params]
    unmatched += sorted(set(a.params) ^ set(b.params))
    pb = deltas([(a.params[n], b.params[n]) for n in names], _across(world, names))
    pn = [noise.params[n] for n in names]
    # the update mixes every parameter's noise (a clip by the total norm, tied weights):
    # each parameter is judged against the largest of all
    floor = max([floor, *(x.max_rel for x in pn if math.isfinite(x.max_rel))])
    params = [
        ParamDiff(n, d, x, _exceeds(d, x, floor)) for n, d, x in zip(names, pb, pn, strict=True)
    ]
    return mods, params, unmatched, floor


def step_diffs(a: SideRun, noise: Noise, b: SideRun) -> list[StepDiff]:
    """Each stepped step's loss and grad norm on both sides and A's second run."""
    return [
        StepDiff(r.step, r.loss, rb.loss, r2.loss, r.grad_norm, rb.grad_norm, r2.grad_norm)
        for r, r2, rb in zip(a.records, noise.records, b.records, strict=True)
    ]


def first_parting(mods: list[ModuleDiff], params: list[ParamDiff]) -> Parting | None:
    """Where the code parts (the rules in the module's docstring), None where nothing does."""
    m = next((m for m in mods if m.exceeds), None)
    if m is None:
        p = next((p for p in params if p.exceeds), None)
        if p is None:
            return None
        return Parting(
            p.name, "update", "the optimizer's update of this parameter", p.name, p.delta, p.noise
        )
    e = m.event
    caller = e.caller or "the model's own forward"
    if e.phase == FORWARD:
        module, where = (
            (e.module, "its own forward, its input the same on both sides")
            if e.side == "out"
            else (e.caller, f"{caller}'s own code before it calls {e.module}")
        )
    else:
        module, where = (
            (e.module, "its own backward, the gradient at its output the same on both sides")
            if e.side == "in"
            else (
                e.caller,
                f"the backward of {caller}'s own code that consumes {e.module}'s output",
            )
        )
    return Parting(module, e.phase, where, e.key, m.delta, m.noise)


def status_of(
    mods: list[ModuleDiff],
    params: list[ParamDiff],
    steps: list[StepDiff],
    parting: Parting | None,
    floor: float,
) -> str:
    if parting is not None or any(s.exceeds(floor) for s in steps):
        return "parted"
    same = all(m.delta.identical for m in mods) and all(p.delta.identical for p in params)
    same = same and all(s.loss_a == s.loss_b and s.grad_norm_a == s.grad_norm_b for s in steps)
    return "identical" if same else "equivalent"
