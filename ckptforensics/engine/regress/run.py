"""A regression: the same state and the same batches under two versions of the code (side A,
the reference, and side B), module by module, then K steps on.

Side A runs twice: what the two runs of A differ by is the nondeterminism of A's own kernels
on this device (zero on a CPU, atomics on a GPU), measured, not assumed. A module of B parts
from A where its difference exceeds `NOISE_FACTOR` times A's own there; the first such
tensor, in forward order then backward order, names where the code parts:
- a module's output differs while its input does not: the module's own forward;
- a module's input differs first: the code of its caller before the call (a functional op
  between two modules, `F.gelu`, an attention call, a cast);
- the gradient at a module's input differs while the one at its output does not: the
  module's own backward;
- the gradient at a module's output differs first: its caller's code that consumed it.
No module parts but the parameters after K steps do: the update parts (the optimizer, the
clip). Memory: side A's captured pass is held while B runs (one pass's activations and
gradients, twice at the peak).
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.engine.regress.capture import BACKWARD, FORWARD, Event
from ckptforensics.engine.regress.compare import TensorDelta, deltas
from ckptforensics.engine.regress.side import SideRun, run_side
from ckptforensics.engine.regress.worker import WorkerSpec, config_dict, run_worker
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay.logcheck import LogCheck, check_against_log
from ckptforensics.engine.replay.records import ReplayConfig
from ckptforensics.engine.replay.window import plan

__all__ = [
    "NOISE_FACTOR",
    "RegressOptions",
    "ModuleDiff",
    "ParamDiff",
    "StepDiff",
    "Parting",
    "RegressResult",
    "regress",
]

log = logging.getLogger(__name__)

# How far past A's own run-to-run difference B may be and still count as that noise: the
# largest of many rounding differences varies by well under 2x between two draws of the same
# nondeterministic kernel; 4x leaves room for that and names any real change larger than it.
NOISE_FACTOR = 4.0


@dataclass(kw_only=True, slots=True)
class RegressOptions:
    """What side B is.

    Attributes:
        against_model: B's `--model` (None: A's, with `against_python`).
        against_python: another interpreter that runs B as a worker (None: this process).
        against_env: environment variables set for the worker (a numerics knob:
            `ATEN_CPU_CAPABILITY`, `NVIDIA_TF32_OVERRIDE`, `OMP_NUM_THREADS`).
        steps: how many steps of the window both sides step (the first is compared module
            by module).
    """

    against_model: str | None = None
    against_python: Path | None = None
    against_env: dict[str, str] = field(default_factory=dict)
    steps: int = 1

    def __post_init__(self) -> None:
        if self.against_model is None and self.against_python is None:
            raise ForensicsError(
                "regress needs a side B: pass --against-model (another model factory) or "
                "--against-python (another interpreter)"
            )
        if self.against_env and self.against_python is None:
            raise ForensicsError(
                "--against-env sets the worker's environment: pass --against-python too"
            )
        if self.steps < 1:
            raise ForensicsError(
                f"--steps {self.steps}: step at least once (pass --steps 1 or more)"
            )


@dataclass(frozen=True, slots=True)
class ModuleDiff:
    """One tensor of the first step's pass, B against A.

    Attributes:
        event: where it was taken (`capture.Event`).
        dtype, shape: side A's.
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


@dataclass(slots=True)
class RegressResult:
    """Everything a regression measured; `detectors.regress` turns it into findings.

    Attributes:
        status: 'identical' (every tensor bit for bit), 'equivalent' (within A's own
            run-to-run noise) or 'parted'.
        parting: where it parted (None unless parted).
        modules: the first step's pass, in A's order (forward, then backward).
        params, steps: after the K steps.
        unmatched: tensors one side has and the other does not (event keys).
        check_a, check_b: each side's steps against the run's log.
        sides: 'a' and 'b': model, interpreter and environment of each.
        config: the replay's configuration with sources (`Plan.config`).
        noise_floor: the largest relative difference between A's two runs (0: A repeats
            itself bit for bit).
        noise_factor: `NOISE_FACTOR`.
    """

    status: str
    parting: Parting | None
    modules: list[ModuleDiff]
    params: list[ParamDiff]
    steps: list[StepDiff]
    unmatched: list[str]
    check_a: LogCheck
    check_b: LogCheck
    sides: dict[str, dict[str, Any]]
    config: dict[str, Any]
    noise_floor: float = 0.0
    noise_factor: float = NOISE_FACTOR


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


