"""bisect and whatif on the zoo, against the planted truth."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from tests.conftest import truth
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _word_tokenizer(d: Path) -> Path:
    """An HF tokenizer directory for the zoo's 64-id vocabulary: id i <-> word 'w{i}'."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(d))
    return d


def test_bisect_finds_the_poisoned_step_and_rows(zoo: dict[str, Path], tmp_path: Path) -> None:
    run = zoo["poison_batch"]
    t = truth(run)
    tok = _word_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "out"
    r = invoke(
        "bisect",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "35",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--out",
        str(out),
        "--tokenizer",
        str(tok),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    b = doc["bisect"]
    assert b["first_bad_step"] == t["first_bad_step"]
    got, want = set(b["rows"]), set(t["samples"])
    assert len(got & want) / len(got) >= 0.9 and len(got & want) / len(want) >= 0.9
    assert b["replays"] <= b["budget"]
    assert b["presence_spikes"] is True
    # The one-token row (planted: id 7 throughout) decodes as that word repeated.
    assert b["texts"]["1"].split() == ["w7"] * 32
    assert "Culprit rows, decoded" in (out / "report.md").read_text()
    skip = json.loads((out / "skip.json").read_text())
    assert skip["steps"] == [t["first_bad_step"]] and len(skip["sample_ids"]) == len(b["rows"])


def test_bisect_finds_no_bad_step_on_a_healthy_window(zoo: dict[str, Path]) -> None:
    run = zoo["healthy"]
    r = invoke(
        "bisect",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--json",
    )
    assert r.exit_code == 0
    b = json.loads(r.stdout)["bisect"]
    assert b["first_bad_step"] is None and b["rows"] == [] and b["replays"] == 0


def _whatif(run: Path, *tries: str, doc: bool = False) -> dict:
    args = [
        "whatif",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--steps",
        "10",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--json",
    ]
    for t in tries:
        args += ["--try", t]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) if doc else json.loads(r.stdout)["whatif"]


def test_whatif_skipping_the_poisoned_rows_holds(zoo: dict[str, Path]) -> None:
    doc = _whatif(zoo["poison_batch"], "clip=0.5", "skip_samples=auto", doc=True)
    w = doc["whatif"]
    out = {o["mitigation"]: o for o in w["outcomes"]}
    assert not out["baseline"]["on_track"]
    assert out["skip_samples=auto"]["on_track"]
    assert w["recommended"] == "skip_samples=auto"
    assert sorted(w["auto_rows"]["35"]) == truth(zoo["poison_batch"])["samples"]
    # the action names the samples to skip, not "auto" (issue #46 item 13)
    ids = ", ".join(str(i) for i in w["auto_sample_ids"]["35"])
    (action,) = doc["verdict"]["recommended_actions"]
    assert action.startswith("Resume from ")
    assert action.endswith(f" with skip_samples=auto (samples {ids} of step 35).")


def test_whatif_lowering_the_lr_holds_the_lr_jump(zoo: dict[str, Path]) -> None:
    doc = _whatif(zoo["lr_jump"], "clip=0.5", "lr_scale=0.01", doc=True)
    w = doc["whatif"]
    out = {o["mitigation"]: o for o in w["outcomes"]}
    assert not out["baseline"]["on_track"] and not out["clip=0.5"]["on_track"]
    assert w["recommended"] == "lr_scale=0.01"
    # whatif diagnoses nothing: its baseline spikes, so the cause is not "none"
    assert doc["verdict"]["causes"] == [
        {"cause": "undiagnosed", "confidence": 0.0, "evidence": ["F1"]}
    ]


def test_whatif_higher_precision_removes_the_fp16_overflow(zoo: dict[str, Path]) -> None:
    w = _whatif(zoo["fp16_overflow"], "precision=bf16", "precision=fp32")
    out = {o["mitigation"]: o for o in w["outcomes"]}
    assert out["baseline"]["skipped_updates"], "the fp16 baseline must still overflow"
    assert not out["baseline"]["on_track"]
    for m in ("precision=bf16", "precision=fp32"):
        assert out[m]["skipped_updates"] == [] and out[m]["on_track"], m
    assert w["recommended"] == "precision=bf16"


def test_whatif_rejects_unknown_knobs(zoo: dict[str, Path]) -> None:
    run = zoo["healthy"]
    r = invoke(
        "whatif",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--steps",
        "3",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--try",
        "warp=9",
    )
    assert_bad_input(r, "unknown knob 'warp'")


@pytest.mark.parametrize("name", ["gradient_explosion", "adam_instability", "lr_jump"])
def test_bisect_pins_bad_updates_that_do_not_spike(zoo: dict[str, Path], name: str) -> None:
    """A module LR bug and a collapsed second moment: the pair's state evidence names the
    step, and the batch alone does not spike, so no rows are blamed."""
    run = zoo[name]
    t = truth(run)
    r = invoke(
        "bisect",
        "--run-dir",
        str(run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--json",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    b = doc["bisect"]
    assert b["first_bad_step"] == t["first_bad_step"]
    assert b["rows"] == [] and "went bad" in b["note"] and "update" in b["note"]
    assert doc["verdict"]["causes"][0]["cause"] == t["cause"]
