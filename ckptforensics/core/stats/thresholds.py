"""Thresholds that account for how many values are tested, and for how heavy a log's tails are.

A z of 6 on one normal value is a 1e-9 event; over 20,000 steps of a loss curve it is still
rare (2e-5 expected), but the same 6 read in robust units on a curve whose noise is
Student-t with 3 degrees of freedom is passed a few hundred times. These helpers say what
a threshold means on the data at hand (scipy.stats distributions, imported on first use:
`import ckptforensics` stays fast).
"""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats.robust import MAD_TO_SIGMA

__all__ = ["family_alpha", "family_z", "expected_exceedances", "t_robust_z", "tail_df"]


def family_z(n_tests: int, alpha: float = 0.01) -> float:
    """The one-sided normal z that n independent tests of null values all stay under with
    probability 1 - alpha (Sidak's correction): what a threshold must be for `n_tests`
    steps, tensors or modules tested at once to give one false alarm in 1/alpha runs.

    >>> round(family_z(1), 2), round(family_z(20000), 2)
    (2.33, 4.89)
    """
    from scipy import stats

    n = max(int(n_tests), 1)
    per_test = -math.expm1(math.log1p(-alpha) / n)  # 1 - (1 - alpha)^(1/n), without cancellation
    return float(stats.norm.isf(per_test))


def family_alpha(n_tests: int, alpha: float = 0.01) -> float:
    """The per-test level at which n independent tests of null values all pass with
    probability 1 - alpha (Sidak's correction; `family_z` is its normal quantile).

    >>> round(family_alpha(300), 7)
    3.35e-05
    """
    n = max(int(n_tests), 1)
    return -math.expm1(math.log1p(-alpha) / n)


def expected_exceedances(n_tests: int, z: float) -> float:
    """How many of n normal values exceed z (one-sided): the count a clean log shows."""
    from scipy import stats

    return float(n_tests * stats.norm.sf(z))


def t_robust_z(p: float, df: float) -> float:
    """The upper p-quantile of Student-t noise with `df` degrees of freedom, in the robust
    units (1.4826 x MAD) every z of this package is read in."""
    from scipy import stats

    mad = float(stats.t.ppf(0.75, df))
    return float(stats.t.isf(p, df)) / (MAD_TO_SIGMA * mad)


def tail_df(z: np.ndarray, lo: float = 1.0, hi: float = 100.0) -> float:
    """Degrees of freedom of the Student-t whose robust-unit tail matches the curve's own:
    the share of |z| above 4 among the finite robust z of a log's steps, solved for df
    (large: normal; 2-5: the heavy tails of a loss logged from one micro-batch). NaN with
    too few values to say (under 50)."""
    from scipy import stats

    x = np.abs(np.asarray(z, dtype=np.float64))
    x = x[np.isfinite(x)]
    if x.size < 50:
        return math.nan
    share = float(np.mean(x > 4.0))
    normal = 2 * stats.norm.sf(4.0)
    if share <= normal:
        return hi

    def excess(df: float) -> float:
        return 2 * float(stats.t.sf(4.0 * MAD_TO_SIGMA * stats.t.ppf(0.75, df), df)) - share

    if excess(lo) < 0:
        return lo
    from scipy.optimize import brentq

    return float(brentq(excess, lo, hi)) if excess(hi) < 0 else hi
