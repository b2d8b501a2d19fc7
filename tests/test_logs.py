"""Training logs as trainers write them (fixtures/log_formats.py): every format read, the legs
of a run restarted twice merged (the latest leg winning), steps as each trainer counts them,
and `triage` finding on each what it finds on the run's own metrics.jsonl."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.triage import triage
from ckptforensics.logs import (
    MissingExtra,
    find_logs,
    find_metrics,
    read_log,
    read_metrics,
)
from ckptforensics.trainers.megatron.logs import iteration_line
from tests.conftest import ROOT

FORMATS = (
    "jsonl",
    "megatron",
    "tensorboard",
    "megatron-tb",
    "lightning",
    "lightning-tb",
    "wandb",
    "mlflow",
)


def _built(call: str, out: Path) -> Any:
    """`fixtures.log_formats.<call>(out)` in a fresh interpreter: W&B, MLflow and the HF
    Trainer's reporters leave process-wide state behind (environment variables, MLflow's
    tracking URI) that the tests after these in the same process must not inherit."""
    code = (
        "import json, sys; from pathlib import Path; "
        f"sys.path.insert(0, {str(ROOT)!r}); from fixtures.log_formats import {call}; "
        f"r = {call}(Path(sys.argv[1])); print(json.dumps({{k: str(v) for k, v in r.items()}} if isinstance(r, dict) else str(r)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {k: Path(v) for k, v in got.items()} if isinstance(got, dict) else Path(got)


@pytest.fixture(scope="session")
def formats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _built("build", tmp_path_factory.mktemp("log-formats"))


def _truth(formats: dict[str, Path]) -> dict:
    return json.loads((formats["run"] / "truth.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_merges_its_three_legs_into_the_runs_own_steps(
    formats: dict[str, Path], fmt: str
) -> None:
    own = read_metrics(formats["run"] / "metrics.jsonl")
    log = read_log(formats[fmt])
    assert sorted(log.rows) == sorted(
        own
    )  # steps as the trainer counts them (Lightning's one-behind, W&B's _step undone)
    for s, r in own.items():
        assert log.rows[s]["loss"] == pytest.approx(r["loss"], rel=1e-6), (
            s
        )  # leg 1's NaN at 22 was replaced by leg 2's
        assert log.rows[s]["grad_norm"] == pytest.approx(
            r["grad_norm"], rel=1e-6, abs=5e-4 if fmt == "megatron" else 0
        )  # printed :.3f
    legs = [(leg.first, leg.last) for leg in log.legs]
    assert legs == [tuple(x) for x in _truth(formats)["legs"]]
    assert [leg.superseded for leg in log.legs] == [2, 7, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_triage_gives_the_jsonl_onset_and_rollback_on_every_format(
    formats: dict[str, Path], fmt: str
) -> None:
    run = formats["run"]
    ref = triage(run / "metrics.jsonl", run)
    t = _truth(formats)
    assert (ref.first_bad_step, ref.rollback_step) == (t["first_bad_step"], t["rollback"])
    got = triage(formats[fmt], run)  # the folder: its legs discovered and merged
    assert (got.first_bad_step, got.rollback_step) == (ref.first_bad_step, ref.rollback_step)
    assert got.onsets[0].signal == ref.onsets[0].signal
    assert len(got.files) == (1 if fmt in ("jsonl", "megatron") else 3) and len(got.legs) == 3


def test_discovery_finds_each_format_where_its_trainer_puts_it(formats: dict[str, Path]) -> None:
    names = {fmt: [Path(f).name for f in find_logs(formats[fmt])] for fmt in FORMATS}
    assert names["jsonl"] == ["metrics.jsonl"] and names["megatron"] == ["train.log"]
    assert names["lightning"] == ["metrics.csv"] * 3
    assert all(
        n.startswith("events.out.tfevents.")
        for f in ("tensorboard", "megatron-tb", "lightning-tb")
        for n in names[f]
    )
    assert names["wandb"] == ["run-legs0001.wandb"] * 3
    assert len(names["mlflow"]) == 3
    assert find_metrics(formats["megatron"]) == formats["megatron"] / "train.log"
    assert (
        find_metrics(formats["wandb"]) == formats["wandb"]
    )  # several files: the folder, which read_metrics merges


def test_cli_triage_says_which_files_it_read(formats: dict[str, Path]) -> None:
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(formats["tensorboard"]), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (
        doc["first_bad_step"] == 35
        and doc["log_format"] == "tensorboard"
        and len(doc["files"]) == 3
    )
    r = CliRunner().invoke(
        cli,
        [
            "triage",
            "--metrics",
            str(formats["megatron-tb"] / "tensorboard" / "events.*"),
            "--run-dir",
            str(formats["run"]),
        ],
    )
    assert r.exit_code == 0, r.output
    assert (
        "first bad step: 35" in r.output
        and r.output.count("  leg ") == 3
        and "rollback checkpoint: " in r.output
    )


def test_megatron_counts_iterations_not_samples(formats: dict[str, Path]) -> None:
    """Megatron writes every curve twice to TensorBoard, against iterations and against
    consumed samples ("lm loss vs samples"); its printed line carries both."""
    rows = read_metrics(formats["megatron-tb"])
    assert max(rows) == 50 and not any(k.endswith("vs samples") for r in rows.values() for k in r)
    text = read_metrics(formats["megatron"] / "train.log")
    assert text[50]["consumed samples"] == 400 and text[50]["lr"] == pytest.approx(
        rows[50]["lr"], rel=1e-6
    )


def test_megatron_line_in_both_megatrons_formats() -> None:
    """Megatron-LM's training_log() line (date, :.6E LR) and Megatron-DeepSpeed's (no date,
    :.3E LR, consumed tokens, TFLOPs)."""
    lm = (" [2026-12-01 10:00:00.000000] iteration      100/  500000 | consumed samples:        51200 | elapsed time per iteration (ms): 812.3 |"
          " learning rate: 1.499999E-05 | global batch size:   512 | lm loss: 6.412345E+00 | loss scale: 65536.0 | grad norm: 1.234 |"
          " number of skipped iterations:   0 | number of nan iterations:   0 |")  # fmt: skip
    step, vals = iteration_line(lm)  # type: ignore[misc]
    assert (
        step == 100
        and vals["lm loss"] == pytest.approx(6.412345)
        and vals["loss scale"] == 65536
        and vals["consumed samples"] == 51200
    )
    ds = (" iteration     3000/  292968 | consumed samples:      1536000 | consumed tokens:   3145728000 | elapsed time per iteration (ms): 4012.8 |"
          " learning rate: 5.994E-05 | global batch size:   512 | lm loss: 1.412345E+01 | loss scale: 4096.0 | grad norm: 0.000 |"
          " actual seqlen:  2048 | number of skipped iterations:   3 | number of nan iterations:   0 | samples per second: 127.591 |"
          " tokens per gpu per second (tgs): 2041.4 | TFLOPs: 109.38 |")  # fmt: skip
    step, vals = iteration_line(ds)  # type: ignore[misc]
    assert (
        step == 3000
        and vals["lm loss"] == pytest.approx(14.12345)
        and vals["number of skipped iterations"] == 3
        and vals["TFLOPs"] == pytest.approx(109.38)
    )


def test_a_missing_extra_is_one_line(
    formats: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(
        MissingExtra,
        match=r"needs the tensorboard package \(pip install 'ckptforensics\[tensorboard\]'\)",
    ):
        read_log(formats["tensorboard"])
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(formats["tensorboard"])])
    assert (
        r.exit_code == 2 and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    )


def test_a_torn_wandb_file_keeps_what_precedes_the_tear(
    formats: dict[str, Path], tmp_path: Path
) -> None:
    """A run killed mid-write leaves a last record cut short: the records before it are read."""
    src = find_logs(formats["wandb"])[-1]
    data = src.read_bytes()
    torn = tmp_path / src.name
    torn.write_bytes(data[: len(data) - 300])
    rows = read_metrics(torn)
    assert rows and max(rows) <= 50 and all(math.isfinite(r["loss"]) for r in rows.values())


MEGATRON_RUN = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "megatron-lm-log"


@pytest.mark.parametrize("log", ["train.log", "tensorboard"])
def test_megatron_lms_own_log_of_a_restarted_run(log: str) -> None:
    """Megatron-LM's training_log() printed these lines and wrote these events (megatron-core
    0.19 on CPU, fixtures/megatron_log_run.py): a schedule x100 from iteration 30, a crash
    after 34, a restart from the iteration-30 checkpoint appending to the same log."""
    t = json.loads((MEGATRON_RUN / "truth.json").read_text())
    got = read_log(MEGATRON_RUN / log)
    assert [(leg.first, leg.last) for leg in got.legs] == [tuple(x) for x in t["legs"]]
    assert got.legs[0].superseded == 4  # iterations 31-34 of the crashed leg, replaced
    lrs = 0
    for r in t["steps"]:
        s = r["step"]
        assert got.rows[s]["loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert got.rows[s]["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6, abs=5e-4)
        if "lr" in got.rows.get(s + 1, {}):  # Megatron logs at s the LR its scheduler set for s + 1
            assert got.rows[s + 1]["lr"] == pytest.approx(r["lr"], rel=1e-6)
            lrs += 1
    # none past the last; the restarted leg's first step (31) reads the LR the crashed leg
    # printed at 30, where the checkpoint it loaded left the scheduler (issue #42)
    assert lrs == len(t["steps"]) - 1 and got.rows[31]["lr"] == pytest.approx(t["steps"][29]["lr"])
    res = triage(MEGATRON_RUN / log, None)
    assert res.first_bad_step == t["first_bad_step"] and res.rule == "lr-growth"


def test_hf_trainers_three_reporters_log_its_steps(tmp_path: Path) -> None:
    """transformers' Trainer with report_to tensorboard, wandb and mlflow: each callback's
    log read back gives the Trainer's own trainer_state.json, step for step (W&B's `_step`
    counts log calls from 0; the Trainer's `train/global_step` is the step)."""
    run = _built("hf_trainer_reporters", tmp_path / "hf")
    state = read_metrics(next(run.glob("checkpoint-*/trainer_state.json")))
    for where in (run / "runs", run / "wandb" / "latest-run", run / "mlruns"):
        if where.name == "mlruns":
            got = read_log(next(p.parent for p in where.glob("*/*/meta.yaml")))
        else:
            got = read_log(where)
        train = {s: r for s, r in got.rows.items() if "loss" in r}
        assert sorted(train) == sorted(s for s, r in state.items() if "loss" in r), where
        for s, r in train.items():
            assert r["loss"] == pytest.approx(state[s]["loss"], rel=1e-6), (where, s)
            assert r["grad_norm"] == pytest.approx(state[s]["grad_norm"], rel=1e-6)
            assert r["lr"] == pytest.approx(state[s]["lr"], rel=1e-6)
    assert [Path(f).name for f in find_logs(run)] == [
        "trainer_state.json"
    ]  # the Trainer's own log comes first


