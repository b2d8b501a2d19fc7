"""A regression: the same state and the same batches under two versions of the code (side A,
the reference, and side B), module by module, then K steps on.

Side A runs twice: what the two runs of A differ by is the nondeterminism of A's own kernels
on this device (zero on a CPU, atomics on a GPU), measured, not assumed; `judge` holds the
rules by which B parts from it. Memory: side A's captured pass is held while B runs (one
pass's activations and gradients, twice at the peak); A's second run is reduced to its
differences (`judge.Noise`) before B starts.

Under torchrun each side steps as a replay does (`replay.distributed`): the model sharded with
FSDP2, each rank its rows of the batch. A rank captures its own rows of the pass and keeps its
own shards of the parameters; the comparison rows of each table (maxima, counts) merge across
the ranks in one collective (`compare.table`), so every rank judges the same figures and
reaches the same verdict, and no rank holds more than its share.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.engine.regress.judge import (
    NOISE_FACTOR,
    ModuleDiff,
    ParamDiff,
    Parting,
    StepDiff,
    compare_sides,
    first_parting,
    noise_of,
    status_of,
    step_diffs,
)
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
    ranks = distributed.current()
    if ranks is not None and opts.against_python is not None:
        # The worker is one process: under torchrun B would need a worker per rank, joined
        # to the ranks' process group, each sharding and stepping its rows.
        raise ForensicsError(
            "--against-python runs side B in one worker process, not under torchrun: "
            "run it without torchrun, or compare model factories with --against-model"
        )
    first = cfg.step if cfg.step is not None else _step_after(cfg.before)
    with doing(f"planning steps {first} to {first + opts.steps - 1} from {cfg.before}"):
        p = plan(cfg, list(range(first, first + opts.steps)))
    clip, clip_source = p.clips[0]
    say = progress or (lambda _m: None)
    say("side A")
    a = run_side(p, cfg.model, clip)
    say("side A again (its own noise)")
    noise = noise_of(a, run_side(p, cfg.model, clip), ranks)  # its tensors dropped here
    say("side B")
    b = _side_b(cfg, opts, p, clip)
    mods, params, unmatched, floor = compare_sides(a, noise, b, ranks)
    steps = step_diffs(a, noise, b)
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
        status=status_of(mods, params, steps, parting, floor),
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
