"""The padding row the run froze, read from the checkpoint, not from config.json.

transformers' Trainer rewrites `config.pad_token_id` to the tokenizer's pad id after the model
was built (`align_special_tokens`): a Llama built with pad id 0 and trained with a tokenizer
whose pad is 63 froze row 0 and saves a config that names 63. The replay must zero the row the
run zeroed; the run's own log refuses it otherwise (grad norm 0.83 against 0.61 logged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import fixtures.draws_hf as draws_hf
from ckptforensics.cli import cli
from fixtures.draws import build_draw, draw

SEED = 1012  # an HF Llama draw whose rows DataCollatorForLanguageModeling pads


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert draw(SEED).collator == "lm" and draw(SEED).family == "llama"
    built = draws_hf._model

    def with_pad_id_zero(d):  # the model as a config with a pad id of its own builds it
        model = built(d)
        model.model.embed_tokens.padding_idx = 0
        with __import__("torch").no_grad():
            model.model.embed_tokens.weight[0].zero_()
        return model

    mp = pytest.MonkeyPatch()
    mp.setattr(draws_hf, "_model", with_pad_id_zero)
    try:
        return build_draw(SEED, tmp_path_factory.mktemp("pad"))
    finally:
        mp.undo()


def test_the_replay_freezes_the_row_the_run_froze(run: Path) -> None:
    t = json.loads((run / "truth.json").read_text())
    cfg = json.loads(next(run.glob("checkpoint-*/config.json")).read_text())
    assert cfg["pad_token_id"] == 63  # what the Trainer saved; the run froze row 0
    r = CliRunner().invoke(
        cli,
        [
            "replay",
            "--run-dir",
            str(run),
            "--before",
            str(t["before"]),
            "--after",
            str(t["after"]),
            "--batch",
            str(run / "batches.h5"),
            "--json",
        ],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"]["replay_check"]["status"] in ("matched", "diverged_after_onset")
    assert "model.embed_tokens 63 -> 0" in doc["replay"]["config"]["model"]["value"]
    assert doc["verdict"]["causes"][0]["cause"] == t["cause"]


TIED = 1346  # a healthy tied HF Llama whose config (pad id 0) built the embedding; 0 is fed


def test_a_tied_padding_row_is_read_from_the_log_not_the_moments(
    tmp_path_factory: pytest.TempPathFactory, draw_report: Any
) -> None:
    """The head trains a tied embedding's padding row, so its second moment is not 0 there
    although the run zeroed the row's lookup: the replay asks the first step's grad norm and
    lands on *after* (unpadded, it missed 14,751 of 24,144 elements)."""
    d = draw(TIED)
    assert d.tied and d.family == "llama" and d.collator == "default" and d.cause == "none"
    doc = draw_report(build_draw(TIED, tmp_path_factory.mktemp("tied")))
    assert (
        "padding row of the tied model.embed_tokens 0: zeroed by the run"
        in (doc["replay"]["config"]["model"]["value"])
    )
    assert doc["replay"]["reproduction"]["mismatched"] == 0
    assert doc["verdict"]["reproducible"] is True
    assert doc["verdict"]["causes"][0]["cause"] == "none"