def test_mlflow_3s_sqlite_store(tmp_path: Path) -> None:
    """MLflow 3's default local store (`sqlite:///mlflow.db`), written by MLflow itself
    (fixtures/mlflow_sqlite_run.py): the three legs merge into the run's own steps, the store
    is found in a run folder, read without being written, and triaged as the run's JSONL is."""
    import shutil

    from tests.conftest import tree_hash

    src = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "mlflow-3-sqlite"
    shutil.copy(src / "mlflow.db", tmp_path / "mlflow.db")
    before = tree_hash(tmp_path)
    own = read_metrics(src / "metrics.jsonl")
    log = read_log(tmp_path)  # discovered: mlflow.db
    assert [Path(f).name for f in log.files] == ["mlflow.db"] and [
        (leg.first, leg.last, leg.superseded) for leg in log.legs
    ] == [(1, 22, 2), (21, 37, 7), (31, 50, 0)]
    assert sorted(log.rows) == sorted(own) and all(
        log.rows[s]["loss"] == pytest.approx(r["loss"], rel=1e-12) for s, r in own.items()
    )
    assert (
        triage(tmp_path, None).first_bad_step
        == triage(src / "metrics.jsonl", None).first_bad_step
        == 35
    )
    assert tree_hash(tmp_path) == before
