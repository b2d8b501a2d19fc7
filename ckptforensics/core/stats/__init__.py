"""The package's central statistics: robust z, a curve judged against its own trend, whether the
loss follows a seed signal, and thresholds that count how many values are tested.

Pure functions over numbers (no files, no torch): triage, the replay, bisect and the
recorder's monitor all judge a step by these (docs/signatures.md#log-onset).
"""

from __future__ import annotations

from ckptforensics.core.stats.change import BIWEIGHT_K, biweight_change
from ckptforensics.core.stats.follow import LOSS_FOLLOW, loss_follows
from ckptforensics.core.stats.recur import RECUR_MIN_PERIOD, RECUR_WEAK_Z, recurrence_period
from ckptforensics.core.stats.robust import MAD_TO_SIGMA, robust_sigma, robust_z
from ckptforensics.core.stats.thresholds import (
    expected_exceedances,
    family_alpha,
    family_z,
    t_robust_z,
    tail_df,
)
from ckptforensics.core.stats.trend import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    CURVE_SHORT,
    CURVE_WINDOW,
    TrendBaseline,
    log_curve,
    theil_sen,
    theil_sen_at,
    trend_z,
)

__all__ = [
    "MAD_TO_SIGMA",
    "robust_z",
    "robust_sigma",
    "CURVE_SHORT",
    "CURVE_WINDOW",
    "CURVE_FLOOR",
    "CURVE_MIN_HISTORY",
    "log_curve",
    "trend_z",
    "TrendBaseline",
    "theil_sen_at",
    "theil_sen",
    "BIWEIGHT_K",
    "biweight_change",
    "LOSS_FOLLOW",
    "loss_follows",
    "family_z",
    "expected_exceedances",
    "family_alpha",
    "t_robust_z",
    "tail_df",
    "RECUR_MIN_PERIOD",
    "recurrence_period",
    "RECUR_WEAK_Z",
]
