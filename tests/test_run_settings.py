"""One answer to "which clip did this run use" (`trainers.settings.run_settings`, issue #43):
audit reports the clip the replay reads, on a flight-recorded loop whose batch log states it
(issue #46: audit said "no gradient-clipping setting" where replay read clip 1.0), and on a run
of each trainer the zoo and fixtures/data hold; where the run records none, the replay
calibrates and audit says it is unknown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptforensics as api
from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.engine.replay.records import ReplayConfig
from ckptforensics.engine.replay.window import plan
from ckptforensics.trainers import framework_for
from ckptforensics.trainers.settings import run_settings
from tests.conftest import ROOT

DATA = ROOT / "fixtures" / "data"
MODEL = "fixtures/tinygpt.py:factory"


def _clip_row(run_dir: Path, step: str, model: str | None) -> dict[str, Any]:
    doc = api.audit(step, run_dir=run_dir, model=model, compare="none").doc
    return next(r for r in doc["audit"]["rows"] if r["id"] == "clipping")


def _replay_clips(before: Path, after: Path, batch: Path) -> list[tuple[float | None, str]]:
    return plan(ReplayConfig(before=before, after=after, batch=str(batch))).clips


def _agree(row: dict[str, Any], clips: list[tuple[float | None, str]]) -> None:
    """The audit's clipping row states the clip the replay read, from the same source; where
    the replay calibrates (no file records one), the row says it is unknown."""
    if len(clips) > 1:
        assert all(src.startswith("calibrated") for _, src in clips)
        assert row["status"] == "unknown" and row["value"] is None
        return
    ((clip, src),) = clips
    assert row["value"] == (clip if clip is not None else 0.0)
    assert f"({src})" in row["message"]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain loop (torch.save checkpoints, no config) whose flight recorder states clip 1.0."""
    out = tmp_path_factory.mktemp("recorded")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "fixtures" / "record_run.py"), str(out), "10"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_audit_reports_the_clip_replay_reads_from_the_batch_log(recorded_run: Path) -> None:
    clips = _replay_clips(
        recorded_run / "ckpt_5.pt", recorded_run / "ckpt_8.pt", recorded_run / "flight"
    )
    assert clips == [(1.0, "batch log attribute grad_clip")]
    row = _clip_row(recorded_run, str(recorded_run / "ckpt_8.pt"), MODEL)
    assert row["status"] == "ok" and row["value"] == 1.0
    assert row["message"] == "gradients clipped at norm 1 (batch log attribute grad_clip)"
    _agree(row, clips)


# (trainer, run dir, before, after, batch log, --model): one run of each trainer. The HF run
# keeps no batch log: the replay's plan reads another run's (the clip comes before the batches).
RUNS = [
    ("nanogpt", "zoo:healthy", "step_30.pt", "step_40.pt", "batches.h5", MODEL),
    ("loop", "zoo:healthy-torch", "step_30.pt", "step_40.pt", "batches.h5", MODEL),
    ("hf", "zoo:hf-trainer", "checkpoint-10", "checkpoint-20", "zoo:healthy-torch", None),
    (
        "lightning",
        "zoo:lightning",
        "epoch=0-step=10.ckpt",
        "epoch=0-step=20.ckpt",
        "batches.h5",
        "fixtures/tinygpt.py:from_hparams",
    ),
    (
        "megatron",
        "data:megatron-core-0.19",
        "legacy/iter_0000010",
        "legacy/iter_0000020",
        "batches.h5",
        None,
    ),
    ("olmo_core", "data:olmo-core-3.0", "run/step10", "run/step20", "batches.h5", None),
    ("loop", "data:litgpt-0.5", "step-00000010", "step-00000020", "batches.h5", None),
]


def _dir(zoo: dict[str, Path], where: str) -> Path:
    kind, name = where.split(":", 1)
    return zoo[name] if kind == "zoo" else DATA / name


@pytest.mark.parametrize(
    ("trainer", "where", "before", "after", "batch", "model"), RUNS, ids=[r[1] for r in RUNS]
)
def test_audit_and_replay_state_the_same_clip_for_every_trainer(
    zoo: dict[str, Path],
    trainer: str,
    where: str,
    before: str,
    after: str,
    batch: str,
    model: str | None,
) -> None:
    run = _dir(zoo, where)
    log = _dir(zoo, batch) / "batches.h5" if ":" in batch else run / batch
    with open_checkpoint(run / after) as ck:
        assert trainer == framework_for(ck).NAME
        settings = run_settings(ck)
    clips = _replay_clips(run / before, run / after, log)
    row = _clip_row(run, str(run / after), model)
    _agree(row, clips)
    if settings.clip_source is not None:
        assert clips == [(settings.clip, settings.clip_source)]
