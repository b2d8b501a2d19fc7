"""The verdict weighs a diff warning against a replay of the same window: a gradient burst the
moments imply is refuted by a replay that matched the log step by step, landed on *after* and
saw no step spike (held-out draw 9454), and stands whenever the replay is anything less."""

from __future__ import annotations

from ckptforensics.detectors import Finding
from ckptforensics.verdict import decide, quiet_replay, reattribute, replay_fields


def _burst() -> Finding:
    return Finding(
        "F1",
        "gradient_burst",
        "transformer.h.1.ln_1.weight",
        1.36,
        "warning",
        {"r_v": 13.6, "robust_z": 14.2},
        "transformer.h.1.ln_1: gradient energy 13.6x its running average",
        "docs/signatures.md#gradient-burst",
        ("gradient_explosion",),
    )


def _reproduces() -> Finding:
    return Finding(
        "F2",
        "replay_reproduces",
        "run",
        1.0,
        "info",
        {"mismatched_share": 0.0},
        "reproduces",
        "s",
        (),
    )


def _agreement(status: str) -> Finding:
    return Finding(
        "F3",
        "replay_log_agreement",
        "run",
        1.0,
        "info",
        {"status": status, "first_checked": 381},
        "log",
        "s",
        (),
    )


def _spike() -> Finding:
    return Finding(
        "F4",
        "replay_spike",
        "step 390",
        2.0,
        "warning",
        {"step": 390},
        "spikes",
        "s",
        ("gradient_explosion",),
    )


def _verdict(findings: list[Finding]) -> str:
    return decide(reattribute(findings), before="a", after="b", replayed=True).causes[0]["cause"]


def test_a_quiet_matched_replay_refutes_the_diffs_burst() -> None:
    findings = [_burst(), _reproduces(), _agreement("matched")]
    assert quiet_replay(findings)
    burst = reattribute(findings)[0]
    assert burst.severity == "info" and burst.metrics["refuted_by_replay"]
    v = decide(reattribute(findings), before="a", after="b", replayed=True)
    assert v.causes[0]["cause"] == "none"
    assert v.rollback_checkpoint is None
    assert "transformer.h.1.ln_1" in v.summary and "none spiked" in v.summary


def test_the_burst_stands_where_the_replay_spikes_misses_or_is_unchecked() -> None:
    assert (
        _verdict([_burst(), _reproduces(), _agreement("matched"), _spike()]) == "gradient_explosion"
    )
    assert _verdict([_burst(), _reproduces(), _agreement("unchecked")]) == "gradient_explosion"
    assert (
        _verdict([_burst(), _agreement("matched")]) == "gradient_explosion"
    )  # did not land on after
    assert _verdict([_burst()]) == "gradient_explosion"  # the diff alone


def _diverged(first_checked: int, parted: int = 42) -> list[Finding]:
    spike = Finding(
        "F1",
        "replay_spike",
        "step 42",
        3.0,
        "warning",
        {"step": 42},
        "spikes",
        "s",
        ("lr_too_high",),
    )
    mismatch = Finding(
        "F2",
        "replay_config_mismatch",
        "w",
        1.0,
        "info",
        {"mismatched_share": 0.56},
        "deviates",
        "s",
        (),
    )
    log = {"status": "diverged_after_onset", "first_checked": first_checked, "step": parted}
    agreement = Finding(
        "F3", "replay_log_agreement", "run", 1.0, "info", log, "diverges after the spike", "s", ()
    )
    return [spike, mismatch, agreement]


def test_a_replay_that_matches_the_log_up_to_its_spike_and_parts_after_it_reproduces() -> None:
    """Held-out draws 9536, 9540, 9543: the replay matched every logged step before the spike,
    spiked, and parted from the log at or after it (a last-bit difference grows as fast as
    the spike): numerics or data, not hardware. Nothing checked before the spike: open."""
    assert replay_fields(_diverged(31))["reproducible"] is True
    assert replay_fields(_diverged(42))["reproducible"] is None
    # Checked from the onset on and matched past the spike's first effect (tuning draw 1483).
    assert replay_fields(_diverged(42, parted=45))["reproducible"] is True
    assert replay_fields(_diverged(42, parted=43))["reproducible"] is None
