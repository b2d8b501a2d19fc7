"""Where each trainer leaves its training log, and every file of it (a restarted run leaves several)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ckptforensics.checkpoints import first_complete
from ckptforensics.formats.locate import list_checkpoints
from ckptforensics.logs.readers import is_megatron_text, mlflow_run_name

__all__ = ["find_logs", "log_dirs"]

log = logging.getLogger(__name__)

# Folders a walk does not enter: checkpoints are large and hold no logs of their own that
# the searches below want (trainer_state.json is looked up through list_checkpoints).
_SKIP = re.compile(
    r"^(?:iter_\d+|global_step\d+|checkpoint-\d+|step[-_]?\d+|\..*|__pycache__|wandb|mlruns)$"
)


# A checkpoint's own folder inside its run: HF's checkpoint-N, Megatron's iter_N, DeepSpeed's
# global_stepN, DCP's and LitGPT's step-N, OLMo-core's stepN, Lightning's checkpoints/ (in
# version_N/), a plain ckpts/.
_CKPT_DIR = re.compile(
    r"^(?:iter_\d+|global_step\d+|checkpoint-\d+|step[-_]?\d+|checkpoints?|ckpts?|version_\d+)$"
)


def log_dirs(checkpoint: Path) -> list[Path]:
    """The folders the log of the run that wrote `checkpoint` can be in: the folder it sits
    in, and the folders above only while it sits in a checkpoint folder of its run's. The
    folder above a run holds other runs: a log found walking it is another run's (a
    `runs/a/ckpt_5.pt` with no log of its own read `runs/b`'s TensorBoard events)."""
    out, d = [checkpoint.parent], checkpoint.parent
    while _CKPT_DIR.match(d.name) and len(out) < 3:
        d = d.parent
        out.append(d)
    return out


def _walk(root: Path, depth: int = 3) -> Iterator[Path]:
    """Files under root, at most `depth` folders down, skipping checkpoint folders."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        if e.is_file():
            yield Path(e.path)
        elif e.is_dir() and depth > 0 and not _SKIP.match(e.name):
            yield from _walk(Path(e.path), depth - 1)


def _wandb(run_dir: Path) -> list[Path]:
    """wandb/latest-run's `.wandb` file and those of its earlier legs (W&B names every run
    folder `{offline-,}run-<date>-<id>`; a resumed run keeps its id)."""
    root = run_dir / "wandb"
    if not root.is_dir():
        return []
    latest = root / "latest-run"
    runs = sorted(root.glob("*run-*-*/run-*.wandb"))
    if not runs:
        return []
    last = next(iter(latest.glob("run-*.wandb")), None) if latest.exists() else None
    run_id = (last or runs[-1]).stem.removeprefix("run-")
    return [r for r in runs if r.stem == f"run-{run_id}"]


def _mlflow(run_dir: Path) -> list[Path]:
    """The newest MLflow run under mlruns/ and the earlier runs of the same experiment and
    name (a trainer resumed without MLFLOW_RUN_ID opens a new run under the same name)."""
    root = run_dir / "mlruns"
    if not root.is_dir():
        return []
    runs = [m.parent for m in root.glob("*/*/meta.yaml") if (m.parent / "metrics").is_dir()]
    if not runs:
        return []
    newest = max(runs, key=lambda r: (r / "meta.yaml").stat().st_mtime)
    name = mlflow_run_name(newest)
    return sorted(r for r in runs if r.parent == newest.parent and mlflow_run_name(r) == name)


def find_logs(run_dir: Path) -> list[Path]:
    """Every file of the run's training log, for the first kind found, in this order:
    metrics.jsonl / metrics.csv; Lightning's and LitGPT's CSVLogger files (every
    version_N: one per launch); the newest HF checkpoint's trainer_state.json (its history
    spans every leg); OLMo-core's metrics_step{N}.json; Megatron's printed log (*.log,
    *.out, *.txt with iteration lines, slurm-*.out); TensorBoard event files (tb/,
    runs/*/, tensorboard/, lightning_logs/version_N/, Megatron's --tensorboard-dir); the
    W&B run of wandb/latest-run; the newest MLflow run in mlruns/ or mlflow.db (MLflow 3's
    default store). [] when there is none."""
    if not run_dir.is_dir():
        return []
    for name in ("metrics.jsonl", "metrics.csv"):
        if (run_dir / name).is_file():
            return [run_dir / name]
    if (
        run_dir.name == "checkpoints" and (run_dir.parent / "metrics.csv").is_file()
    ):  # Lightning's version_N/checkpoints
        return [run_dir.parent / "metrics.csv"]
    for pattern in ("lightning_logs/version_*/metrics.csv", "logs/csv/version_*/metrics.csv"):
        found = sorted(run_dir.glob(pattern), key=lambda p: int(p.parent.name.split("_")[-1]))
        if found:
            return found
    ckpts = [
        (s, Path(p))
        for s, p in list_checkpoints(run_dir)
        if (Path(p) / "trainer_state.json").is_file()
    ]
    if ckpts:
        # The newest complete checkpoint's: a save that died half-way may hold a torn one.

        found, skipped = first_complete(list(reversed(ckpts)))
        for note in skipped:
            log.info("training log: %s", note)
        if found is not None:
            return [found[1] / "trainer_state.json"]
    olmo = sorted(run_dir.glob("metrics_step*.json"))
    if olmo:
        return [olmo[0]]
    files = list(_walk(run_dir))
    text = [f for f in files if f.suffix in (".log", ".out", ".txt") and is_megatron_text(f)]
    if text:
        return text
    events = [f for f in files if f.name.startswith("events.out.tfevents.")]
    if events:
        return events
    return (
        _wandb(run_dir)
        or _mlflow(run_dir)
        or ([run_dir / "mlflow.db"] if (run_dir / "mlflow.db").is_file() else [])
    )
