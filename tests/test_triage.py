"""triage on the zoo's training logs, and its log readers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.triage import read_metrics, triage
from tests.conftest import truth

# Every incident of the zoo, from its log alone: the per-group LR (gradient_explosion's
# module LR bug) and per-parameter grad norms (adam_instability's gated layer) are
# logged under OLMo's names, as trainers that log them do.
LOG_VISIBLE = ["poison_batch", "lr_jump", "fp16_overflow", "gradient_explosion", "adam_instability"]


@pytest.mark.parametrize("name", LOG_VISIBLE)
def test_triage_finds_the_planted_step_and_a_rollback_before_it(
    zoo: dict[str, Path], name: str
) -> None:
    run = zoo[name]
    res = triage(run / "metrics.jsonl", run)
    assert res.first_bad_step == truth(run)["first_bad_step"]
    assert res.rollback_step is not None and res.rollback_step < res.first_bad_step
    assert any("replay" in c and f"--before {res.rollback_step}" in c for c in res.commands)


@pytest.mark.parametrize(
    "name", ["healthy", "healthy-torch", "healthy-safetensors", "silent_corruption"]
)
def test_triage_finds_nothing_in_clean_logs(zoo: dict[str, Path], name: str) -> None:
    assert triage(zoo[name] / "metrics.jsonl", zoo[name]).first_bad_step is None


def test_readers_agree_on_jsonl_csv_and_trainer_state(zoo: dict[str, Path], tmp_path: Path) -> None:
    rows = read_metrics(zoo["poison_batch"] / "metrics.jsonl")
    with (tmp_path / "metrics.csv").open("w") as f:
        f.write("step,train/loss,grad_norm\n")
        for s, r in rows.items():
            f.write(f"{s},{r['loss']},{r['grad_norm']}\n")
    csv_rows = read_metrics(tmp_path / "metrics.csv", {"loss": "train/loss"})
    assert csv_rows[35]["loss"] == pytest.approx(rows[35]["loss"])
    hf = read_metrics(zoo["hf-trainer"] / "checkpoint-40" / "trainer_state.json")
    assert len(hf) == 40 and "grad_norm" in hf[10] and "lr" in hf[10]
    res = triage(tmp_path / "metrics.csv", None, keys={"loss": "train/loss"})
    assert res.first_bad_step == 35


def test_triage_cli_discovers_the_log(zoo: dict[str, Path]) -> None:
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(zoo["lr_jump"]), "--json"])
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert (
        doc["first_bad_step"] == 35
        and doc["rollback_step"] == 30
        and doc["metrics_file"].endswith("metrics.jsonl")
    )


def test_triage_names_the_signal(zoo: dict[str, Path]) -> None:
    """The onset says why: the group whose LR jumped, the layer whose gradient came back."""
    ge = triage(zoo["gradient_explosion"] / "metrics.jsonl", None).onsets[0]
    assert ge.signal == "lr" and "optim/LR (group" in ge.message
    ai = triage(zoo["adam_instability"] / "metrics.jsonl", None).onsets[0]
    assert ai.signal == "param_grad" and ai.message.startswith(
        truth(zoo["adam_instability"])["layers"][0] + ":"
    )


def test_group_lr_columns() -> None:
    from ckptforensics.engine.triage import group_lrs

    assert group_lrs({"optim/LR (group 0)": 1.0, "optim/LR (group 1)": 2.0}, 2) == [1.0, 2.0]
    assert group_lrs({"lr-AdamW/pg1": 1.0, "lr-AdamW/pg2": 2.0}, 2) == [1.0, 2.0]
    assert group_lrs({"optim/LR (group 0)": 1.0}, 2) is None


def test_triage_out_writes_a_page_with_its_timeline(zoo: dict[str, Path], tmp_path: Path) -> None:
    from tests.conftest import tree_hash

    run = zoo["poison_batch"]
    before = tree_hash(run)
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(run), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["first_bad_step"] == 35 and doc["timeline"]["checkpoints"][:2] == [5, 10]
    page = (tmp_path / "report.html").read_text()
    assert (
        "data:image/png;base64," in page and "http" not in page.split("<body>")[0]
    )  # plot inline, nothing fetched
    assert (
        (tmp_path / "report.md")
        .read_text()
        .startswith("# ckptforensics: triage\n\n**First bad step: 35, the grad norm at ")
    )
    assert tree_hash(run) == before
