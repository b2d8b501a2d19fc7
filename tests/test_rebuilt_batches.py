"""Replay without a batch log: an HF Trainer run's batches rebuilt from its own data (`--data`)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from tests.test_cli import assert_bad_input

pytest.importorskip("datasets")


@pytest.fixture(scope="session")
def hf_data_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.hf_data_run import build

    return build(tmp_path_factory.mktemp("hf-data"))


def _replay(run: Path, data: Path, *extra: str) -> object:
    t = json.loads((run / "truth.json").read_text())
    args = [
        "replay",
        "--run-dir",
        str(run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
        "--data",
        str(data),
        *extra,
    ]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_poison_rows_are_found_by_their_dataset_index_without_a_batch_log(
    hf_data_run: Path, tmp_path: Path
) -> None:
    """No --batch, no --model: the Trainer's sampler (seeded from training_args.bin, epoch 3
    of a reshuffling sampler, gradient accumulation 2, padded rows) gives back the batch that
    step consumed, and the culprits are named by their index in the dataset."""
    t = json.loads((hf_data_run / "truth.json").read_text())
    r = _replay(hf_data_run, hf_data_run.parent / t["data"], "--out", str(tmp_path / "rep"))
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "poison_batch" and v["first_bad_step"] == t["first_bad_step"]
    assert sorted(x["index"] for x in v["anomalous_samples"]) == t["samples"]
    assert sorted(x["sample_id"] for x in v["anomalous_samples"]) == t["sample_ids"]
    assert any(str(t["sample_ids"][0]) in a for a in v["recommended_actions"])
    assert doc["replay"]["config"]["batches"]["source"].startswith("--data, rebuilt")
    assert v["reproducible"] is True


def test_a_dataset_in_another_order_is_refused_in_one_line(
    hf_data_run: Path, tmp_path: Path
) -> None:
    """The same rows in another order are a different pipeline: the first step's loss is
    off the log, and nothing is diagnosed from such batches."""
    import datasets

    t = json.loads((hf_data_run / "truth.json").read_text())
    ds = datasets.load_from_disk(str(hf_data_run.parent / t["data"]))
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    ds.select(order).flatten_indices().save_to_disk(str(tmp_path / "shuffled"))
    r = _replay(hf_data_run, tmp_path / "shuffled", "--out", str(tmp_path / "rep"))
    assert_bad_input(r, "the data pipeline differs")
    assert not (tmp_path / "rep").exists()


def test_replay_needs_a_batch_log_or_the_data(hf_data_run: Path, zoo: dict[str, Path]) -> None:
    t = json.loads((hf_data_run / "truth.json").read_text())
    r = CliRunner().invoke(
        cli,
        [
            "replay",
            "--run-dir",
            str(hf_data_run),
            "--before",
            str(t["before"]),
            "--after",
            str(t["after"]),
        ],
    )
    assert_bad_input(r, "pass --batch")
    run = zoo["poison_batch"]  # a nanoGPT-style run: its pipeline is not the Trainer's
    r = CliRunner().invoke(
        cli,
        [
            "replay",
            "--run-dir",
            str(run),
            "--before",
            "30",
            "--after",
            "35",
            "--model",
            "fixtures/tinygpt.py:factory",
            "--data",
            str(run),
        ],
    )
    assert_bad_input(r, "--data rebuilds HF Trainer runs")


def test_triage_suggests_the_commands_this_run_needs(hf_data_run: Path) -> None:
    """An HF Trainer run without a batch log: the next commands rebuild its batches and take
    the model from config.json."""
    from ckptforensics.engine.triage import find_metrics, triage

    t = json.loads((hf_data_run / "truth.json").read_text())
    log = find_metrics(hf_data_run)
    assert log is not None
    res = triage(log, hf_data_run)
    assert res.first_bad_step == t["first_bad_step"] and res.rollback_step == t["before"]
    replay_cmd = next(c for c in res.commands if c.startswith("ckptforensics replay"))
    assert "--data" in replay_cmd and "--model" not in replay_cmd and "--batch" not in replay_cmd


def test_bisect_on_rebuilt_batches_writes_a_skip_list_of_dataset_indices(
    hf_data_run: Path, tmp_path: Path
) -> None:
    """The skip list a trainer can act on: the step, and the dataset indices to drop."""
    t = json.loads((hf_data_run / "truth.json").read_text())
    args = [
        "bisect",
        "--run-dir",
        str(hf_data_run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
    ]
    r = CliRunner().invoke(
        cli,
        [*args, "--data", str(hf_data_run.parent / t["data"]), "--out", str(tmp_path / "bis")],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    skip = json.loads((tmp_path / "bis" / "skip.json").read_text())
    assert skip["steps"] == [t["first_bad_step"]]
    assert sorted(skip["sample_ids"]) == t["sample_ids"]


def test_the_recorder_callback_keeps_what_the_trainer_fed(
    hf_data_run: Path, tmp_path: Path
) -> None:
    """The run's flight recorder (record.hf.hf_callback) replays the incident with no --data:
    the same verdict and rows as the batches rebuilt from the dataset."""
    t = json.loads((hf_data_run / "truth.json").read_text())
    args = [
        "replay",
        "--run-dir",
        str(hf_data_run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
        "--batch",
        str(hf_data_run / "flight"),
    ]
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "rec")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rec" / "report.json").read_text())
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == t["cause"] and v["first_bad_step"] == t["first_bad_step"]
    assert sorted(s["index"] for s in v["anomalous_samples"]) == t["samples"]
    assert v["reproducible"] is True
    assert doc["replay"]["config"]["clip"]["value"] == 1.0
    rows = [
        json.loads(x) for x in (hf_data_run / "flight" / "metrics.jsonl").read_text().splitlines()
    ]
    log = {
        int(e["step"]): e["loss"]
        for e in json.loads(
            (hf_data_run / f"checkpoint-{t['after']}" / "trainer_state.json").read_text()
        )["log_history"]
        if "loss" in e
    }
    for row in (
        rows
    ):  # the step's loss as the Trainer logged it (num_items_in_batch: the micro-batches' sum)
        assert row["loss"] == pytest.approx(log[row["step"]], rel=1e-4)
    from ckptforensics.engine.triage import triage

    assert (
        triage(hf_data_run / "flight" / "metrics.jsonl", hf_data_run).first_bad_step
        == t["first_bad_step"]
    )


@pytest.fixture(scope="session")
def hf_ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' Trainer on 2 processes (torchrun, DDP over gloo), 25 steps."""
    from fixtures.hf_ddp_run import build

    return build(tmp_path_factory.mktemp("hf-ddp"))


