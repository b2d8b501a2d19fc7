"""recovery's pure rules: the trajectory fit, the windows, the verdict, Adam's step counter
against the trainer's, the legs of a restarted log, the plan's checks. No training here; the
resumed runs of the trainers themselves are in tests/test_plan_recovery.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ckptforensics.core.stats import CURVE_FLOOR, MAD_TO_SIGMA
from ckptforensics.engine.recovery import (
    Z_BAND,
    Leg,
    fit_trajectory,
    judge,
    optimizer_resumed,
    read_legs,
    split_legs,
    summarize,
    verdict_of,
)
from ckptforensics.engine.recovery.trajectory import FLOAT_RESOLUTION


def _power(
    steps: range, a: float = 4.0, b: float = -0.25, noise: float = 0.01, seed: int = 0
) -> dict[int, float]:
    """A loss curve a * step^b with multiplicative log-normal noise (log10 sd `noise`)."""
    rng = np.random.default_rng(seed)
    return {s: a * s**b * 10 ** rng.normal(0, noise) for s in steps}


def _rows(loss: dict[int, float], grad: float = 1.0) -> dict[int, dict[str, float]]:
    return {s: {"loss": v, "grad_norm": grad} for s, v in loss.items()}


def test_the_trajectory_is_the_power_law_the_history_follows() -> None:
    hist = _power(range(1, 201))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    assert abs(t.slope - -0.25) < 0.02
    # extrapolated 100 steps on, within 1% of the curve
    assert abs(t.at(300) / (4.0 * 300**-0.25) - 1) < 0.01
    assert t.fitted_on == (101, 200) and t.n == 100  # the last half: the recent regime
    # the noise is the curve's own (log10 sd 0.01), by both estimates: no constant floor
    assert abs(t.residual_sigma - 0.01) < 0.002 and abs(t.step_sigma - 0.01) < 0.002
    assert t.sigma == max(t.residual_sigma, t.step_sigma)


def test_a_history_too_short_has_no_trajectory() -> None:
    assert fit_trajectory([1, 2, 3], [3.0, 2.9, 2.8]) is None


def test_windows_on_the_curve_are_on_the_trajectory_and_a_lift_is_not() -> None:
    hist = _power(range(1, 101))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    g = fit_trajectory(list(hist), [1.0] * len(hist))
    on = _power(range(101, 141), seed=1)
    w = judge(_rows(on), t, g, [])
    assert all(x.in_band for x in w) and all(x.z <= Z_BAND for x in w)
    status, step, _ = verdict_of(w, [], _rows(on), t)
    assert (status, step) == ("recovered", 101)
    lifted = {s: v * 1.3 for s, v in on.items()}  # 30% above: not back
    w = judge(_rows(lifted), t, g, [])
    assert not any(x.in_band for x in w)
    assert all(abs(x.ratio - 1.3) < 0.05 for x in w)
    status, step, trend = verdict_of(w, [], _rows(lifted), t)
    assert status == "not recovered" and step is None and trend is not None and not trend["closing"]


def test_a_gap_closing_is_recovering_then_recovered_once_held() -> None:
    hist = _power(range(1, 101))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    after = _power(range(101, 125), seed=2)
    closing = {s: v * (1 + 0.5 * math.exp(-(s - 101) / 6)) for s, v in after.items()}
    w = judge(_rows(closing), t, None, [])
    status, _, trend = verdict_of(w, [], _rows(closing), t)
    assert status in ("recovering", "recovered")
    longer = {**closing, **_power(range(125, 161), seed=3)}
    w = judge(_rows(longer), t, None, [])
    status, step, _ = verdict_of(w, [], _rows(longer), t)
    assert (
        status == "recovered" and step is not None and step > 101
    )  # not from the first window: it was off then


def test_an_onset_after_the_resume_is_a_relapse_at_its_step() -> None:
    hist = _power(range(1, 101))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    after = _rows(_power(range(101, 141), seed=4))
    w = judge(after, t, None, [117])
    status, step, _ = verdict_of(w, [117], after, t)
    assert (status, step) == ("relapsed", 117)
    assert [x.onsets for x in w if x.onsets] == [[117]] and not next(
        x for x in w if x.onsets
    ).in_band


def test_too_few_steps_on_the_trajectory_are_recovering_not_recovered() -> None:
    hist = _power(range(1, 101))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    after = _rows(_power(range(101, 111), seed=5))
    status, step, trend = verdict_of(judge(after, t, None, []), [], after, t)
    assert status == "recovering" and step == 101 and trend is not None and trend["held"] == 10


# ---------------------------------------------------------------- quiet runs: the run's own band
def _quiet(steps: range, scale: float = 1.0) -> dict[int, float]:
    """A loss with near-zero noise (full-batch data, a small LR): 4 step^-0.06, log10 sd 1e-5."""
    return {s: v * scale for s, v in _power(steps, b=-0.06, noise=1e-5).items()}


def test_a_quiet_curves_noise_is_its_own_step_to_step_movement() -> None:
    hist = _quiet(range(1, 31))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None and t.fitted_on == (15, 30)
    # the residuals are near zero; the successive differences still see the curve move
    y = np.log10([hist[s] for s in range(15, 31)])
    assert t.step_sigma == MAD_TO_SIGMA * float(np.median(np.abs(np.diff(y)))) / math.sqrt(2)
    assert t.residual_sigma < t.step_sigma / 10 and t.sigma == t.step_sigma
    assert t.sigma < CURVE_FLOOR / 10  # far finer than a constant floor
    # a curve that does not move at all: float32's resolution keeps z finite
    flat = fit_trajectory(list(range(1, 31)), [2.5] * 30)
    assert flat is not None and flat.sigma == FLOAT_RESOLUTION
    same = {s: {"loss": 2.5} for s in range(31, 51)}
    assert verdict_of(judge(same, flat, None, []), [], same, flat)[:2] == ("recovered", 31)


def test_a_quiet_leg_on_its_trajectory_is_recovered_whatever_its_grad_norm() -> None:
    """Issue #42 item 5: 40 steps on the trajectory (last window 0.993x), the grad norm
    0.82-0.93x its level before the incident, was "not recovered: the gap is not closing"."""
    hist = _quiet(range(1, 31))
    grad = {s: 2.0 * s**-0.25 for s in hist}  # falling after warmup, as quiet runs' do
    loss_t = fit_trajectory(list(hist), list(hist.values()))
    grad_t = fit_trajectory(list(grad), list(grad.values()), held=True)
    assert loss_t is not None and grad_t is not None and grad_t.held
    # the grad norm's level is the highest its trend ran at, not the falling line carried on
    assert grad_t.expected(70) == grad_t.at(15) > grad_t.at(70)
    level = grad[30]
    on = _quiet(range(31, 71), 0.993)
    rows = {
        s: {"loss": v, "grad_norm": level * (0.82 + 0.11 * (s - 31) / 39)} for s, v in on.items()
    }
    w = judge(rows, loss_t, grad_t, [])
    assert all(x.in_band for x in w) and abs(w[-1].ratio - 0.993) < 1e-3
    status, step, trend = verdict_of(w, [], rows, loss_t)
    assert (status, step, trend) == ("recovered", 31, None)
    assert summarize(status, step, 30, w, trend, [], []).startswith("Recovered at step 31")
    # a grad norm that climbs above its level while the loss keeps its trajectory decides
    # nothing (triage's rule: the loss follows, or it is the run's own dynamics); it is said
    up = {s: {"loss": r["loss"], "grad_norm": 3.0 * level} for s, r in rows.items()}
    w = judge(up, loss_t, grad_t, [])
    assert all(x.in_band for x in w) and all(x.grad_z is not None and x.grad_z > Z_BAND for x in w)
    status, step, trend = verdict_of(w, [], up, loss_t)
    assert (status, step) == ("recovered", 31)
    assert "above its band" in summarize(status, step, 30, w, trend, [], [])


def test_a_gap_is_judged_to_the_quiet_runs_band_and_only_a_gap_is_not_closing() -> None:
    hist = _quiet(range(1, 31))
    t = fit_trajectory(list(hist), list(hist.values()))
    assert t is not None
    # 3% behind a noiseless trajectory is far outside its band (a constant 0.02 floor, 4.7%,
    # called it on track): a gap, not closing
    behind = _rows(_quiet(range(31, 71), 1.03))
    w = judge(behind, t, None, [])
    assert not any(x.in_band for x in w) and all(x.z > 2 * Z_BAND for x in w)
    status, step, trend = verdict_of(w, [], behind, t)
    assert status == "not recovered" and step is None
    assert trend is not None and not trend["closing"] and abs(trend["gap_now"] - 1.03) < 1e-3
    assert "the gap is not closing" in summarize(status, step, 30, w, trend, [], [])
    # the same gap shrinking is closing: recovering, back around a step after the leg
    closing = {
        s: {"loss": v * (1.03 + 0.05 * (70 - s) / 40)} for s, v in _quiet(range(31, 71)).items()
    }
    status, _, trend = verdict_of(judge(closing, t, None, []), [], closing, t)
    assert status == "recovering" and trend is not None and trend["closing"]
    assert trend["projected_step"] is not None and trend["projected_step"] > 70
    # a leg within the band has no gap: never "not closing", however long it is
    on = _rows(_quiet(range(31, 131)))
    w = judge(on, t, None, [])
    assert all(x.in_band for x in w)
    assert verdict_of(w, [], on, t) == ("recovered", 31, None)


def test_adams_step_counter_tells_a_resumed_optimizer_from_a_fresh_one() -> None:
    assert optimizer_resumed([40.0] * 5, 40, 30).status == "ok"
    lost = optimizer_resumed([10.0] * 5, 40, 30)
    assert lost.status == "failed" and lost.step == 30 and "restarted at step 30" in lost.message
    part = optimizer_resumed([40.0, 40.0, 10.0], 40, 30)
    assert part.status == "failed" and "partly" in part.message
    # OLMo-core's Adam runs one ahead of the trainer: read off the rollback checkpoint
    assert optimizer_resumed([41.0] * 3, 40, 30, offset=1.0).status == "ok"
    # fp16: overflow-skipped updates in the resumed leg lower Adam's count
    assert optimizer_resumed([38.0] * 3, 40, 30, skipped=2).status == "ok"
    assert optimizer_resumed([], 40, 30).status == "unknown"


def test_a_log_a_restart_appends_to_splits_into_legs(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 3.0 - s / 100, "grad_norm": 1.0} for s in range(1, 41)]
    rows += [{"step": s, "loss": 3.0 - s / 100 + 0.01, "grad_norm": 1.0} for s in range(31, 61)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    legs = read_legs(tmp_path)
    assert [(leg.first, leg.last) for leg in legs] == [(1, 40), (31, 60)]
    sp = split_legs(legs, 30)
    assert (
        list(sp.pre) == list(range(1, 31))
        and list(sp.incident) == list(range(31, 41))
        and list(sp.resumed) == list(range(31, 61))
    )
    assert (
        sp.resumed[35]["loss"] == 3.0 - 35 / 100 + 0.01
    )  # the resumed leg's own value, not the incident's


def test_one_leg_logging_past_the_resume_is_the_resumed_leg() -> None:
    """An HF Trainer's trainer_state.json carries the rows it resumed with: one leg."""
    leg = Leg("trainer_state.json", {s: {"loss": 1.0} for s in range(1, 61)})
    sp = split_legs([leg], 45)
    assert list(sp.resumed) == list(range(46, 61)) and not sp.incident and max(sp.pre) == 45


