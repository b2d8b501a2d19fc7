"""Robust location and scale: the one robust z of the package.

The median and the median absolute deviation (MAD) resist the outliers these z-scores
are built to find; `scipy.stats.median_abs_deviation(x, scale="normal")` is the reference
the unit tests hold `robust_z` to (tests/unit/test_stats.py).
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["MAD_TO_SIGMA", "robust_z", "robust_sigma"]

# MAD -> standard deviation for normal data (the one consistency constant; Rousseeuw & Croux
# 1993). scipy's scale="normal" is 1/Phi^-1(3/4) = 1.482602...: 1.5e-6 apart, kept at four
# digits so reports stay byte-identical to those written before scipy joined.
MAD_TO_SIGMA = 1.4826


def robust_z(
    values: np.ndarray,
    floor: float = 0.0,
    reference: np.ndarray | None = None,
    axis: int | None = None,
) -> np.ndarray:
    """Robust z-scores: (x - median) / (1.4826 * MAD), MAD floored to stay finite.

    The one robust z of the package. `reference` (default: the values themselves) gives
    the population the values are judged against (the window's other steps, say); with
    `axis`, medians run along that axis of the reference (per module across steps) and
    NaN entries of the reference are ignored. The floor keeps a population of
    near-identical values from turning a tiny absolute difference into a huge z; pass a
    scale-aware floor (e.g. 5% of the median) where the statistic is a ratio.
    Non-finite values get +inf.
    """
    x = np.asarray(values, dtype=np.float64)
    if axis is not None:
        ref = np.asarray(reference, dtype=np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", RuntimeWarning
            )  # all-NaN columns: modules that never ran
            med = np.nanmedian(ref, axis=axis)
            mad = np.nanmedian(np.abs(ref - med), axis=axis) * MAD_TO_SIGMA
        return (x - med) / np.maximum(mad, max(floor, 1e-12))
    out = np.zeros_like(x)
    finite = np.isfinite(x)
    ref = x[finite] if reference is None else np.asarray(reference, dtype=np.float64)
    ref = ref[np.isfinite(ref)]
    if ref.size < 3 or not finite.any():
        return out
    med = float(np.median(ref))
    mad = float(np.median(np.abs(ref - med))) * MAD_TO_SIGMA
    scale = max(mad, floor, 1e-12)
    out[finite] = (x[finite] - med) / scale
    out[~finite] = np.inf
    return out


def robust_sigma(values: np.ndarray) -> float:
    """1.4826 x MAD of the finite values (the normal-consistent robust spread); NaN when
    fewer than 3 are finite."""
    x = np.asarray(values, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size < 3:
        return float("nan")
    return float(np.median(np.abs(x - np.median(x)))) * MAD_TO_SIGMA
