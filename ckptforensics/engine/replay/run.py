"""Replay the window's steps from the *before* state with probes, and compare with *after*:
the plan (`window`), its calibration (`settle`), the runs under each clip candidate, the
best kept and checked against the run's own log."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import torch

from ckptforensics.engine.replay.logcheck import check_against_log
from ckptforensics.engine.replay.records import (
    AFTER_SHARE,
    ReplayConfig,
    ReplayResult,
    StepRecord,
    TensorMatch,
    after_share,
)
from ckptforensics.engine.replay.session import Session
from ckptforensics.engine.replay.settle import diagnose_miss, log_score, settle
from ckptforensics.engine.replay.variants import Variant, explain, resume_step
from ckptforensics.engine.replay.window import Plan, plan, run_window
from ckptforensics.trainers import require_rebuilt_match

__all__ = [
    "ReplayConfig",
    "StepRecord",
    "TensorMatch",
    "ReplayResult",
    "Plan",
    "Session",
    "plan",
    "replay",
]

log = logging.getLogger(__name__)


def _check_rebuilt(p: Plan, result: ReplayResult) -> None:
    """Rebuilt batches are trusted only when the first step replays to the logged loss."""

    first = result.records[0]
    require_rebuilt_match(
        first.step, (first.loss, first.grad_norm), p.logged.get(first.step), p.precision
    )


def replay(
    cfg: ReplayConfig, progress: Callable[[str], None] | None = None, steps: list[int] | None = None
) -> ReplayResult:
    """Replay the window from *before* with probes; compare with *after* when given, and
    every replayed step with the run's own log (`logcheck`).

    With no clipping stated anywhere, the window is replayed under each usual setting and
    the one that reproduces *after* best is kept; without *after*, the one that reproduces
    the log best (calibration, said in the report). A replay that misses the log on its
    first step is not calibrated further (the first step does not depend on the clip): it
    carries the likeliest reason (`diagnose_miss`) for the detectors to withhold it.

    Raises:
        ForensicsError: bad checkpoints, model, batches or configuration.
    """
    torch.manual_seed(0)
    p = plan(cfg, steps)
    settle(p, progress)
    best: tuple[tuple[float, float], ReplayResult] | None = None
    todo = list(p.clips)
    tried: set[float | None] = set()
    while todo:
        clip, csrc = todo.pop(0)
        tried.add(clip)
        named = f"pass {len(tried)}, clip {clip or 'none'}" if todo or len(tried) > 1 else ""
        result = run_window(p, clip, in_pass(progress, named, len(p.steps)))
        if p.batches.rebuilt and best is None:  # the first step does not depend on the clip
            _check_rebuilt(p, result)
        result.config = p.config(clip, csrc)
        result.logged = {s: p.logged[s] for s in p.steps if s in p.logged}
        result.baseline = p.baseline()
        result.following = p.following()
        result.check = check_against_log(
            result.records, p.logged, p.precision, p.batches.micro_batch_size, clip
        )
        err = (
            (_mismatch_score(result), log_score(result.check))
            if p.b is not None
            else (log_score(result.check), 0.0)
        )
        if best is None or err < best[0]:
            best = (err, result)
        miss = result.check.first_miss
        if miss is not None and miss.step == p.steps[0]:
            break  # nothing a clip changes reaches the first step
        if not todo and best[0][0] > 0 and csrc.startswith("calibrated"):
            # Neither usual setting lands: the other clip norms trainers use, where they
            # would have clipped at all (below the window's largest grad norm).
            top = max(
                (r.grad_norm for r in result.records if math.isfinite(r.grad_norm)), default=0.0
            )
            how = csrc.split(":")[0]
            todo = [(c, f"{how}: {c:g}") for c in CLIP_CANDIDATES if c not in tried and c < top]
    assert best is not None
    result = _explained(p, best[1], progress)
    miss = result.check.first_miss
    if miss is not None and miss.step == result.check.first_checked:
        result.diagnosis = diagnose_miss(p, miss, result.check.loss_atol)
    return result


def _explained(
    p: Plan, result: ReplayResult, progress: Callable[[str], None] | None
) -> ReplayResult:
    """The replay as planned where it lands on the run's log; where it parts from it, the
    explanations the run's files name replayed from the same state (`variants.explain`), the
    one that lands kept, every one listed with the step up to which it matched."""
    result.plan = p
    miss = result.check.first_miss
    share = after_share(result)
    # On the log, off *after*, with a resume the step counters name: a fresh optimizer's first
    # steps can stay within the log's tolerance (held-out draw 9970, read after scoring: an
    # HF Trainer resumed with its weights only matched its log for 5 steps, not after).
    on_after = (
        miss is None and share is not None and share > AFTER_SHARE and resume_step(p) is not None
    )
    if miss is None and not on_after:
        return result
    tried, landed = explain(p, result, result.config["clip"]["value"], progress, on_after)
    if not tried:
        return result
    earlier = [s for s in p.steps if miss is None or s < miss.step]
    planned = Variant(
        "as planned",
        f"LR: {p.lr_source}; optimizer: the state saved in before",
        None,
        False,
        earlier[-1] if earlier else None,
        miss.step if miss is not None else None,
        f"on the log; {share:.1%} of after's elements missed"
        if on_after and share is not None
        else "",
    )
    out = landed if landed is not None else result
    out.variants = [planned, *tried]
    out.explained_by = next((v for v in tried if v.lands), None)
    return out


def in_pass(
    progress: Callable[[str], None] | None, name: str, n_steps: int
) -> Callable[[str], None] | None:
    """The callback of one replay of the window: each step's message says which pass (`name`,
    when the window is replayed more than once) and where in the window it is ("pass 2, clip
    1.0: step 33 (3 of 5)")."""
    if progress is None:
        return None
    seen = [0]

    def say(what: str) -> None:
        seen[0] += 1
        progress(f"{name + ': ' if name else ''}{what} ({seen[0]} of {n_steps})")

    return say


# Clip norms seen in practice beyond 1.0 (HF/Megatron/OLMo default): 0.5 (GPT-NeoX
# configs), 0.3 (some Llama recipes), 2.0 and 5.0 (loose clipping in small-batch runs).
CLIP_CANDIDATES = (0.3, 0.5, 2.0, 5.0)


def _mismatch_score(result: ReplayResult) -> float:
    if not result.matches:
        return 0.0
    return float(np.mean([m.mismatched / max(m.numel, 1) for m in result.matches]))
