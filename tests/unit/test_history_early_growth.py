"""History's output-logit rule on log Z trajectories written by hand: a log Z that grows from
the run's first checkpoints (no trend of its own to leave) is named and dated where its climb
began, one that settled past the cap is not, and a strong drift since the cap keeps its rule
(docs/signatures.md#history-output, issue #45)."""

from __future__ import annotations

from ckptforensics.detectors import Finding
from ckptforensics.detectors.history import HistoryEvidence, Trajectory, departure, history_findings
from ckptforensics.detectors.history.logits import EARLY_Z

STEPS = tuple(range(10, 160, 10))  # 15 checkpoints


def _found(log_z: list[float]) -> list[Finding]:
    t = Trajectory("lm_head", "log_z", STEPS, tuple(log_z))
    return history_findings(
        HistoryEvidence(steps=STEPS, attn_modules=(), head="lm_head", trajectories=(t,))
    )


def test_a_log_z_growing_from_the_start_is_dated_where_its_climb_began() -> None:
    # log V ~ 4.2 at init, the climb from 7 at step 30 past 30, then a noisy steady drift:
    # past 30 for good only from step 90, too few checkpoints after it for 6 standard errors
    lz = [4.2, 4.4, 7.0, 14.0, 22.0, 28.0, 31.0, 29.0, 33.0, 35.0, 32.0, 36.0, 38.0, 35.0, 40.0]
    assert departure(Trajectory("lm_head", "log_z", STEPS, tuple(lz)), 1.5) is None
    (f,) = _found(lz)
    assert f.supports == ("output_logit_divergence",) and f.primary and f.subject == "lm_head"
    assert f.metrics["drift_rule"] == "early_growth"
    # the last checkpoint at or under a quarter of the cap is step 30: the climb began at 40
    assert f.metrics["onset_step"] == 40
    assert f.metrics["drift_from"] == 50  # the first checkpoint at or past half the cap
    assert f.metrics["slope_z"] > EARLY_Z
    assert "began at step 40" in f.metrics["onset_rule"]


def test_a_log_z_that_settled_past_the_cap_is_no_drift() -> None:
    # the same climb, then a level that stays at 31-34: no drift, whatever window
    assert (
        _found(
            [4.2, 4.4, 7.0, 14.0, 22.0, 28.0, 31.0, 33.0, 32.0, 34.0, 32.0, 33.0, 31.0, 34.0, 32.0]
        )
        == []
    )


def test_a_z_loss_like_log_z_that_peaks_and_falls_is_quiet() -> None:
    assert (
        _found([4.2, 5.0, 10.0, 20.0, 16.0, 13.0, 11.0, 10.0, 9.0, 9.0, 8.0, 7.0, 5.0, 4.0, 4.0])
        == []
    )


def test_a_strong_drift_since_the_cap_keeps_its_rule() -> None:
    lz = [4.2, 4.4, 7.0, 14.0, 22.0, 28.0, 31.0, 29.0, 33.0, 36.0, 32.0, 37.0, 38.0, 36.0, 41.0]
    (f,) = _found(lz)
    assert f.metrics["drift_rule"] == "since_cap" and f.metrics["slope_z"] > 6
    # no departure on the climb: dated where the climb began (after 7.0 at step 30), not at 90
    # where it passed 30 for good
    assert f.metrics["onset_step"] == 40
