"""A megatron-core run whose only training log is Megatron-LM's printed iteration lines (issue #42).

megatron-core 0.19 on CPU wrote everything under fixtures/data/megatron-core-0.19-printed-lr
(fixtures/megatron_printed_lr_run.py): a scheduler fault x50 on iterations 54-56, a crash after
58, a restart from the iteration-50 checkpoint that prints 51-58 again into the same train.log,
checkpoints 50 and 60 (`--ckpt-format torch`) and the batch log of every iteration, without
an LR. The replay of 50 -> 60 has its LR from the printed lines alone; step 51's is on the
crashed leg's line of iteration 50 (Megatron prints, at N, the LR of N + 1). The code before
#42's fixes replayed the LR stored in *before*, did not spike and named silent_corruption (90%).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptforensics.trainers  # noqa: F401  (registers Megatron's printed log with logs)
from ckptforensics.cli import cli
from ckptforensics.logs import find_logs, read_log
from tests.conftest import ROOT

RUN = ROOT / "fixtures" / "data" / "megatron-core-0.19-printed-lr"


def _truth() -> dict:
    return json.loads((RUN / "truth.json").read_text())


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    return run


def _replay(run: Path, tmp_path: Path) -> dict:
    t = _truth()
    out = tmp_path / "rep"
    args = ["replay", "--run-dir", str(run), "--before", str(t["before"])]
    args += ["--after", str(t["after"]), "--batch", str(run / "batches.h5"), "--out", str(out)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    return json.loads((out / "report.json").read_text())


def _causes(doc: dict) -> list[str]:
    return [c["cause"] for c in doc["verdict"]["causes"]]


def test_the_printed_log_is_the_runs_only_log_and_states_every_steps_lr() -> None:
    """The two legs merge into the run's own iterations (51-58 of the crashed leg superseded),
    and every step's LR, read from the line before it, is the one megatron-core's optimizer
    used, the restarted leg's first step included."""
    t = _truth()
    assert [Path(f).name for f in find_logs(RUN)] == ["train.log"]
    got = read_log(RUN / "train.log")
    assert [(leg.first, leg.last) for leg in got.legs] == [tuple(x) for x in t["legs"]]
    assert got.legs[0].superseded == 8
    for r in t["steps"]:
        s = r["step"]
        assert got.rows[s]["loss"] == pytest.approx(r["loss"], rel=1e-6)
        if s > 1:  # Megatron prints no line before its first iteration
            assert got.rows[s]["lr"] == pytest.approx(r["lr_used"], rel=1e-6), s
    bad = t["fault_iterations"]
    assert [s for s in range(t["before"] + 1, t["after"] + 1) if got.rows[s]["lr"] > 0.05] == bad


def test_replay_takes_the_lr_from_megatrons_printed_lines_and_finds_the_fault(
    tmp_path: Path,
) -> None:
    t = _truth()
    doc = _replay(_copy(tmp_path), tmp_path)
    v, cfg = doc["verdict"], doc["replay"]["config"]
    assert _causes(doc)[0] == t["cause"] == "lr_too_high"
    assert "silent_corruption" not in _causes(doc)
    assert v["first_bad_step"] == t["first_bad_step"] == 54
    assert v["replay_check"]["status"] == "matched" and v["reproducible"] is True
    assert cfg["lr"]["source"].startswith("training log")
    assert Path(cfg["metrics"]["value"]).name == "train.log"
    used = {r["step"]: r["lr_used"] for r in t["steps"]}
    for s, lrs in cfg["lr"]["value"].items():
        assert lrs[0] == pytest.approx(used[int(s)], rel=1e-6), s


def test_a_printed_log_that_lost_the_line_before_the_window_is_explained_by_its_lr(
    tmp_path: Path,
) -> None:
    """The crashed leg's line of iteration 50 gone (a log cut where the restart began): step
    51 has no LR in the log, the plan replays before's stored LR, does not spike and misses
    the log at 55; the LR as the log states it, carried over the gap, lands: lr_too_high at 54,
    not hardware."""
    t = _truth()
    run = _copy(tmp_path)
    log = run / "train.log"
    line50 = re.compile(r"\biteration\s+50\s*/")
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join(x for x in lines if not line50.search(x)))
    assert "lr" not in read_log(log).rows[51]
    doc = _replay(run, tmp_path)
    assert _causes(doc)[0] == "lr_too_high" and "silent_corruption" not in _causes(doc)
    assert doc["verdict"]["first_bad_step"] == t["first_bad_step"]
    planned, *tried = doc["replay"]["variants"]
    assert planned["name"] == "as planned" and not planned["lands"]
    landed = [x for x in tried if x["lands"]]
    assert [x["name"] for x in landed] == ["the LR as the run's log states it"]
    assert landed[0]["matched_to"] == t["after"]
    assert doc["replay"]["config"]["lr"]["source"].startswith("training log lr as logged")
