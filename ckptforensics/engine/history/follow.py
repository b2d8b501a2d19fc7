"""The walk over a run's checkpoints: each opened once, its weights loaded into one model and
measured on the fixed batch, each consecutive pair streamed through the diff's kernel while
both are open; only per-module figures are kept, so memory stays the diff's bound plus one
model."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptforensics import optim
from ckptforensics.checkpoints import list_checkpoints, open_checkpoint
from ckptforensics.core.errors import CheckpointNotFound, ForensicsError, doing
from ckptforensics.detectors.history import HistoryEvidence, Trajectory
from ckptforensics.engine.diff import DiffConfig, TensorDiff
from ckptforensics.engine.diff.pair import diff_checkpoints
from ckptforensics.engine.history.batch import fixed_batch
from ckptforensics.engine.history.forward import CheckpointPass, Forward
from ckptforensics.engine.replay.model import build_model, load_weights
from ckptforensics.formats.base import Checkpoint
from ckptforensics.logs import find_metrics, read_metrics

__all__ = ["HistoryConfig", "HistoryResult", "walk", "select"]

log = logging.getLogger(__name__)
Progress = Callable[[str], None]

# The diff's per-tensor figures a history follows (`TensorDiff` field -> trajectory metric):
# the update/weight ratio, the first and second moments' largest values, the implied
# gradient energy and the share of sign-like updates; and, derived, the largest element's step
# in units of the LR (`_sign_steps`, metric `max_step`).
_DIFF_FIGURES = {
    "update_ratio": "update_ratio",
    "r_v": "r_v",
    "max_abs_m_b": "max_abs_m",
    "max_v_b": "max_v",
    "rho_share_b": "rho_share",
}


def _sign_steps(t: TensorDiff) -> float:
    """The tensor's largest per-element step over the pair in units of the LR, per optimizer
    step: max|dw| / (lr k). A sign-like Adam step is 1 (bias-corrected Adam's first step is
    exactly lr sign(g)); NaN where the step is not lr times Adam's normalised ratio (no
    moments, or a family that scales it by the weight's norm, as LAMB's trust ratio) or the
    pair records no LR or step count."""
    fam = optim.FAMILIES.get(t.family)
    if fam is None or not fam.moments or fam.weight_scale({}) or not t.has_moments:
        return math.nan
    if t.k <= 0 or not (t.lr > 0):
        return math.nan
    return t.dw_max_abs / (t.lr * t.k)


@dataclass(kw_only=True, slots=True)
class HistoryConfig:
    """What `history` follows.

    Attributes:
        run_dir: where the run wrote its checkpoints (and its batch log and training log).
        start: the first step of the range (None: the run's first checkpoint).
        stop: the last step of the range (None: its last).
        batch: `--batch`: a batch log or batch file (None: discovered beside the checkpoints).
        data: `--data`: the run's training data, its first batch rebuilt.
        model: `--model` (module:factory, file.py:factory, an HF config dir); None: what the
            run recorded.
        device: where the forward passes run ('cpu', 'cuda').
        diff: the diff's options (chunk size: its memory bound).
    """

    run_dir: Path
    start: int | None = None
    stop: int | None = None
    batch: str | None = None
    data: str | None = None
    model: str | None = None
    device: str = "cpu"
    diff: DiffConfig = field(default_factory=DiffConfig)


@dataclass(slots=True)
class HistoryResult:
    """A walk's measurements.

    Attributes:
        checkpoints: (step, path) of every checkpoint walked, in step order.
        passes: one forward pass's figures per checkpoint.
        evidence: every module's trajectory (the detectors' input).
        batch_source: the fixed batch, in words.
        log: step -> the training log's loss and grad norm (empty: none found).
        seconds: wall time of the forward passes ('forward'), the diffs ('diff'), the
            checkpoints' opening and loading ('load') and the whole walk ('total').
    """

    checkpoints: list[tuple[int, Path]]
    passes: list[CheckpointPass]
    evidence: HistoryEvidence
    batch_source: str
    log: dict[int, dict[str, float]]
    seconds: dict[str, float]


def select(run_dir: Path, start: int | None, stop: int | None) -> list[tuple[int, Path]]:
    """The run's checkpoints in step order, within [start, stop].

    Raises:
        CheckpointNotFound: fewer than two in the range (a history needs a pair).
    """
    if not run_dir.is_dir():
        what = "is not a directory" if run_dir.exists() else "does not exist"
        raise CheckpointNotFound(f"run directory {run_dir} {what}; pass --run-dir")
    found = list_checkpoints(run_dir)
    picked = [
        (s, p) for s, p in found if (start is None or s >= start) and (stop is None or s <= stop)
    ]
    if len(picked) < 2:
        listing = ", ".join(p.name for _, p in found[:12]) or "no checkpoints"
        span = f" between steps {start} and {stop}" if start is not None or stop is not None else ""
        raise CheckpointNotFound(
            f"{run_dir}: {len(picked)} checkpoint(s){span}, a history needs two or more; found: {listing}"
        )
    steps = [s for s, _ in picked]
    dup = sorted({s for s in steps if steps.count(s) > 1})
    if dup:
        names = ", ".join(p.name for s, p in picked if s == dup[0])
        raise CheckpointNotFound(
            f"step {dup[0]} is ambiguous in {run_dir}: {names}; keep one per step"
        )
    return picked


def walk(cfg: HistoryConfig, progress: Progress | None = None) -> HistoryResult:
    """Measure every checkpoint of the range and diff every consecutive pair.

    Raises:
        ForensicsError: no checkpoints, no batch, a model that cannot be built or loaded,
            checkpoints of different models.
    """
    say = progress or (lambda _s: None)
    picked = select(cfg.run_dir, cfg.start, cfg.stop)
    secs = {"forward": 0.0, "diff": 0.0, "load": 0.0}
    t_all = time.perf_counter()
    passes: list[CheckpointPass] = []
    pairs: list[list[TensorDiff]] = []
    prev: Checkpoint | None = None
    fw: Forward | None = None
    source = ""
    try:
        for step, path in picked:
            say(f"checkpoint {step}")
            t0 = time.perf_counter()
            ck = open_checkpoint(path)
            if fw is None:
                fb = fixed_batch(cfg.batch, cfg.data, ck, cfg.run_dir)
                source = fb.source
                model, _ = build_model(cfg.model, ck)
                load_weights(model, ck)
                fw = Forward(model, fb.batch, cfg.device)
            else:
                with doing(f"loading the weights of {path}"):
                    load_weights(fw.model, ck)
            t1 = time.perf_counter()
            with doing(f"measuring checkpoint {path} on the fixed batch"):
                passes.append(fw.measure(step))
            t2 = time.perf_counter()
            if prev is not None:
                res = diff_checkpoints(prev, ck, cfg.diff)
                pairs.append(res.tensors if res is not None else [])
                prev.close()
            prev = ck
            t3 = time.perf_counter()
            secs["load"] += t1 - t0
            secs["forward"] += t2 - t1
            secs["diff"] += t3 - t2
    finally:
        if prev is not None:
            prev.close()
        if fw is not None:
            fw.close()
    secs["total"] = time.perf_counter() - t_all
    steps = tuple(s for s, _ in picked)
    ev = evidence(steps, passes, pairs)
    return HistoryResult(picked, passes, ev, source, _log(cfg.run_dir, steps), secs)


def evidence(
    steps: tuple[int, ...], passes: list[CheckpointPass], pairs: list[list[TensorDiff]]
) -> HistoryEvidence:
    """The walk's figures as trajectories: per checkpoint from the passes, per pair (dated at
    its later checkpoint; NaN at the first) from the diffs."""
    nan = math.nan
    attn = list(dict.fromkeys(m for p in passes for m in p.attn_max))
    head = next((p.head for p in passes if p.head), None)
    out: list[Trajectory] = []
    for m in attn:
        out.append(
            Trajectory(m, "attn_max_logit", steps, tuple(p.attn_max.get(m, nan) for p in passes))
        )
        out.append(
            Trajectory(m, "attn_entropy", steps, tuple(p.attn_entropy.get(m, nan) for p in passes))
        )
    if head is not None:
        out.append(Trajectory(head, "log_z", steps, tuple(p.log_z for p in passes)))
        out.append(Trajectory(head, "max_logit", steps, tuple(p.max_logit for p in passes)))
    mods = list(dict.fromkeys(m for p in passes for m in p.rms))
    for m in mods:
        out.append(Trajectory(m, "act_rms", steps, tuple(p.rms.get(m, nan) for p in passes)))
    names = list(dict.fromkeys(t.name for pair in pairs for t in pair))
    by_pair = [{t.name: t for t in pair} for pair in pairs]
    for name in names:
        for field_, metric in _DIFF_FIGURES.items():
            vals = [nan] + [
                float(getattr(bp[name], field_)) if name in bp else nan for bp in by_pair
            ]
            if any(math.isfinite(v) for v in vals):
                out.append(Trajectory(name, metric, steps, tuple(vals)))
        steps_lr = [nan] + [_sign_steps(bp[name]) if name in bp else nan for bp in by_pair]
        if any(math.isfinite(v) for v in steps_lr):
            out.append(Trajectory(name, "max_step", steps, tuple(steps_lr)))
    return HistoryEvidence(
        steps=steps, attn_modules=tuple(attn), head=head, trajectories=tuple(out)
    )


def _log(run_dir: Path, steps: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """The training log's loss and grad norm over the walked steps (the report's step axis)."""
    path = find_metrics(run_dir)
    if path is None:
        return {}
    try:
        rows = read_metrics(path)
    except ForensicsError as e:  # an unreadable log leaves the history whole
        log.warning("training log %s not read: %s", path, e)
        return {}
    lo, hi = steps[0], steps[-1]
    return {
        s: {k: float(r[k]) for k in ("loss", "grad_norm") if k in r}
        for s, r in sorted(rows.items())
        if lo <= s <= hi and ("loss" in r or "grad_norm" in r)
    }
