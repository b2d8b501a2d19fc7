"""The central statistics (ckptforensics.core.stats) on numbers alone: no training, seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from ckptforensics.core.stats import (
    CURVE_MIN_HISTORY,
    MAD_TO_SIGMA,
    TrendBaseline,
    expected_exceedances,
    family_z,
    loss_follows,
    robust_sigma,
    robust_z,
    t_robust_z,
    tail_df,
    theil_sen_at,
    trend_z,
)


def test_robust_z_is_median_and_scipys_normal_mad() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_t(3, 2001)
    mad = stats.median_abs_deviation(x, scale="normal")
    want = (x - np.median(x)) / mad
    assert np.allclose(robust_z(x), want, rtol=2e-6)  # 1.4826 vs scipy's 1/Phi^-1(3/4)
    assert robust_sigma(x) == pytest.approx(mad, rel=2e-6)
    assert pytest.approx(1 / stats.norm.ppf(0.75), rel=2e-6) == MAD_TO_SIGMA


def test_robust_z_floor_reference_axis_and_nonfinite() -> None:
    assert np.all(robust_z(np.ones(10)) == 0)  # MAD 0: floored, no division by zero
    z = robust_z(np.array([1.0, 1.0, 1.0, 2.0]), floor=0.5)
    assert z[-1] == pytest.approx(2.0)
    x = np.array([0.0, 1.0, np.inf, np.nan])
    z = robust_z(x, reference=np.array([0.0, 1.0, 2.0, 3.0, 4.0]))
    assert z[2] == math.inf and z[3] == math.inf  # non-finite values are extreme by definition
    ref = np.array(
        [[1.0, np.nan], [2.0, np.nan], [3.0, np.nan]]
    )  # a module that never ran: NaN column
    z = robust_z(np.array([5.0, 1.0]), reference=ref, axis=0)
    assert z[0] == pytest.approx((5 - 2) / (1 * MAD_TO_SIGMA)) and math.isnan(z[1])


def test_theil_sen_line_is_scipys() -> None:
    rng = np.random.default_rng(1)
    xs = list(range(100, 116))
    ys = list(0.01 * np.arange(16) + rng.normal(0, 0.1, 16))
    ys[5] += 3.0  # one outlier moves the line little
    r = stats.theilslopes(ys, xs, method="joint")
    assert theil_sen_at(xs, ys, 120) == pytest.approx(r.intercept + r.slope * 120, abs=1e-12)


def test_trend_z_flags_a_spike_on_a_falling_curve_and_follows_a_new_level() -> None:
    rng = np.random.default_rng(2)
    steps = np.arange(200)
    loss = (
        6.0 * np.exp(-steps / 80) + 2.0 + rng.normal(0, 0.01, 200)
    )  # a steep, then slowing descent
    loss[120] *= 1.6
    z, level = trend_z(loss)
    assert np.all(z[:CURVE_MIN_HISTORY] == 0) and np.all(np.isnan(level[:CURVE_MIN_HISTORY]))
    assert z[120] > 6 and np.argmax(z) == 120
    assert np.sum(z > 6) == 1  # the descent itself is followed, never flagged
    assert level[120] == pytest.approx(loss[119], rel=0.03)
    held = np.concatenate([np.full(60, 2.0), np.full(40, 3.0)]) * (1 + rng.normal(0, 0.005, 100))
    z, _ = trend_z(held)
    assert z[60] > 6 and np.all(z[70:] < 6)  # flagged once, then the new level is the baseline


def test_trend_baseline_online_equals_the_whole_curve() -> None:
    rng = np.random.default_rng(3)
    vals = list(np.exp(rng.normal(0, 0.05, 300)) * np.linspace(5, 3, 300))
    vals[150] = math.nan
    z, level = trend_z(vals, above_level=True)
    tb = TrendBaseline(above_level=True)
    for i, v in enumerate(vals):
        zi, base = tb.push(v)
        assert zi == pytest.approx(z[i]) or (math.isinf(zi) and math.isinf(z[i]))
        assert (math.isnan(base) and math.isnan(level[i])) or base == pytest.approx(level[i])


def test_loss_follows() -> None:
    quiet = [0.0] * 20
    assert not loss_follows(quiet, 2)  # the loss ignores the spike
    assert loss_follows([0.0, 0.0, 3.5, *[0.0] * 17], 2)  # half z on the spike's own step
    assert loss_follows([0.0, 0.0], 1)  # the log ends before the loss could answer: benefit
    assert not loss_follows([0.0, 0.0], 1, benefit=False)
    assert not loss_follows(
        [0.0, 0.0, 4.0, *[0.0] * 17], 2, routine=True
    )  # a backoff needs a real spike
    assert loss_follows([0.0, 0.0, 7.0, *[0.0] * 17], 2, routine=True)


def test_thresholds_count_the_tests_and_the_tails() -> None:
    assert family_z(1, 0.01) == pytest.approx(stats.norm.isf(0.01))
    assert family_z(20000) > family_z(100) > family_z(1)
    assert expected_exceedances(20000, 6.0) < 1e-4
    assert t_robust_z(1e-4, 1e6) == pytest.approx(stats.norm.isf(1e-4), rel=1e-3)  # t -> normal
    assert t_robust_z(1e-4, 3) > 2.5 * stats.norm.isf(1e-4)
    rng = np.random.default_rng(4)
    assert tail_df(robust_z(rng.standard_t(3, 20000))) == pytest.approx(3, rel=0.3)
    assert tail_df(robust_z(rng.normal(size=20000))) > 30
    assert math.isnan(tail_df(np.zeros(10)))


def test_biweight_change_point_leaves_an_outlier_of_both_levels_out() -> None:
    """Fearnhead & Rigaill's biweight loss: a step far from both levels costs K^2 on either
    side and does not move the split; a step back at the old level keeps it there."""
    from ckptforensics.core.stats import biweight_change

    x = [0.0] * 10 + [5.0, 0.0] + [1.0] * 8
    assert biweight_change(x, range(6, 16), before=0.0, after=1.0, scale=0.1) == 12
    # The same outlier followed by the new level at once: the split is at the outlier (ties go
    # to the earliest candidate), as a fault's first step that overshoots.
    x = [0.0] * 10 + [5.0] + [1.0] * 9
    assert biweight_change(x, range(6, 16), before=0.0, after=1.0, scale=0.1) == 10
    assert biweight_change([0.0, math.nan, 1.0], range(0, 3), 0.0, 1.0, 0.1) == 1


def test_recurrence_on_a_log_printed_every_5_steps() -> None:
    """An epoch of 64 steps on lines every 5: excursions on the lines of 155, 220 and 280
    (the hard steps 152, 216, 280) recur at a period of 64 within the lines' resolution."""
    from ckptforensics.core.stats import recurrence_period

    p = recurrence_period(280, {155, 220}, list(range(5, 301, 5)), spacing=5)
    assert p is not None and 60 <= p <= 69, p
    assert recurrence_period(280, {155}, list(range(5, 301, 5)), spacing=5) is None
