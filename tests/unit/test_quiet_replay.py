"""The verdict weighs a diff warning against a replay of the same window: a gradient burst the
moments imply is refuted by a replay that matched the log step by step, landed on *after* and
saw no step spike (held-out draw 9454), and stands whenever the replay is anything less."""

from __future__ import annotations

from ckptforensics.detectors import Finding
from ckptforensics.verdict import decide, quiet_replay, reattribute


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
