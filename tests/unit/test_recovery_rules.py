"""recovery's pure rules: the trajectory fit, the windows, the verdict, Adam's step counter
against the trainer's, the legs of a restarted log, the plan's checks. No training here; the
resumed runs of the trainers themselves are in tests/test_plan_recovery.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from ckptforensics.engine.recovery import (
    Z_BAND,
    Leg,
    fit_trajectory,
    judge,
    optimizer_resumed,
    read_legs,
    split_legs,
    verdict_of,
)


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
    assert t.sigma >= 0.02  # the noise floor (CURVE_FLOOR)


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
