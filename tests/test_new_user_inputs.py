"""A new user's plain mistakes on a real run (issue #46, items 1, 2, 3, 7): a reversed or empty
window refused in one line by every command that takes one; whatif's skip_step judged on the
steps it replays, not on the batch it skips, and the plan saying the same; a replay whose log
cannot be read goes on without it and says so; the W&B folder taken as the log. The zoo's
poisoned-batch run (spike at step 35, checkpoints every 5 steps), trained once here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import ckptforensics as cf
from ckptforensics.cli import cli
from ckptforensics.core.errors import ForensicsError
from tests.conftest import ROOT, build, tree_hash

MODEL = f"{ROOT / 'fixtures' / 'tinygpt.py'}:factory"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("zoo"), only=["poison_batch"])["poison_batch"]


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _one_line(r: Result, line: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [line]


def _replaying(run: Path) -> list[str]:
    return ["--batch", str(run / "batches.h5"), "--model", MODEL]


# ---------------------------------------------------------------- item 1: the window
@pytest.mark.parametrize("command", ["diff", "replay", "bisect", "plan"])
def test_a_reversed_window_is_refused_in_one_line(run: Path, command: str) -> None:
    before = tree_hash(run)
    extra = [] if command == "diff" else _replaying(run)
    r = _invoke(command, "--run-dir", str(run), "--before", "35", "--after", "30", *extra)
    _one_line(
        r,
        f"error: --after {run / 'step_30.pt'} (step 30) comes before --before "
        f"{run / 'step_35.pt'} (step 35): the window is reversed; pass the earlier checkpoint "
        "as --before",
    )
    assert tree_hash(run) == before


@pytest.mark.parametrize("command", ["diff", "replay", "bisect", "plan"])
def test_an_empty_window_is_refused_in_one_line(run: Path, command: str) -> None:
    extra = [] if command == "diff" else _replaying(run)
    r = _invoke(command, "--run-dir", str(run), "--before", "30", "--after", "30", *extra)
    _one_line(
        r,
        f"error: --before and --after are the same checkpoint ({run / 'step_30.pt'}): the "
        "window is empty; pass an --after later than --before",
    )


def test_a_window_of_two_copies_of_one_step_is_empty(run: Path, tmp_path: Path) -> None:
    """No step in the names: the steps the checkpoints record decide."""
    shutil.copy(run / "step_30.pt", tmp_path / "a.pt")
    shutil.copy(run / "step_30.pt", tmp_path / "b.pt")
    shutil.copy(run / "step_35.pt", tmp_path / "c.pt")
    r = _invoke("diff", "--before", str(tmp_path / "a.pt"), "--after", str(tmp_path / "b.pt"))
    _one_line(
        r,
        f"error: --before {tmp_path / 'a.pt'} and --after {tmp_path / 'b.pt'} are both step 30: "
        "the window is empty; pass an --after later than --before",
    )
    r = _invoke("diff", "--before", str(tmp_path / "c.pt"), "--after", str(tmp_path / "a.pt"))
    _one_line(
        r,
        f"error: --after {tmp_path / 'a.pt'} (step 30) comes before --before {tmp_path / 'c.pt'} "
        "(step 35): the window is reversed; pass the earlier checkpoint as --before",
    )


def test_whatif_and_recovery_refuse_an_empty_window(run: Path) -> None:
    with pytest.raises(ForensicsError, match=r"^--steps 0: the window is empty; pass --steps 1"):
        cf.whatif(run / "step_30.pt", steps=0, tries=["clip=1.0"])
    r = _invoke("recovery", "--run-dir", str(run), "--resumed-from", "35", "--checkpoint", "30")
    _one_line(
        r,
        f"error: --checkpoint {run / 'step_30.pt'} (step 30) is not after --resumed-from 35: "
        "pass a checkpoint the resumed run wrote, or none (the first complete one after the "
        "resume)",
    )


# ---------------------------------------------------------------- item 2: skip_step
def test_skip_step_is_judged_on_the_steps_it_replays_and_the_plan_says_so(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "plan"
    r = _invoke(
        "plan", "--run-dir", str(run), "--before", "30", "--after", "35", *_replaying(run),
        "--try", "skip_step=35", "--out", str(out),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    got = {o["mitigation"]: o for o in doc["whatif"]["outcomes"]}
    base, skip = got["baseline"], got["skip_step=35"]
    # The skip is the window's last step: the what-if replays two steps past it.
    assert base["steps"] == [31, 32, 33, 34, 35, 36, 37] and not base["on_track"]
    # The skipped batch is not replayed: the outcome is the steps around it, on track.
    assert skip["steps"] == [31, 32, 33, 34, 36, 37] and skip["skipped_steps"] == [35]
    assert skip["on_track"] and skip["max_loss"] == max(skip["losses"]) < base["max_loss"]
    assert skip["losses"][:4] == base["losses"][:4]
    assert doc["whatif"]["recommended"] == "skip_step=35"
    change = next(c for c in doc["plan"]["changes"] if c["knob"] == "skip_step")
    ev = change["evidence"]
    assert ev["on_track"] and ev["max_loss"] == skip["max_loss"] != ev["baseline_max_loss"]
    assert ev["steps"] == [31, 37] and ev["skipped_steps"] == [35]


def test_a_skip_step_outside_the_window_skips_nothing_and_says_so(run: Path) -> None:
    rep = cf.whatif(
        run / "step_30.pt", steps=2, tries=["skip_step=37"], batch=run / "batches.h5", model=MODEL
    )
    (o,) = [o for o in rep.doc["whatif"]["outcomes"] if o["mitigation"] == "skip_step=37"]
    assert o["note"] == "step 37 is not in the window (31-32): nothing skipped"
    assert o["steps"] == [31, 32] and o["skipped_steps"] == []
    assert rep.doc["whatif"]["recommended"] is None


# ---------------------------------------------------------------- item 3: replay, log optional
def test_a_replay_whose_log_cannot_be_read_goes_on_and_says_so(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / "metrics.jsonl").write_bytes(b"\xff\xfe\x00\x9c torn\n\x01\x02\x03\n")
    out = tmp_path / "rep"
    r = _invoke(
        "replay", "--run-dir", str(copy), "--before", "30", "--after", "35",
        *_replaying(copy), "--out", str(out),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    why = (
        f"{copy / 'metrics.jsonl'}: no line reads as a training log: 2 lines skipped (line 1: "
        "not UTF-8 text (binary bytes); line 2: binary bytes)"
    )
    assert doc["replay"]["config"]["metrics"] == {
        "value": str(copy / "metrics.jsonl"),
        "source": f"discovered; cannot be read ({why}): replayed without it",
    }
    assert doc["replay"]["check"]["note"] == "no training log"
    assert doc["verdict"]["first_bad_step"] == 35
    # triage needs the log: the same file stops it, in one line.
    r = _invoke("triage", "--metrics", str(copy / "metrics.jsonl"))
    _one_line(r, f"error: {why}")


def test_a_replay_says_which_lines_of_its_log_it_skipped(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    log = copy / "metrics.jsonl"
    lines = log.read_bytes().split(b"\n")
    lines[9] = lines[9][:30]  # step 10, cut short
    lines[11] = b"\xff\xfe\x00\x9c"  # step 12, bytes that are not UTF-8
    log.write_bytes(b"\n".join(lines))
    out = tmp_path / "rep"
    r = _invoke(
        "replay", "--run-dir", str(copy), "--before", "30", "--after", "35",
        *_replaying(copy), "--out", str(out),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    assert doc["replay"]["config"]["metrics"]["source"] == (
        f"discovered; {log}: 2 lines skipped (line 10: truncated JSON; line 12: not UTF-8 text "
        "(binary bytes)), the rest read"
    )
    assert doc["replay"]["check"]["checked_steps"][0] == 31  # the log read, and checked against


# ---------------------------------------------------------------- item 7: the W&B folder
def test_triage_takes_the_wandb_folder(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from fixtures.log_formats import build as build_logs

    folder = build_logs(tmp_path, only=["wandb"])["wandb"] / "wandb"
    for given in (folder, folder / "latest-run"):  # latest-run: the run, every leg of its id
        r = _invoke("triage", "--metrics", str(given))
        assert r.exit_code == 0, r.output
        assert r.stdout.splitlines()[0] == f"read {given} (50 steps, wandb)"
        assert "first bad step: 35" in r.stdout