def test_a_two_process_runs_batches_are_what_each_process_consumed(hf_ddp_run: Path) -> None:
    """accelerate hands process r the sampler's micro-batches r, r + 2, ...: the rebuilt batch
    of every step (two epochs: the sampler reshuffles) is process 0's micro-batches, then
    process 1's, row for row what each process's collator was handed."""
    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.trainers.hf.data import trainer_batches

    seen = json.loads((hf_ddp_run / "consumed.json").read_text())
    w, accum = seen["world"], seen["accum"]
    with open_checkpoint(hf_ddp_run / "checkpoint-25") as ck:
        assert len(list(ck.path.glob("rng_state_*.pth"))) == w
        [src] = trainer_batches(
            str(hf_ddp_run.parent / "data"),
            ck.scalars.get("training_args"),
            ck.config,
            w,
            ckpt_dir=ck.path,
        )
    steps = len(seen["ranks"][0]) // accum
    assert steps == 25
    for s in range(1, steps + 1):
        src.batch(s)
        want = [
            i
            for r in range(w)
            for micro in seen["ranks"][r][(s - 1) * accum : s * accum]
            for i in micro
        ]
        assert src.sample_ids[s] == want, f"step {s}"


def test_a_two_process_run_replays_from_its_data_onto_after_with_no_alarm(
    hf_ddp_run: Path, tmp_path: Path
) -> None:
    """No --batch, no --model: the rebuilt global batches (loss over every process's tokens,
    as the Trainer's average_tokens_across_devices) land on *after* to the element, and the
    healthy run raises no alarm (15 -> 20 judges its steps against 15 steps of history)."""
    out = tmp_path / "rep"
    args = [
        "replay",
        "--run-dir",
        str(hf_ddp_run),
        "--before",
        "15",
        "--after",
        "20",
        "--data",
        str(hf_ddp_run.parent / "data"),
        "--out",
        str(out),
    ]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    assert (
        doc["verdict"]["reproducible"] is True and doc["replay"]["reproduction"]["mismatched"] == 0
    )
    assert [c["cause"] for c in doc["verdict"]["causes"]] == ["none"]
    assert [f["kind"] for f in doc["findings"] if f["severity"] != "info"] == []
    assert "2 processes" in doc["replay"]["config"]["batches"]["value"]


