"""Megatron's training data read without megatron-core, against megatron-core's own GPTDataset.

The indexed dataset, its GPTDataset index caches and what `GPTDataset[i]` returned for each
sample were written once by megatron-core 0.19 (`fixtures/megatron_data_run.py`), committed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptforensics.formats.batches import BatchError
from ckptforensics.trainers.megatron.data import (
    IndexedTokens,
    is_megatron_data,
    megatron_batches,
    open_samples,
)
from tests.conftest import ROOT

DATA = ROOT / "fixtures" / "data" / "megatron-core-0.19" / "gptdataset"


def test_every_sample_equals_megatron_cores_gptdataset() -> None:
    want = np.load(DATA / "expected.npz")
    got = open_samples(DATA, seq_length=int(want["seq"]), seed=int(want["seed"]))
    assert len(got) == want["tokens"].shape[0]
    for i in range(len(got)):
        text = got.text(i)
        assert np.array_equal(text[:-1], want["tokens"][i]) and np.array_equal(
            text[1:], want["labels"][i]
        ), i


def test_the_batch_of_an_iteration_is_its_global_samples() -> None:
    want = np.load(DATA / "expected.npz")
    args = {
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "seq_length": int(want["seq"]),
        "seed": int(want["seed"]),
    }
    assert is_megatron_data(DATA)
    src = megatron_batches(str(DATA), args)
    assert src.labels_shifted and src.micro_batch_size == 2 and src.rebuilt
    b = src.batch(3)  # iteration 2: global samples 16..23
    assert torch.equal(b["input_ids"], torch.from_numpy(want["tokens"][16:24]).long())
    assert torch.equal(b["labels"], torch.from_numpy(want["labels"][16:24]).long())
    assert src.sample_ids[3] == list(range(16, 24))


def test_bad_data_is_one_clear_error(tmp_path: Path) -> None:
    want = np.load(DATA / "expected.npz")
    with pytest.raises(BatchError, match="GPTDataset train caches for sequence length 32"):
        open_samples(
            DATA, seq_length=32, seed=int(want["seed"])
        )  # the run's args disagree with the caches
    bad = tmp_path / "d"
    shutil.copytree(DATA, bad)
    (bad / "text.bin").write_bytes((bad / "text.bin").read_bytes()[:100])
    with pytest.raises(BatchError, match="truncated"):
        IndexedTokens.open(bad / "text")
    (bad / "text.idx").write_bytes(b"NOTANIDX" + (bad / "text.idx").read_bytes()[8:])
    with pytest.raises(BatchError, match="not a Megatron index"):
        IndexedTokens.open(bad / "text")


MCORE = ROOT / "fixtures" / "data" / "megatron-core-0.19"


def _metrics(tmp: Path) -> Path:
    """The run's per-iteration log (loss, grad norm, LR), as Megatron-LM prints it each iteration."""
    import json

    steps = json.loads((MCORE / "truth.json").read_text())["variants"]["plain"]["steps"]
    path = tmp / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "step": s["step"],
                    "loss": s["loss"],
                    "grad_norm": s["grad_norm"],
                    "lr": s["lr"][0],
                }
            )
            + "\n"
            for s in steps
        )
    )
    return path


