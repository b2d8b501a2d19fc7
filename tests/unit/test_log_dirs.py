"""Where a replay looks for the run's own log: never in the folder of other runs."""

from __future__ import annotations

from pathlib import Path

from ckptforensics import trainers  # noqa: F401  (every trainer's log places)
from ckptforensics.logs import find_metrics, log_dirs


def _events(d: Path) -> None:
    d.mkdir(parents=True)
    (d / "events.out.tfevents.1.host").write_bytes(b"")


def test_a_checkpoint_file_in_a_run_folder_looks_only_there(tmp_path: Path) -> None:
    """runs/a/ckpt_5.pt has no log; runs/b has TensorBoard events: a's replay must not take them."""
    a = tmp_path / "runs" / "a"
    a.mkdir(parents=True)
    (a / "ckpt_5.pt").write_bytes(b"")
    _events(tmp_path / "runs" / "b" / "tb")
    assert log_dirs(a / "ckpt_5.pt") == [a]
    assert [find_metrics(d) for d in log_dirs(a / "ckpt_5.pt")] == [None]


def test_checkpoint_folders_lead_up_to_their_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert log_dirs(run / "checkpoint-40") == [run]  # HF: the checkpoint is a folder in the run
    assert log_dirs(run / "step40" / "model_and_optim") == [run / "step40", run]  # OLMo-core
    assert log_dirs(run / "out" / "step-00000040" / "lit_model.pth") == [
        run / "out" / "step-00000040",
        run / "out",
    ]  # LitGPT
    ckpt = run / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=40.ckpt"
    assert log_dirs(ckpt)[:2] == [
        ckpt.parent,
        run / "lightning_logs" / "version_0",
    ]  # Lightning: metrics.csv beside checkpoints/