# ---------------------------------------------------------------- the run's collator
@pytest.fixture(scope="session")
def hf_lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The causal-LM recipe: tokenized rows of varying length, unpadded, padded per
    micro-batch by DataCollatorForLanguageModeling(mlm=False) (labels -100 on the padding);
    the tokenizer saved in every checkpoint by the Trainer (its processing_class)."""
    from fixtures.hf_data_run import build

    return build(tmp_path_factory.mktemp("hf-lm"), collator="lm")


def _shuffled(data: Path, out: Path) -> Path:
    import datasets

    ds = datasets.load_from_disk(str(data))
    order = list(range(len(ds)))
    random.Random(1).shuffle(order)
    ds.select(order).flatten_indices().save_to_disk(str(out))
    return out


def test_rows_padded_by_the_runs_collator_are_found_by_their_dataset_index(
    hf_lm_run: Path, tmp_path: Path
) -> None:
    """default_data_collator cannot stack rows of varying length: passed over, not an error;
    DataCollatorForLanguageModeling(mlm=False) with the checkpoint's tokenizer lands on the
    log at the first step, and the replay finds the planted step and rows, and lands on *after*."""
    t = json.loads((hf_lm_run / "truth.json").read_text())
    r = _replay(hf_lm_run, hf_lm_run.parent / t["data"], "--out", str(tmp_path / "rep"))
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "poison_batch" and v["first_bad_step"] == t["first_bad_step"]
    assert sorted(x["index"] for x in v["anomalous_samples"]) == t["samples"]
    assert sorted(x["sample_id"] for x in v["anomalous_samples"]) == t["sample_ids"]
    assert v["reproducible"] is True and doc["replay"]["reproduction"]["mismatched"] == 0
    said = doc["replay"]["config"]["batches"]["value"]
    assert (
        "collator DataCollatorForLanguageModeling(mlm=False; pad id 63, right padding; the tokenizer saved in checkpoint-35)"
        in said
    )
    assert f"its step {t['before'] + 1} lands on the log" in said
    assert (
        "passed over: default_data_collator cannot collate (ValueError: expected sequence of length"
        in said
    )


def test_bisect_names_the_rows_the_collator_padded(hf_lm_run: Path, tmp_path: Path) -> None:
    t = json.loads((hf_lm_run / "truth.json").read_text())
    args = [
        "bisect",
        "--run-dir",
        str(hf_lm_run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
    ]
    r = CliRunner().invoke(
        cli,
        [*args, "--data", str(hf_lm_run.parent / t["data"]), "--out", str(tmp_path / "bis")],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    skip = json.loads((tmp_path / "bis" / "skip.json").read_text())
    assert skip["steps"] == [t["first_bad_step"]]
    assert sorted(skip["sample_ids"]) == t["sample_ids"]


def test_a_shuffled_copy_under_every_collator_is_refused_in_one_line(
    hf_lm_run: Path, tmp_path: Path
) -> None:
    """No candidate collator lands: one line with each one's figure against the log, exit 2,
    no report (it used to crash inside default_data_collator with exit 1)."""
    t = json.loads((hf_lm_run / "truth.json").read_text())
    r = _replay(
        hf_lm_run,
        _shuffled(hf_lm_run.parent / t["data"], tmp_path / "shuffled"),
        "--out",
        str(tmp_path / "rep"),
    )
    assert_bad_input(r, "the data pipeline differs")
    line = r.stderr.strip()
    assert (
        f"no collator rebuilds step {t['before'] + 1} as logged" in line
        and "pass --collator module:obj" in line
    )
    assert (
        "default_data_collator cannot collate" in line
        and "DataCollatorForLanguageModeling(mlm=False): loss" in line
        and "DataCollatorWithPadding: loss" in line
    )
    assert not (tmp_path / "rep").exists()


def test_the_collator_given_is_the_only_one_tried(hf_lm_run: Path) -> None:
    """--collator module:factory (its one argument the run's tokenizer) replays the step; a
    collator that cannot collate the rows is one line, exit 2."""
    t = json.loads((hf_lm_run / "truth.json").read_text())
    base = [
        "replay",
        "--run-dir",
        str(hf_lm_run),
        "--before",
        str(t["before"]),
        "--step",
        str(t["before"] + 1),
        "--data",
        str(hf_lm_run.parent / t["data"]),
    ]
    r = CliRunner().invoke(
        cli,
        [*base, "--collator", "fixtures/hf_data_run.py:lm_collator", "--json"],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    said = json.loads(r.stdout)["replay"]["config"]["batches"]["value"]
    assert (
        "collator fixtures/hf_data_run.py:lm_collator(tokenizer) (--collator; pad id 63" in said
        and "passed over" not in said
    )
    r = CliRunner().invoke(cli, [*base, "--collator", "transformers:default_data_collator"])
    assert_bad_input(
        r, "transformers:default_data_collator (--collator) cannot collate the rows of step"
    )


def test_candidates_come_in_order_and_fail_as_batch_errors(hf_lm_run: Path, tmp_path: Path) -> None:
    """The seam `window.choose_batches` reads: one BatchSource per standard collator, in
    order; default_data_collator's fails on these rows with a BatchError (not a ValueError);
    the LM collator's labels are -100 exactly on the padding it added. A copy of the run whose
    checkpoints hold no tokenizer finds it in the run's output_dir, recorded relative to the
    launch directory ("run")."""
    import shutil

    import torch

    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.formats.batches import BatchError
    from ckptforensics.trainers.hf.data import trainer_batches

    t = json.loads((hf_lm_run / "truth.json").read_text())
    data = str(hf_lm_run.parent / t["data"])
    with open_checkpoint(hf_lm_run / f"checkpoint-{t['before']}") as ck:
        record = ck.scalars.get("training_args")
        assert record["output_dir"] == "run"
        cands = trainer_batches(data, record, ck.config, ckpt_dir=ck.path)
    assert [c.collator.split("(")[0] for c in cands] == [
        "default_data_collator",
        "DataCollatorForLanguageModeling",
        "DataCollatorWithPadding",
    ]
    with pytest.raises(
        BatchError, match="default_data_collator cannot collate the rows of step 37"
    ):
        cands[0].batch(t["first_bad_step"])
    b = cands[1].batch(t["first_bad_step"])
    pad = b["attention_mask"] == 0
    assert pad.any() and torch.equal(b["labels"] == -100, pad)
    # the collator pads with the tokenizer's <pad>; the step's narrower micro-batch is padded
    # out to its wider one (mask 0, label -100) when they are joined
    assert 63 in b["input_ids"][pad].tolist() and set(b["input_ids"][pad].tolist()) <= {63, 0}
    assert cands[1].sample_ids[t["first_bad_step"]] == cands[2].sample_ids[t["first_bad_step"]]

    moved = tmp_path / "elsewhere" / "run"  # the run copied away from where it was launched
    shutil.copytree(hf_lm_run, moved)
    data = str(shutil.copytree(hf_lm_run.parent / t["data"], moved.parent / "data"))
    for ckpt in moved.glob("checkpoint-*"):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (ckpt / f).unlink()
    with open_checkpoint(moved / f"checkpoint-{t['before']}") as ck:
        cands = trainer_batches(data, ck.scalars.get("training_args"), ck.config, ckpt_dir=ck.path)
    assert (
        f"the tokenizer saved in the run's output_dir (run resolved against the run directory's parent {moved.parent})"
        in cands[1].describe
    )
    (moved / "tokenizer.json").unlink()
    with open_checkpoint(moved / f"checkpoint-{t['before']}") as ck:
        cands = trainer_batches(data, ck.scalars.get("training_args"), ck.config, ckpt_dir=ck.path)
    assert (
        len(cands) == 1
        and "the tokenizer-based collators were not tried: no tokenizer.json" in cands[0].describe
    )
