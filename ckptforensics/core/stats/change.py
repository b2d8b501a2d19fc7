"""Where a level shift starts: the change point between two levels of a curve, placed by each
step's one-step likelihood under the level before and the level after, outliers of both
levels left out (docs/signatures.md#log-shift).

A window test (ranks of the steps after a start against those before it) says a shift
happened near a start; the start it finds best can be a step no level explains (a hard batch
one step before the fault ranks top on either side, and the window that counts it among the
"after" steps ranks best). The change point is then the split that makes the steps best
explained by the two levels, each step costing its squared distance to its level in noise
units, capped at `BIWEIGHT_K` (Fearnhead & Rigaill 2019, "Changepoint detection in the
presence of outliers", JASA 114: the biweight loss min(z^2, K^2)): a step far from both
levels costs the same on either side and does not move the split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BIWEIGHT_K", "biweight_change"]

# The biweight loss's cap, in noise units: a step further than this from a level is an outlier
# of it. 3 is Fearnhead & Rigaill's choice (their simulations and R package robseg), and the
# z/2 band the log rules read a blip as back in (`detectors.log.blips`: OLMo-core's 6 sigma,
# halved).
BIWEIGHT_K = 3.0


def biweight_change(
    x: Sequence[float],
    candidates: Sequence[int],
    before: float,
    after: float,
    scale: float,
    k: float = BIWEIGHT_K,
) -> int:
    """The candidate index c that best splits `x` into a level `before` (the steps before c)
    and a level `after` (c and the steps after), under the biweight loss min(z^2, k^2) with
    z = (x - level) / scale: only the steps between the first and last candidate move with c,
    so only they are read. Ties go to the earliest candidate. Non-finite steps sit above both
    levels (an outlier of each).
    """
    c = np.asarray(sorted(candidates), dtype=np.int64)
    if c.size == 0:
        raise ValueError("no candidate change point")
    v = np.asarray(x, dtype=np.float64)[c[0] : c[-1]]
    v = np.where(np.isfinite(v), v, np.inf)
    with np.errstate(invalid="ignore"):
        cost_before = np.minimum(((v - before) / scale) ** 2, k * k)
        cost_after = np.minimum(((v - after) / scale) ** 2, k * k)
    cost_before = np.where(np.isfinite(v), cost_before, k * k)
    cost_after = np.where(np.isfinite(v), cost_after, k * k)
    # Splitting at c puts the steps c[0]..c-1 with the level before and c..c[-1]-1 after.
    head = np.concatenate([[0.0], np.cumsum(cost_before)])
    tail = np.concatenate([np.cumsum(cost_after[::-1])[::-1], [0.0]])
    total = head[c - c[0]] + tail[c - c[0]]
    return int(c[int(np.argmin(total))])