@pytest.mark.parametrize("variant", ["plain", "legacy"])
def test_replay_a_megatron_run_from_its_own_data_with_no_batch_and_no_model(
    variant: str, tmp_path: Path
) -> None:
    import json

    from click.testing import CliRunner

    from ckptforensics.cli import cli

    args = [
        "replay",
        "--run-dir",
        str(MCORE / variant),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(DATA),
        "--metrics",
        str(_metrics(tmp_path)),
        "--out",
        str(tmp_path / "rep"),
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"
    cfg = doc["replay"]["config"]
    assert (
        "Megatron GPTDataset" in cfg["batches"]["value"] and "rebuilt" in cfg["batches"]["source"]
    )
    assert "reference Megatron GPT" in cfg["model"]["value"]


def test_a_dataset_that_is_not_the_runs_is_refused_in_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptforensics.cli import cli
    from tests.test_cli import assert_bad_input

    other = tmp_path / "other"
    shutil.copytree(DATA, other)
    tokens = np.fromfile(other / "text.bin", dtype=np.uint16)
    np.random.default_rng(1).shuffle(tokens)  # the same documents' tokens in another order
    tokens.tofile(other / "text.bin")
    args = [
        "replay",
        "--run-dir",
        str(MCORE / "plain"),
        "--before",
        "10",
        "--after",
        "20",
        "--data",
        str(other),
        "--metrics",
        str(_metrics(tmp_path)),
    ]
    assert_bad_input(CliRunner().invoke(cli, args), "the data pipeline differs")


@pytest.mark.parametrize("data", ["prefix", "launch dir"])
def test_paths_recorded_relative_to_the_launch_directory_are_found(
    data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """megatron-core wrote this run launched from the repository root: its args hold
    `--data-path fixtures/.../gptdataset/text` and `--data-cache-path fixtures/.../gptdataset/cache`,
    relative to there. The run copied under another launch directory, the dataset moved
    elsewhere and the caches left where the run's relative path puts them, replayed from
    yet another working directory: the caches (and, with --data the launch directory, the
    dataset) are found against the run directory's parents, said in replay.config, and the
    replay lands on *after*."""
    import json

    from click.testing import CliRunner

    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.cli import cli

    with open_checkpoint(MCORE / "plain" / "iter_0000010") as ck:
        args = ck.config
    rel_cache, rel_data = args["data_cache_path"], args["data_path"][0]
    assert not Path(rel_cache).is_absolute() and not Path(rel_data).is_absolute()
    launch = tmp_path / "launch"
    run = launch / Path(args["save"])
    shutil.copytree(MCORE / "plain", run)
    shutil.copytree(DATA / "cache", launch / rel_cache)
    store = tmp_path / "store"
    for ext in (".bin", ".idx"):
        store.mkdir(exist_ok=True)
        shutil.copy(DATA / f"text{ext}", store / f"text{ext}")
        if data == "launch dir":
            (launch / rel_data).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(DATA / f"text{ext}", launch / f"{rel_data}{ext}")
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)  # where the tool runs says nothing about where the run was launched
    given = str(store / "text") if data == "prefix" else str(launch)
    metrics = _metrics(tmp_path)
    r = CliRunner().invoke(
        cli,
        [
            "replay",
            "--run-dir",
            str(run),
            "--before",
            "10",
            "--after",
            "20",
            "--data",
            given,
            "--metrics",
            str(metrics),
            "--out",
            str(tmp_path / "rep"),
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert (
        doc["verdict"]["reproducible"] is True and doc["replay"]["reproduction"]["mismatched"] == 0
    )
    said = doc["replay"]["config"]["batches"]["value"]
    assert (
        f"caches: --data-cache-path {rel_cache} resolved against the run directory's parent {launch}"
        in said
    )
    if data == "launch dir":
        assert (
            f"dataset: --data-path {rel_data} resolved against the run directory's parent {launch}"
            in said
        )

    # Before: the relative cache path was only tried against the working directory.
    shutil.rmtree(launch / rel_cache)
    with (
        open_checkpoint(run / "iter_0000010") as ck,
        pytest.raises(BatchError, match="0 GPTDataset train caches"),
    ):
        megatron_batches(given, ck.config, run)


POISON = ROOT / "fixtures" / "data" / "megatron-core-0.19-poison"


def test_rows_poisoned_in_megatrons_indexed_dataset_are_the_culprits(tmp_path: Path) -> None:
    """megatron-core fed two poisoned rows of iteration 46 from its indexed dataset, crashed
    after 48 and was relaunched from 40 (fixtures/megatron_poison_run.py). The replay rebuilds
    the batches from the dataset, follows the printed log across the restart, and names the
    rows and the step: poison_batch, reproducible, no hardware."""
    import json

    from click.testing import CliRunner

    from ckptforensics.cli import cli

    t = json.loads((POISON / "truth.json").read_text())
    run = tmp_path / "run"
    shutil.copytree(POISON, run)
    args = ["replay", "--run-dir", str(run), "--before", str(t["before"]), "--after"]
    args += [str(t["after"]), "--data", str(run / "data" / "text"), "--out", str(tmp_path / "rep")]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    v = doc["verdict"]
    causes = [c["cause"] for c in v["causes"]]
    assert causes[0] == t["cause"] == "poison_batch" and "silent_corruption" not in causes
    assert v["first_bad_step"] == t["first_bad_step"] and v["reproducible"] is True
    assert sorted(s["index"] for s in v["anomalous_samples"]) == t["samples"]  # the culprits
    assert v["replay_check"]["status"] == "matched"
    assert Path(doc["replay"]["config"]["metrics"]["value"]).name == "train.log"
