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
    assert {"healthy-nanogpt", "lr_jump", "silent_corruption", "poison_batch", "gradient_explosion", "adam_instability", "fp16_overflow"} <= set(board)


def test_cause_top1(board: dict[str, Row]) -> None:
    for name, row in board.items():
        if "cause" in DIFF_BLIND.get(row.truth_cause, {}):
            # Not observable from a diff: the tool must not claim another cause.
            assert row.cause == "none", name
            continue
        assert row.cause_ok, f"{name}: {row.cause} != {row.truth_cause}"


def test_culprit_layer_and_element(board: dict[str, Row]) -> None:
    for name, row in board.items():
        if "cause" in DIFF_BLIND.get(row.truth_cause, {}):
            continue
        assert row.layer_ok in (None, True), f"{name}: layer {row.layer}"
        if row.layer_ok is None and row.truth_cause not in DIFF_BLIND:
            assert row.layer is None, name
        assert row.element_ok in (None, True), name


def test_no_false_alarm_on_healthy_runs(board: dict[str, Row]) -> None:
    healthy = [r for r in board.values() if r.truth_cause == "none"]
    assert len(healthy) >= 5
    assert not any(r.false_alarm for r in healthy)
