"""history: every checkpoint of a run on one fixed batch. The two logit mechanisms named at their
layer and dated at their onset, their healthy twins quiet; checkpoints read in step order
whatever a trainer names them; the command's JSON, report files, errors and help.

The onset rule the attention-growth fixture defines (`fixtures/logit_runs.py`): the layer's
logits are a precursor of the spike at `first_bad_step` (102), so history must date their
departure at or before it, and after the warm-up's early learning (every layer's logits rise
from ~0 over the first checkpoints, then settle): within the last three checkpoints at or
before `first_bad_step` (steps 80, 90, 100 of that run, saved every 10 steps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from click.testing import CliRunner

import ckptforensics as cf
from ckptforensics.cli import cli
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"


@pytest.fixture(scope="module")
def logit_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures.logit_runs import build_logit_runs

    return build_logit_runs(tmp_path_factory.mktemp("logits"))


def _history(run: Path, **kw: Any) -> dict[str, Any]:
    return cf.history(run_dir=run, model=MODEL, **kw).doc


def _causes(doc: dict[str, Any]) -> list[str]:
    return [c["cause"] for c in doc["verdict"]["causes"]]


def test_attention_growth_names_its_layer_since_a_checkpoint_before_the_spike(
    logit_runs: dict[str, Path],
) -> None:
    run = logit_runs["attention_growth"]
    truth = json.loads((run / "truth.json").read_text())
    doc = _history(run)
    assert _causes(doc) == ["attention_logit_growth"]
    assert doc["verdict"]["first_anomalous_module"] == truth["layers"][0]
    steps = doc["history"]["steps"]
    allowed = [s for s in steps if s <= truth["first_bad_step"]][-3:]
    assert doc["history"]["onset_step"] in allowed, (doc["history"]["onset_step"], allowed)
    assert doc["history"]["onset_module"] == truth["layers"][0]
    # the rollback is the checkpoint before the onset, still on its trend
    before = steps[steps.index(doc["history"]["onset_step"]) - 1]
    assert doc["incident"]["before"]["step"] == before


def test_output_drift_names_the_head(logit_runs: dict[str, Path]) -> None:
    run = logit_runs["output_drift"]
    truth = json.loads((run / "truth.json").read_text())
    doc = _history(run)
    assert _causes(doc) == ["output_logit_divergence"]
    assert doc["verdict"]["first_anomalous_module"] == truth["layers"][0]
    onset = doc["history"]["onset_step"]
    lz = doc["history"]["trajectories"]["log_z"][truth["layers"][0]]
    at = doc["history"]["steps"].index(onset)
    # dated on its climb past Gemma 2's cap: after the last checkpoint at a quarter of it, at
    # or before the first from which it stays past it
    past = next(i for i in range(len(lz)) if all(abs(v) > 30 for v in lz[i:]))
    low = [i for i in range(past) if abs(lz[i]) <= 7.5]
    assert low and low[-1] < at <= past, (at, lz)


@pytest.mark.parametrize("twin", ["attention_growth-qknorm", "output_drift-zloss"])
def test_the_healthy_twins_raise_no_alarm(logit_runs: dict[str, Path], twin: str) -> None:
    doc = _history(logit_runs[twin])
    assert _causes(doc) == ["none"]
    assert doc["findings"] == []
    assert doc["verdict"]["first_anomalous_module"] is None
    assert doc["history"]["onset_step"] is None
    n = len(doc["history"]["checkpoints"])
    assert (
        doc["verdict"]["summary"].startswith(f"Over {n} checkpoints")
        and "no module left" in doc["verdict"]["summary"]
    )


def test_json_report_files_and_evidence(logit_runs: dict[str, Path], tmp_path: Path) -> None:
    run = logit_runs["attention_growth"]
    out = tmp_path / "h"
    args = ["history", "--run-dir", str(run), "--model", MODEL, "--from", "30", "--to", "110"]
    r = CliRunner().invoke(cli, [*args, "--out", str(out), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"]["causes"][0]["cause"] == "attention_logit_growth"
    assert doc["verdict"]["first_anomalous_module"] == "transformer.h.1.attn"
    assert doc["history"]["steps"] == list(range(30, 111, 10))
    assert isinstance(doc["history"]["onset_step"], int)
    md = (out / "report.md").read_text()
    assert "**Modules x checkpoints**" in md and "transformer.h.1.attn" in md
    assert "Modules x checkpoints: largest attention logit" in (out / "report.html").read_text()
    with h5py.File(out / "evidence.h5") as h:
        g = h["history"]
        assert list(g["step"][()]) == doc["history"]["steps"]
        mods = [m.decode() for m in g["attn_max_logit/modules"][()]]
        vals = g["attn_max_logit/values"][()]
        assert vals.shape == (len(mods), len(doc["history"]["steps"]))
        assert vals[mods.index("transformer.h.1.attn"), -1] > 50
        assert g["update_ratio/values"].shape[1] == len(doc["history"]["steps"])


# ----------------------------------------------------------------- step order, whatever the naming
def _order(doc: dict[str, Any]) -> list[int]:
    steps = [c["step"] for c in doc["history"]["checkpoints"]]
    assert steps == sorted(steps) and steps == doc["history"]["steps"]
    return steps


def test_nanogpt_step_files_in_step_order(logit_runs: dict[str, Path]) -> None:
    # step_100.pt sorts before step_20.pt by name: the walk goes by step
    doc = _history(logit_runs["attention_growth"])
    assert _order(doc) == list(range(10, 111, 10))
    assert [Path(c["path"]).name for c in doc["history"]["checkpoints"]][-2:] == [
        "step_100.pt",
        "step_110.pt",
    ]


def test_hf_trainer_checkpoint_dirs_in_step_order(tmp_path: Path) -> None:
    from fixtures.formats import build_hf

    run = build_hf(tmp_path)
    batch = tmp_path / "batch.pt"
    g = torch.Generator().manual_seed(0)
    torch.save({"input_ids": torch.randint(0, 64, (2, 16), generator=g)}, batch)
    doc = cf.history(run_dir=run, batch=batch).doc  # the model from its config.json
    assert _order(doc) == [10, 20, 30, 40]
    assert Path(doc["history"]["checkpoints"][0]["path"]).name == "checkpoint-10"
    assert doc["history"]["attn_modules"] == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert _causes(doc) == ["none"]


def test_own_loop_ckpt_files_in_step_order(tmp_path: Path) -> None:
    from fixtures.own_loop_layouts import build

    run = build(tmp_path, only=["ckpt"])["ckpt-healthy"]
    doc = _history(run, start=20)
    assert _order(doc) == [20, 30, 40, 50, 60]
    assert Path(doc["history"]["checkpoints"][-1]["path"]).name == "ckpt_60.pt"
    assert _causes(doc) == ["none"]


# ----------------------------------------------------------------- bad input, help
def test_bad_input_is_one_line_and_exit_2(logit_runs: dict[str, Path], tmp_path: Path) -> None:
    run = str(logit_runs["attention_growth"])
    r = CliRunner().invoke(cli, ["history", "--run-dir", str(tmp_path / "nope")])
    assert_bad_input(r, f"run directory {tmp_path / 'nope'} does not exist")
    r = CliRunner().invoke(cli, ["history", "--run-dir", run, "--from", "50", "--to", "40"])
    assert_bad_input(r, "--to 40 is not after --from 50")
    r = CliRunner().invoke(cli, ["history", "--run-dir", run, "--from", "50", "--to", "55"])
    assert_bad_input(r, "1 checkpoint(s) between steps 50 and 55, a history needs two or more")
    r = CliRunner().invoke(cli, ["history", "--run-dir", run, "--batch", "a.h5", "--data", "d"])
    assert_bad_input(r, "pass --batch or --data, not both")
    empty = tmp_path / "no-batch"
    empty.mkdir()
    for s in (10, 20):
        (empty / f"step_{s}.pt").write_bytes((Path(run) / f"step_{s}.pt").read_bytes())
    r = CliRunner().invoke(cli, ["history", "--run-dir", str(empty), "--model", MODEL])
    assert_bad_input(r, "no batch log found (batches.h5, flight/); pass --batch")


def test_help_teaches_with_an_example() -> None:
    r = CliRunner().invoke(cli, ["history", "--help"])
    assert r.exit_code == 0
    assert "Example:" in r.output
    assert "ckptforensics history --run-dir runs/7b --from 40000 --to 42000 --out hist/" in r.output
    assert "first_anomalous_module" in r.output and "onset_step" in r.output