# fixtures/recovery_draws.py draw 0 resumed as it was (`none`), its log as the loop wrote it
# (rounded): a full batch at LR 1e-3, the grad norm rising and falling by half while the loss
# stays smooth, the poisoned batch back at step 40 (the incident leg ran to 50, the resumed one
# from 36 to 67, step for step the same run).
_DRAW0_LOSS = [
    4.1729,
    4.1436,
    4.0864,
    4.0072,
    3.9194,
    3.8348,
    3.7494,
    3.6593,
    3.5736,
    3.4977,
    3.4238,
    3.3565,
    3.2948,
    3.236,
    3.1792,
    3.1242,
    3.0703,
    3.0169,
    2.964,
    2.9114,
    2.859,
    2.8065,
    2.7537,
    2.7013,
    2.6487,
    2.596,
    2.5434,
    2.4907,
    2.4379,
    2.3851,
    2.3322,
    2.2795,
    2.2269,
    2.1744,
    2.1238,
    2.0728,
    2.0219,
    1.9716,
    1.9218,
    3.3581,
    1.8477,
    1.8069,
    1.7639,
    1.7195,
    1.6832,
    1.6417,
    1.6004,
    1.5651,
    1.5218,
    1.4851,
    1.4478,
    1.4069,
    1.372,
    1.332,
    1.2942,
    1.2584,
    1.2187,
    1.1824,
    1.1482,
    1.1102,
    1.0749,
    1.0421,
    1.0069,
    0.9729,
    0.9426,
    0.9129,
    0.8788,
]
_DRAW0_GRAD = [
    2.087,
    2.059,
    1.936,
    1.649,
    1.373,
    1.483,
    1.662,
    1.518,
    1.243,
    1.368,
    1.369,
    1.237,
    1.229,
    1.233,
    1.2,
    1.194,
    1.194,
    1.184,
    1.165,
    1.14,
    1.131,
    1.13,
    1.119,
    1.111,
    1.117,
    1.101,
    1.102,
    1.103,
    1.083,
    1.079,
    1.066,
    1.066,
    1.081,
    1.229,
    1.757,
    1.543,
    1.213,
    1.222,
    1.476,
    8.553,
    2.932,
    1.468,
    2.723,
    1.468,
    2.781,
    1.979,
    2.194,
    2.277,
    1.183,
    2.163,
    1.392,
    1.695,
    1.586,
    1.404,
    1.816,
    1.645,
    1.126,
    1.301,
    1.763,
    1.833,
    1.418,
    1.92,
    1.338,
    1.333,
    1.765,
    2.519,
    1.026,
]


def test_a_grad_norm_rise_within_its_own_range_dates_no_relapse_the_loss_does(
    tmp_path: Path,
) -> None:
    """The grad norm at step 39 (1.48) is an onset on its own narrow trend, but no higher than
    it ran before the incident (1.76 at step 35): the relapse is the loss's, at step 40."""
    from ckptforensics.engine.recovery import recovery

    def row(s: int) -> str:
        lr = 1e-3 * min(s, 10) / 10
        return json.dumps(
            {"step": s, "loss": _DRAW0_LOSS[s - 1], "grad_norm": _DRAW0_GRAD[s - 1], "lr": lr}
        )

    steps = [*range(1, 51), *range(36, 68)]
    (tmp_path / "metrics.jsonl").write_text("".join(row(s) + "\n" for s in steps))
    res = recovery(tmp_path, 35)
    assert (res.status, res.step) == ("relapsed", 40), res.summary
    assert "the grad norm's rise at step 39" in res.summary
