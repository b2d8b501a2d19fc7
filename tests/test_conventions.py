"""The conventions a replay reads from the run, and the check of every replayed step against the
run's own log (issue: a replay that checks itself against the run's record).

The runs are the zoo's own loop fed as each stack feeds its model: nanoGPT's next-token
targets to a `forward(idx, targets) -> (logits, loss)` model that returns the last position's
logits without targets, recorded with the flight recorder as the README shows; torchtitan's
logits-only forward with the loop's own cross-entropy. Their batch logs carry no attribute
saying what the labels are: the replay measures it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from fixtures.zoo import Run, train
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("conventions")
    built = {}
    for name, convention, pad, fmt in (
        ("nanogpt", "targets", True, "nanogpt"),
        ("titan", "logits", False, "torch"),
    ):
        run = Run(
            name=name,
            out=root / name,
            steps=30,
            save_every=10,
            fmt=fmt,
            convention=convention,
            pad=pad,
            record=name == "nanogpt",
        )
        train(run)
        built[name] = run.out
    return built


def _replay(run: Path, *extra: str) -> dict:
    r = invoke("replay", "--run-dir", str(run), "--before", "20", "--after", "30", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_nanogpt_loop_recorded_as_the_readme_shows_replays_onto_after(
    runs: dict[str, Path],
) -> None:
    """`rec.on_batch(step, {"input_ids": X, "labels": Y})` from a loop whose model returns the
    last position's logits without targets: the replay measures the labels as next-token
    targets, calls the model with them, and lands on after; the recorder's segments say it."""
    run = runs["nanogpt"]
    doc = _replay(
        run, "--batch", str(run / "flight"), "--model", "fixtures/tinygpt.py:targets_factory"
    )
    v, cfg = doc["verdict"], doc["replay"]["config"]
    assert v["reproducible"] is True and v["causes"][0]["cause"] == "none"
    assert v["replay_check"]["status"] == "matched" and doc["replay"]["check"][
        "checked_steps"
    ] == list(range(21, 31))
    assert cfg["labels"]["value"].startswith("next-token targets") and cfg["labels"][
        "source"
    ].startswith("measured from the data")
    assert (
        "targets=next-token targets" in cfg["call"]["value"]
        and "[8, 1, 64]" in cfg["call"]["value"]
    )
    for seg in (run / "flight").glob("segment-*.h5"):
        with h5py.File(seg) as h:
            assert bool(h.attrs["labels_shifted"]) is True


def test_next_token_targets_without_an_attribute_replay_as_such(runs: dict[str, Path]) -> None:
    """torchtitan's convention (logits out, the loop's cross-entropy on next-token targets):
    a batch log that says nothing about its labels replays onto after."""
    run = runs["titan"]
    with h5py.File(run / "batches.h5") as h:
        assert "labels_shifted" not in h.attrs
    doc = _replay(run, "--batch", str(run / "batches.h5"), "--model", MODEL)
    assert (
        doc["verdict"]["reproducible"] is True
        and doc["verdict"]["replay_check"]["status"] == "matched"
    )
    assert doc["replay"]["config"]["labels"]["value"].startswith("next-token targets")


def test_an_attribute_the_data_contradicts_is_an_error(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    log = tmp_path / "batches.h5"
    shutil.copy(zoo["healthy"] / "batches.h5", log)
    with h5py.File(log, "a") as h:
        h.attrs["labels_shifted"] = True  # the HF convention's labels == input_ids, mislabelled
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        MODEL,
        "--batch",
        str(log),
    )
    assert_bad_input(
        r,
        "the batch log's labels_shifted attribute says labels are next-token targets, but the data says otherwise",
    )
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        MODEL,
        "--batch",
        str(zoo["healthy"] / "batches.h5"),
        "--labels",
        "shifted",
    )
    assert_bad_input(
        r,
        "--labels says labels are next-token targets, but the data says otherwise (labels == input_ids on 100.0%",
    )


@pytest.mark.parametrize("factory", ["relu_factory", "post_ln_factory"])
def test_a_wrong_model_is_refused_and_nothing_it_replayed_is_reported(
    zoo: dict[str, Path], tmp_path: Path, factory: str
) -> None:
    """The right parameter names and shapes with another activation or norm placement: loading
    succeeds, the first replayed step misses the logged loss, the replay is refused in one
    line; with --allow-mismatch the report comes from the checkpoint diff alone."""
    run = zoo["healthy"]
    args = [
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        f"tests/wrong_models.py:{factory}",
        "--batch",
        str(run / "batches.h5"),
    ]
    r = invoke(*args)
    assert_bad_input(
        r, "the replay does not reproduce the run's own log on its first checked step (loss"
    )
    out = tmp_path / "report"
    r = invoke(*args, "--allow-mismatch", "--out", str(out))
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    v = doc["verdict"]
    assert v["replay_check"]["status"] == "missed_first"
    assert (
        v["reproducible"],
        v["first_bad_step"],
        v["first_anomalous_module"],
        v["anomalous_samples"],
        v["overflowing_tensors"],
    ) == (None, None, None, [], [])
    kinds = {f["kind"] for f in doc["findings"]}
    assert "replay_withheld" in kinds and not kinds & {
        "replay_spike",
        "replay_reproduces",
        "replay_config_mismatch",
        "first_forward_anomaly",
        "rms_t",
    }
    assert set(doc["replay"]) == {"config", "precision", "check", "variants", "withheld"}
    md = (out / "report.md").read_text()
    assert (
        "withheld: the replay does not reproduce the run's own log" in md
        and "The replay is withheld and nothing in this report comes from it" in md
    )
