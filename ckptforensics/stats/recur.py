"""Whether an excursion of a training curve recurs at a fixed period: a fixed data order puts
the same hard batch at the same step of every epoch, so its loss blip comes back every
`epoch` steps, whatever the run's noise does in between.

The period is read from the log's own blips (no epoch length needs to be logged): the
differences between the excursion's step and the other blips' steps, and their halves and
thirds (an occurrence the log missed: an overflowed, skipped iteration, a blip under the
threshold), are the candidate periods; one holds when the log has a blip at most of the steps
it predicts (docs/signatures.md#log-recurring).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["RECUR_MIN_PERIOD", "recurrence_period"]

# An epoch shorter than this many steps recurs too often to be told from the log's own noise
# (a blip every few steps is the log's texture: the tail rule's business), and a period that
# short would put several occurrences inside one recovery window.
RECUR_MIN_PERIOD = 8


def recurrence_period(
    step: int,
    blips: Collection[int],
    logged: Sequence[int],
    spacing: int = 1,
    min_period: int = RECUR_MIN_PERIOD,
) -> int | None:
    """The smallest period P (in steps) at which the excursion at `step` recurs: the log has
    an excursion (`blips`: steps where the log's loss is out of line, non-finite or
    overflowed lines included) at two or more of the steps `step` +- kP that it logged
    (`logged`, sorted), and
    at no fewer than half of them. On a log that prints every `spacing` steps (Megatron's
    --log-interval), a step is matched by the line within `spacing` of it when P is not a
    multiple of the spacing. None when no period holds.

    >>> recurrence_period(150, {50, 100, 200}, list(range(1, 301)))
    50
    >>> recurrence_period(150, {37, 240}, list(range(1, 301))) is None
    True
    """
    others = sorted(b for b in blips if b != step)
    if len(others) < 2 or not logged:
        return None
    lo, hi = logged[0], logged[-1]
    present = set(logged)
    cands = sorted(
        {
            abs(b - step) // k
            for b in others
            for k in (1, 2, 3)
            if abs(b - step) % k == 0 and abs(b - step) // k >= min_period
        }
    )
    for p in cands:
        tol = 0 if p % spacing == 0 else spacing
        hits = seen = 0
        for k in range(-(step - lo) // p, (hi - step) // p + 1):
            if k == 0:
                continue
            at = step + k * p
            near = [t for t in range(at - tol, at + tol + 1) if t in present]
            if not near:
                continue
            seen += 1
            hits += any(t in blips for t in near)
        if hits >= 2 and 2 * hits >= seen:
            return p
    return None
