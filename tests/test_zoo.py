"""The scoreboard on the zoo: every field the tool produces matches the planted truth."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.zoo import DIFF_BLIND, Row, score


@pytest.fixture(scope="session")
def board(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Row]:
    root = next(iter(zoo.values())).parent
    return {r.incident: r for r in score(root, tmp_path_factory.mktemp("reports"))}


def test_every_incident_is_scored(board: dict[str, Row]) -> None:
    assert {
        "healthy-nanogpt",
        "lr_jump",
        "silent_corruption",
        "poison_batch",
        "gradient_explosion",
        "adam_instability",
        "fp16_overflow",
    } <= set(board)
    # Runs that logged their batches are judged by replay (which merges the diff).
    assert {r.command for r in board.values()} == {"replay", "diff"}
    assert board["poison_batch"].command == "replay"


def test_cause_top1(board: dict[str, Row]) -> None:
    for name, row in board.items():
        if row.command == "diff" and "cause" in DIFF_BLIND.get(row.truth_cause, {}):
            assert row.cause == "none", name  # not observable from a diff: no other cause claimed
            continue
        assert row.cause_ok, f"{name}: {row.cause} != {row.truth_cause}"


@pytest.mark.parametrize(
    "field", ["layer_ok", "samples_ok", "first_bad_step_ok", "element_ok", "reproducible_ok"]
)
def test_fields_the_tool_produces_match(board: dict[str, Row], field: str) -> None:
    for name, row in board.items():
        assert getattr(row, field) in (None, True), f"{name}: {field}"


def test_replay_settles_what_the_diff_cannot(board: dict[str, Row]) -> None:
    assert board["poison_batch"].samples_ok is True
    assert board["fp16_overflow"].layer_ok is True
    assert board["silent_corruption"].reproducible == "false"
    # A transient fault during training leaves no impossible element: only the replay, which
    # matches the run's log up to the spike and does not spike, names it.
    hw = board["hardware_fault"]
    assert (hw.cause_ok, hw.reproducible, hw.first_bad_step_ok) == (True, "false", True)
    assert all(
        board[n].reproducible == "true" for n in ("lr_jump", "poison_batch", "healthy-nanogpt")
    )
    assert all(
        board[n].first_bad_step_ok
        for n in (
            "lr_jump",
            "poison_batch",
            "gradient_explosion",
            "fp16_overflow",
            "adam_instability",
        )
    )


def test_no_false_alarm_on_healthy_runs(board: dict[str, Row]) -> None:
    healthy = [r for r in board.values() if r.truth_cause == "none"]
    assert len(healthy) >= 5
    assert not any(r.false_alarm for r in healthy)
