"""What a new user's plain mistakes and plain inputs get (issue #46, items 3, 5, 7, 8): a damaged
log read line by line and the skipped lines said, --out never among the checkpoints read but
allowed beside a log, and the folders each logger writes taken as the log. No training: logs
and folders as the loggers lay them out, written here."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics import trainers  # noqa: F401  (every trainer's log places and names)
from ckptforensics.cli import cli
from ckptforensics.core.errors import ForensicsError, OutputNotWritable
from ckptforensics.logs import logger_logs, read_log, read_metrics
from ckptforensics.report import check_outside


def _spiky(n: int = 60, at: int = 35) -> list[dict[str, float]]:
    """A quiet loss curve with a spike at step `at` (grad norm and loss), one row a step."""
    rows = []
    for s in range(1, n + 1):
        wiggle = 0.01 * ((s * 7) % 5)
        rows.append(
            {
                "step": s,
                "loss": (9.0 if s == at else 4.0 - 0.02 * s + wiggle),
                "grad_norm": (40.0 if s == at else 1.0 + wiggle),
                "lr": 3e-4,
            }
        )
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, float]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _damage(path: Path) -> None:
    """Line 20 cut short (a torn write), line 40 bytes that are not UTF-8 (a binary blob)."""
    lines = path.read_bytes().split(b"\n")
    lines[19] = lines[19][:25]
    lines[39] = b"\xff\xfe\x00\x9c\x00binary"
    path.write_bytes(b"\n".join(lines))


def _one_line(r: object, line: str) -> None:
    lines = r.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert r.exit_code == 2 and lines == [line], r.stderr  # type: ignore[attr-defined]


# ---------------------------------------------------------------- item 3: damaged logs
def test_a_damaged_jsonl_is_read_line_by_line_and_the_skipped_lines_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = _write_jsonl(tmp_path / "metrics.jsonl", _spiky())
    _damage(log)
    with caplog.at_level(logging.WARNING, logger="ckptforensics.logs"):
        got = read_log(log)
    assert sorted(got.rows) == [s for s in range(1, 61) if s not in (20, 40)]
    note = (
        f"{log}: 2 lines skipped (line 20: truncated JSON; line 40: not UTF-8 text (binary bytes))"
    )
    assert got.skipped == [note]
    assert got.legs[0].skipped == (
        "line 20: truncated JSON",
        "line 40: not UTF-8 text (binary bytes)",
    )
    assert [r.getMessage() for r in caplog.records] == [f"training log {note}; the rest read"]


def test_triage_of_a_damaged_log_finds_the_onset_and_its_report_names_the_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = _write_jsonl(tmp_path / "metrics.jsonl", _spiky())
    _damage(log)
    with caplog.at_level(logging.WARNING, logger="ckptforensics.logs"):
        r = CliRunner().invoke(cli, ["triage", "--metrics", str(log), "--out", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    assert "first bad step: 35" in r.stdout
    note = (
        f"{log}: 2 lines skipped (line 20: truncated JSON; line 40: not UTF-8 text (binary bytes))"
    )
    assert [r.getMessage() for r in caplog.records] == [f"training log {note}; the rest read"]
    written = next((tmp_path / "t").glob("*.json"))
    doc = json.loads(written.read_text())
    assert doc["skipped"] == [note] and doc["steps"] == 58
    assert note in next((tmp_path / "t").glob("*.md")).read_text()


def test_a_log_no_line_of_which_reads_stops_triage_in_one_line(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b"\xff\xfe\x00garbage\n\x01\x02\x03\n")
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(log)])
    _one_line(
        r,
        f"error: {log}: no line reads as a training log: 2 lines skipped (line 1: not UTF-8 text "
        "(binary bytes); line 2: binary bytes)",
    )


def test_the_optional_log_of_a_replay_that_cannot_be_read_is_no_rows_and_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b"\xff\xfe\x00garbage\n")
    with caplog.at_level(logging.WARNING, logger="ckptforensics.logs"):
        assert read_metrics(log) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"{log}: no line reads as a training log: 1 line skipped (line 1: not UTF-8 text "
        "(binary bytes)); going on without the training log"
    ]
    with pytest.raises(ForensicsError, match="no line reads as a training log"):
        read_log(log)


def test_a_torn_csv_row_is_skipped_and_said(tmp_path: Path) -> None:
    log = tmp_path / "metrics.csv"
    rows = [f"{r['step']},{r['loss']},{r['grad_norm']}" for r in _spiky(12)]
    rows[5] = "6,3.9"  # a row cut short
    rows[8] = b"9,\xff\xfe,1.0".decode("latin-1")
    log.write_bytes(("step,loss,grad_norm\n" + "\n".join(rows) + "\n").encode("latin-1"))
    got = read_log(log)
    assert sorted(got.rows) == [s for s in range(1, 13) if s not in (6, 9)]
    assert got.skipped == [
        f"{log}: 2 lines skipped (line 7: 2 fields where the header has 3 (a torn row); "
        "line 10: not UTF-8 text (binary bytes))"
    ]


# ---------------------------------------------------------------- items 5 and 8: --out
def test_out_in_the_folder_of_checkpoint_files_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for s in (30, 35):
        (run / f"step_{s}.pt").write_bytes(b"PK\x03\x04")
    with pytest.raises(
        OutputNotWritable,
        match=r"is the folder of the input checkpoint .*step_30.pt: the report's files would land among the checkpoints",
    ):
        check_outside(run, [run / "step_30.pt", run / "step_35.pt"])
    check_outside(run / "incident", [run / "step_30.pt", run / "step_35.pt"])  # its own folder


def test_diff_with_out_among_checkpoint_files_is_one_line_and_writes_nothing(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for s in (30, 35):
        (run / f"step_{s}.pt").write_bytes(b"PK\x03\x04")
    r = CliRunner().invoke(
        cli, ["diff", "--run-dir", str(run), "--before", "30", "--after", "35", "--out", str(run)]
    )
    _one_line(
        r,
        f"error: --out {run} is the folder of the input checkpoint {run / 'step_30.pt'}: the "
        f"report's files would land among the checkpoints; pass a directory of its own (e.g. "
        f"{run / 'incident'})",
    )
    assert sorted(p.name for p in run.iterdir()) == ["step_30.pt", "step_35.pt"]


def test_out_as_the_run_directory_is_refused_but_a_folder_in_it_is_not(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoint-30").mkdir(parents=True)
    (run / "checkpoint-30" / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        OutputNotWritable, match="is the run directory .*which holds the checkpoints read"
    ):
        check_outside(run, [run])
    with pytest.raises(OutputNotWritable, match="is inside the input checkpoint"):
        check_outside(run / "checkpoint-30" / "rep", [run])
    check_outside(run / "triage", [run])


def test_triage_beside_its_log_with_no_run_dir_writes_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The current directory holds no checkpoint: it is no input, --out below it is fine."""
    _write_jsonl(tmp_path / "metrics.jsonl", _spiky())
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["triage", "--metrics", "metrics.jsonl", "--out", "triage/"])
    assert r.exit_code == 0, r.stderr
    assert "first bad step: 35" in r.stdout
    assert sorted(p.suffix for p in (tmp_path / "triage").iterdir()) == [".html", ".json", ".md"]


