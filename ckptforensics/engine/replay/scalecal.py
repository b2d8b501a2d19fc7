"""The fp16 loss scale calibrated where the run recorded none (`precision`'s docstring, 3):
starting scales tried under GradScaler's own dynamics, or the run's skips placed on the
window's steps, each a replay of the window judged against *after*."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

from ckptforensics.engine.replay.compare import compare_after
from ckptforensics.engine.replay.precision import (
    DEFAULT_INIT_SCALE,
    MAX_PLACEMENT_TRIALS,
    MAX_SCALE,
    MAX_SCALE_TRIALS,
)
from ckptforensics.engine.replay.window import Plan

__all__ = ["settle_loss_scale", "MATCH_SHARE_CAL"]

log = logging.getLogger(__name__)


def settle_loss_scale(p: Plan, progress: Callable[[str], None] | None = None) -> None:
    """Calibrate the loss scale where the run recorded none (module docstring, 3).

    First starting scales 2^k around the prior under GradScaler's own dynamics (a replayed
    overflow beyond the run's skips backed off and the step redone); the first that skips
    as many steps as the run did and reproduces *after* wins. A scale that grew inside the
    window (a loop's own `growth_interval`) shows no such start: then the run's skips are
    placed on the window's steps (each placement a replay: the scale doubled on a placed
    step until it overflows, backed off anywhere else), and the placement that reproduces
    *after* wins. Without *after* the prior stands (with the redo rule).
    """
    sp = p.scale
    if p.precision != "fp16" or sp is None or sp.start is not None:
        return
    if p.b is None or sp.skips is None:
        sp.start, sp.source = (
            sp.prior,
            f"prior: GradScaler's default {DEFAULT_INIT_SCALE:g} halved per skip before the window",
        )
        return
    k = sp.skips
    ups = [sp.prior * 2.0**i for i in range(0, 25) if sp.prior * 2.0**i <= MAX_SCALE]
    downs = [sp.prior * 2.0**-i for i in range(1, 25) if sp.prior * 2.0**-i >= 1.0]
    order = (
        [
            x
            for pair in zip(ups, downs + [None] * len(ups), strict=False)
            for x in pair
            if x is not None
        ]
        if k == 0
        else ups + downs
    )
    tried: list[
        tuple[float, float, frozenset[int] | None, int]
    ] = []  # (score, start, placement, skips)
    for s0 in order[:MAX_SCALE_TRIALS]:
        share, n_skipped, first = _trial(p, s0, None, progress, f"loss scale {s0:g}?")
        tried.append((share + (1.0 if n_skipped != k else 0.0), first, None, n_skipped))
        if n_skipped == k and share <= _LANDED:
            break
    if k > 0 and min(tried)[0] > _LANDED:
        # The highest start tried: a placed step doubles from it until it overflows, any
        # other step backs off from it until it does not.
        top = max(order[:MAX_SCALE_TRIALS])
        for placed in itertools.islice(itertools.combinations(p.steps, k), MAX_PLACEMENT_TRIALS):
            share, n_skipped, first = _trial(
                p, top, frozenset(placed), progress, f"skipped steps {list(placed)}?"
            )
            tried.append(
                (share + (1.0 if n_skipped != k else 0.0), first, frozenset(placed), n_skipped)
            )
            if share <= _LANDED:
                break
    score, s0, placed, n_skipped = min(tried, key=lambda t: t[0])
    sp.start, sp.force = s0, placed
    how = (
        f"the run's {k} skipped step(s) placed at {sorted(placed)}"
        if placed is not None
        else f"this start skips {n_skipped}"
    )
    sp.source = (
        f"calibrated: start {s0:g} ({len(tried)} replays of the window; the run skipped {k} of its {len(p.steps)} steps "
        f"by Adam's counters; {how}; prior {sp.prior:g})"
    )
    if score > MATCH_SHARE_CAL:
        log.warning("no loss-scale calibration reproduces after (best: %s)", sp.source)


# A calibration trial lands when at most this share of elements misses *after* (a tenth of
# the replay's reproducibility threshold, compare.MATCH_SHARE); MATCH_SHARE_CAL: the threshold.
_LANDED = 0.001
MATCH_SHARE_CAL = 0.01


def _trial(
    p: Plan,
    s0: float,
    placed: frozenset[int] | None,
    progress: Callable[[str], None] | None,
    what: str,
) -> tuple[float, int, float]:
    """Replay the window from loss scale `s0` (skips at `placed`, if given): (share of
    elements that miss *after*, steps skipped, the scale the first step ran at)."""
    assert p.scale is not None and p.b is not None
    if progress is not None:
        progress(what)
    p.scale.start, p.scale.force = s0, placed
    session = p.session()
    try:
        for s in p.steps:
            session.step(s, p.batches.batch(s), p.lrs[s], p.clips[0][0])
        assert session.loss_scaler is not None
        n_skipped = len(session.loss_scaler.skipped)
        first = session.loss_scaler.used.get(p.steps[0], s0)
        matches = compare_after(session, p.b, p.lrs)
        return (
            sum(m.mismatched for m in matches) / max(1, sum(m.numel for m in matches)),
            n_skipped,
            first,
        )
    finally:
        session.close()
