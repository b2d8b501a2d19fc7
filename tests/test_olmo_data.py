"""OLMo-core's training data read without OLMo-core, against the batches its own Trainer fed.

`fixtures/data/olmo-core-3.0` (written once by ai2-olmo-core 3.0, `fixtures/olmo_core_run.py`)
holds the run's token file, its checkpoints (config.json, train/rank0.pt) and batches.h5,
the token ids the model consumed at each step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.trainers.olmo_core.data import olmo_batches
from tests.conftest import ROOT
from tests.test_cli import assert_bad_input

OLMO = ROOT / "fixtures" / "data" / "olmo-core-3.0"


def test_every_step_is_the_batch_olmo_core_fed() -> None:
    src = olmo_batches(str(OLMO), OLMO / "run" / "step10")
    assert src.labels_shifted and src.rebuilt
    with h5py.File(OLMO / "batches.h5", "r") as h:
        steps, ids, labels = (
            np.asarray(h["step"]),
            np.asarray(h["input_ids"]),
            np.asarray(h["labels"]),
        )
    for i, s in enumerate(steps):
        b = src.batch(int(s))
        assert torch.equal(b["input_ids"], torch.from_numpy(ids[i]).long()), s
        assert torch.equal(b["labels"], torch.from_numpy(labels[i]).long()), s


def test_replay_an_olmo_core_run_from_its_own_data_with_no_batch_and_no_model(
    tmp_path: Path,
) -> None:
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
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"
    cfg = doc["replay"]["config"]
    assert "NumpyFSLDataset" in cfg["batches"]["value"] and "rebuilt" in cfg["batches"]["source"]


def test_token_files_that_are_not_the_runs_are_refused_in_one_line(tmp_path: Path) -> None:
    other = tmp_path / "data"
    shutil.copytree(OLMO / "tokens", other / "tokens")
    f = other / "tokens" / "part-00000.npy"
    tokens = np.fromfile(f, dtype=np.uint16)
    np.random.default_rng(1).shuffle(tokens)
    tokens.tofile(f)
    args = [
        "replay",
        "--run-dir",
        str(OLMO / "run"),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(other),
    ]
    assert_bad_input(CliRunner().invoke(cli, args), "the data pipeline differs")
    run = shutil.copytree(
        OLMO / "run", tmp_path / "moved" / "run"
    )  # away from the token files its paths are relative to
    args = [
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(tmp_path / "none"),
    ]
    assert_bad_input(CliRunner().invoke(cli, args), "no token file tokens/part-00000.npy")


def test_token_paths_relative_to_the_launch_directory_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OLMo-core recorded `dataset.paths` relative to where the run was launched (its save
    folder `run` sits there too). Replayed from elsewhere with --data naming a directory
    that does not hold them, they resolve against the run directory's parent, the launch
    directory, and the replay says so and lands on *after*."""
    cfg = json.loads((OLMO / "run" / "step10" / "config.json").read_text())
    assert cfg["dataset"]["paths"] == ["tokens/part-00000.npy"]
    launch = tmp_path / "launch"
    shutil.copytree(OLMO / "run", launch / "run")
    shutil.copytree(OLMO / "tokens", launch / "tokens")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    args = [
        "replay",
        "--run-dir",
        str(launch / "run"),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "rep"),
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["verdict"]["reproducible"] is True
    assert (
        f"token files: tokens/part-00000.npy resolved against the run directory's parent {launch}"
        in doc["replay"]["config"]["batches"]["value"]
    )
