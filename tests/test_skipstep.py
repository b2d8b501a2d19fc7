"""OLMo-core's SkipStepAdamW skips updates; a replay skips the same ones (replay/skipstep.py).

`fixtures/data/olmo-core-3.0-warmup-skips` was written by OLMo-core 3.0's own Trainer
(`fixtures/olmo_core_run.py --warmup-skips`): 20 steps inside a 100-step warm-up, its
SkipStepAdamW skipping steps 16, 17 and 20 of the window 10 -> 20. Replaying every step
missed *after* on 95% of the elements.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.replay.run import ReplayConfig, replay
from tests.conftest import ROOT

OLMO = ROOT / "fixtures" / "data" / "olmo-core-3.0-warmup-skips"


def _skipped_by_the_run(lo: int, hi: int) -> list[int]:
    steps = json.loads((OLMO / "truth.json").read_text())["steps"]
    return [s["step"] for s in steps if lo < s["step"] <= hi and s["step_skipped"]]


def test_replay_skips_the_steps_olmo_core_skipped_and_lands_on_after(tmp_path: Path) -> None:
    want = _skipped_by_the_run(10, 20)
    assert want == [16, 17, 20]
    args = [
        "replay",
        "--run-dir",
        str(OLMO / "run"),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(OLMO),
        "--out",
        str(tmp_path / "rep"),
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    rep = doc["replay"]
    assert [s["step"] for s in rep["steps"] if s["skipped"]] == want
    assert "SkipStepAdamW" in rep["config"]["optimizer"]["value"]
    assert rep["reproduction"]["mismatched"] == 0 and rep["reproduction"]["elements"] == 56160
    # The optimizer's own guard, not an overflow: a healthy window.
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"


def test_without_the_logged_flags_olmo_cores_rule_decides(tmp_path: Path) -> None:
    """A log without `optim/step skipped`: the rule over the logged history and the replayed
    losses and grad norms finds the same steps."""
    run = tmp_path / "run"
    shutil.copytree(OLMO / "run", run)
    for f in run.glob("metrics*.json"):
        doc = json.loads(f.read_text())
        doc.pop("optim/step skipped", None)
        f.write_text(json.dumps(doc))
    res = replay(
        ReplayConfig(before=run / "step10", after=run / "step20", batch=str(OLMO / "batches.h5"))
    )
    assert [x.step for x in res.records if x.skipped] == _skipped_by_the_run(10, 20)
    assert res.matches is not None and sum(m.mismatched for m in res.matches) == 0
