"""Whether the loss answers a grad-norm spike or a loss-scale backoff: the rule that makes a
seed signal an incident (triage, the replay, the recorder's monitor)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["LOSS_FOLLOW", "loss_follows"]

# Steps within which the loss must answer a grad-norm spike for it to start an incident: a
# bad update shows in the next steps' loss; twice the rolling median, measured on the tuning
# draws (fixtures/draws.py), where natural grad-norm blips the loss ignores are 2-4x.
LOSS_FOLLOW = 16


def loss_follows(
    z_loss: Sequence[float],
    i: int,
    z: float = 6.0,
    follow: int = LOSS_FOLLOW,
    z_grad: Sequence[float] | None = None,
    benefit: bool = True,
    routine: bool = False,
    z_level: Sequence[float] | None = None,
    settles: bool = False,
) -> bool:
    """Whether the loss follows a grad-norm spike (or loss-scale backoff) at index i: the loss
    at half the spike z on that step or the next (a poisoned batch's own loss, a bad update's
    first effect), or, within `follow` steps, a loss spike or two steps at half z reached
    while the grad norm stays up (z_grad >= z/2 on every step between: one excursion, not a
    blip followed by an unrelated spike). Where the curve ends before the loss could
    answer, it is given the benefit unless `benefit` is False (signals that are routine
    by design, a loss-scale backoff). A signal that is `routine` by design (a backoff, an
    overflow under a loss scaler) needs the loss's own spike (z) on that step or the next:
    a half-z echo of a plateau's noise is what a routine backoff meets half the time
    (tuning draw 1242: a 1.11x loss the step after a backoff)."""
    seen = [float(v) for v in z_loss[i : i + follow + 1]]
    if routine:
        return any(v > z for v in seen[:2]) or (len(seen) <= 1 and benefit)
    half = z / 2
    # The loss of the spike's own step (a poisoned batch's) answers at half z on its trend;
    # the next step's (a bad update's first effect) must also stand above where the loss
    # has just been (`z_level`: the curve judged `above_level`), where that curve is given:
    # in a descent, a half-z bump the step after a blip is the descent pausing (tuning draw
    # 1062: a natural 2.3x grad-norm blip, the next loss 8% up, below its last 8 steps' median).
    nxt = float(z_level[i + 1]) if z_level is not None and i + 1 < len(z_level) else math.inf
    if seen[0] >= half or (len(seen) > 1 and seen[1] >= half and nxt >= half):
        return True
    if settles and z_grad is not None and len(seen) > 1 and not z_grad[i + 1] >= half:
        return False  # the excursion ended on the next step, and the loss did not answer it
    run = len(seen)
    if z_grad is not None:
        run = 2
        for g in z_grad[i + 2 : i + len(seen)]:
            if not g >= half:
                break
            run += 1
    if len(seen) <= follow // 2 and not (settles and run < len(seen)):
        return benefit
    seen = seen[:run]
    return any(v > z for v in seen) or sum(v >= half for v in seen) >= 2