# ---------------------------------------------------------------- item 7: a logger's folder
def _mlflow_store(run: Path) -> Path:
    """MLflow's file store as its FileStore writes it: mlruns/<experiment>/<run>/meta.yaml,
    metrics/<key> of `timestamp value step` lines."""
    r = run / "mlruns" / "0" / "4c0e5dd9"
    (r / "metrics").mkdir(parents=True)
    (r / "meta.yaml").write_text("run_id: 4c0e5dd9\nexperiment_id: '0'\nlifecycle_stage: active\n")
    rows = _spiky()
    for key in ("loss", "grad_norm"):
        (r / "metrics" / key).write_text(
            "".join(f"{1796600000000 + row['step']} {row[key]} {row['step']}\n" for row in rows)
        )
    return run / "mlruns"


def _csv_logger(run: Path) -> Path:
    """A CSVLogger's lightning_logs/version_0/metrics.csv."""
    d = run / "lightning_logs" / "version_0"
    d.mkdir(parents=True)
    lines = ["step,epoch,train_loss,grad_norm"]  # a CSVLogger logs step s as s - 1
    lines += [f"{r['step'] - 1},0,{r['loss']},{r['grad_norm']}" for r in _spiky()]
    (d / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run / "lightning_logs"


@pytest.mark.parametrize("make", [_mlflow_store, _csv_logger], ids=["mlruns", "lightning_logs"])
def test_triage_takes_the_folder_a_logger_writes(tmp_path: Path, make: object) -> None:
    folder = make(tmp_path / "run")  # type: ignore[operator]
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(folder)])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"read {folder} (60 steps, ")
    assert "first bad step: 35" in r.stdout


def test_a_wandb_folder_and_its_latest_run_are_the_run_files(tmp_path: Path) -> None:
    """W&B's layout (wandb/offline-run-<date>-<id>/run-<id>.wandb, latest-run a link to the
    newest): given the wandb folder, the run's files, every leg (reading them is the wandb
    reader's: tests/test_new_user_inputs.py reads a real offline run)."""
    w = tmp_path / "run" / "wandb"
    legs = [w / "offline-run-20261207_074506-ab12", w / "offline-run-20261207_074509-ab12"]
    for d in legs:
        d.mkdir(parents=True)
        (d / "run-ab12.wandb").write_bytes(b":W&B")
    os.symlink(legs[1].name, w / "latest-run")
    assert logger_logs(w) == [d / "run-ab12.wandb" for d in legs]


def test_a_torn_line_of_an_mlflow_metric_file_is_skipped_and_said(tmp_path: Path) -> None:
    store = _mlflow_store(tmp_path / "run")
    loss = store / "0" / "4c0e5dd9" / "metrics" / "loss"
    lines = loss.read_bytes().splitlines()
    lines[9] = lines[9][:15] + b"\xff"  # the run killed mid-write
    loss.write_bytes(b"\n".join(lines) + b"\n")
    got = read_log(store)
    assert "loss" not in got.rows[10] and got.rows[11]["loss"] == _spiky()[10]["loss"]
    assert got.skipped == [
        f"{store / '0' / '4c0e5dd9'}: 1 line skipped (metrics/loss line 10: not 'timestamp value step')"
    ]


def test_a_csv_export_with_a_byte_order_mark_and_carriage_returns_reads(tmp_path: Path) -> None:
    log = tmp_path / "export.csv"
    rows = [f"{r['step']},{r['loss']}" for r in _spiky(12)]
    log.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(["step,loss", *rows]).encode())
    assert sorted(read_log(log).rows) == list(range(1, 13))
    log.write_bytes("\r".join(["step,loss", *rows]).encode())
    assert sorted(read_log(log).rows) == list(range(1, 13))
