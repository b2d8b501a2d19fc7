"""A per-group LR change inside the window, when the run's log gives one LR for all groups:
the replay finds the step it changed at from the log first (the change step's replay matches
the log longest), then from *after*'s weights of those groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fixtures.draws import build_draw, draw

SEED = 1381  # an HF Trainer run on Adafactor whose attention group's LR jumps 300x


def test_the_change_step_is_the_one_whose_replay_matches_the_log(
    tmp_path: Path, draw_report: Any
) -> None:
    d = draw(SEED)
    assert d.trainer == "hf" and d.optimizer == "adafactor" and d.module
    run = build_draw(SEED, tmp_path)
    t = json.loads((run / "truth.json").read_text())
    doc = draw_report(run)
    src = doc["replay"]["config"]["lr"]["source"]
    assert f"LR ratio changes at step {t['first_bad_step']}" in src, src
    assert doc["verdict"]["first_bad_step"] == t["first_bad_step"]
    assert doc["verdict"]["reproducible"] is True
    assert doc["verdict"]["causes"][0]["cause"] == t["cause"]