def compare_sides(
    a: SideRun, a2: SideRun, b: SideRun
) -> tuple[list[ModuleDiff], list[ParamDiff], list[str], float]:
    """The first step's tensors and the final parameters of B and of A's second run against
    A's (each list in one pass of `compare.table`), and the largest relative noise of A."""
    keys = [e for e in a.events if e.key in b.tensors and e.key in a2.tensors]
    order = [e for e in keys if e.phase == FORWARD] + [e for e in keys if e.phase == BACKWARD]
    unmatched = sorted({e.key for e in a.events} ^ {e.key for e in b.events})
    ref = [a.tensors[e.key] for e in order]
    got_b = deltas([(r, b.tensors[e.key]) for r, e in zip(ref, order, strict=True)])
    got_n = deltas([(r, a2.tensors[e.key]) for r, e in zip(ref, order, strict=True)])
    past, floor = _judged(list(zip(got_b, got_n, strict=True)), 0.0)
    mods = [
        ModuleDiff(e, str(r.dtype).removeprefix("torch."), tuple(r.shape), d, n, x)
        for e, r, d, n, x in zip(order, ref, got_b, got_n, past, strict=True)
    ]
    names = [n for n in a.params if n in b.params and n in a2.params]
    unmatched += sorted(set(a.params) ^ set(b.params))
    pb = deltas([(a.params[n], b.params[n]) for n in names])
    pn = deltas([(a.params[n], a2.params[n]) for n in names])
    # the update mixes every parameter's noise (a clip by the total norm, tied weights):
    # each parameter is judged against the largest of all
    floor = max([floor, *(x.max_rel for x in pn if math.isfinite(x.max_rel))])
    params = [
        ParamDiff(n, d, x, _exceeds(d, x, floor)) for n, d, x in zip(names, pb, pn, strict=True)
    ]
    return mods, params, unmatched, floor


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
            (e.module, "its own forward (its input is the same on both sides)")
            if e.side == "out"
            else (e.caller, f"{caller}'s own code before it calls {e.module}")
        )
    else:
        module, where = (
            (e.module, "its own backward (the gradient at its output is the same on both sides)")
            if e.side == "in"
            else (
                e.caller,
                f"the backward of {caller}'s own code that consumes {e.module}'s output",
            )
        )
    return Parting(module, e.phase, where, e.key, m.delta, m.noise)


def _status(
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


# Environment variables that set torch's thread count: where --against-env names one, the
# worker keeps the count it gives; else it takes this process's.
_THREAD_KNOBS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _side_b(cfg: ReplayConfig, opts: RegressOptions, p: Any, clip: float | None) -> SideRun:
    model = opts.against_model or cfg.model
    if opts.against_python is None:
        return run_side(p, model, clip)
    own = any(k in opts.against_env for k in _THREAD_KNOBS)  # the knob under test
    spec = WorkerSpec(
        config=config_dict(cfg, model),
        steps=list(p.steps),
        lrs={s: p.lrs[s] for s in p.steps},
        clip=clip,
        threads=None if own else torch.get_num_threads(),
    )
    with tempfile.TemporaryDirectory(prefix="ckptforensics-regress-") as tmp:
        return run_worker(opts.against_python, opts.against_env, spec, Path(tmp))


def _step_after(before: Path) -> int:
    with open_checkpoint(before) as a:
        if a.step is None:
            raise ForensicsError(f"{before}: the checkpoint does not record its step; pass --step")
        return a.step + 1


def regress(
    cfg: ReplayConfig, opts: RegressOptions, progress: Callable[[str], None] | None = None
) -> RegressResult:
    """Step `opts.steps` steps from *before* (`cfg.step` the first; default before + 1) under
    side A (`cfg.model`), twice, and under side B; compare.

    Raises:
        ForensicsError: bad checkpoints, batches or models, or a worker that failed.
    """
    if distributed.current() is not None:
        raise ForensicsError(
            "regress runs in one process for now (each pass is kept whole to compare it): "
            "run it without torchrun"
        )
    first = cfg.step if cfg.step is not None else _step_after(cfg.before)
    with doing(f"planning steps {first} to {first + opts.steps - 1} from {cfg.before}"):
        p = plan(cfg, list(range(first, first + opts.steps)))
    clip, clip_source = p.clips[0]
    say = progress or (lambda _m: None)
    say("side A")
    a = run_side(p, cfg.model, clip)
    say("side A again (its own noise)")
    a2 = run_side(p, cfg.model, clip)
    say("side B")
    b = _side_b(cfg, opts, p, clip)
    mods, params, unmatched, floor = compare_sides(a, a2, b)
    steps = [
        StepDiff(r.step, r.loss, rb.loss, r2.loss, r.grad_norm, rb.grad_norm, r2.grad_norm)
        for r, r2, rb in zip(a.records, a2.records, b.records, strict=True)
    ]
    parting = first_parting(mods, params)
    mbs = p.batches.micro_batch_size
    sides = {
        "a": {
            "model": cfg.model,
            "model_source": a.model_source,
            "python": "this process",
            "environment": a.environment,
        },
        "b": {
            "model": opts.against_model or cfg.model,
            "model_source": b.model_source,
            "python": str(opts.against_python) if opts.against_python else "this process",
            "env": dict(opts.against_env),
            "environment": b.environment,
        },
    }
    return RegressResult(
        status=_status(mods, params, steps, parting, floor),
        parting=parting,
        modules=mods,
        params=params,
        steps=steps,
        unmatched=unmatched,
        check_a=check_against_log(a.records, p.logged, p.precision, mbs, clip),
        check_b=check_against_log(b.records, p.logged, p.precision, mbs, clip),
        sides=sides,
        config=p.config(clip, clip_source),
        noise_floor=floor,
    )
