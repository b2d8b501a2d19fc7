"""Where a run leaves its training log, and every file of it (a restarted run leaves several):
the places registered (`registry.FINDERS`: the generic ones here, each trainer's from its
`logs.py`) asked in turn."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from ckptforensics.formats import first_complete
from ckptforensics.logs.readers import mlflow_run_name
from ckptforensics.logs.registry import FINDERS, RunFiles, register_finder

__all__ = [
    "find_logs",
    "log_dirs",
    "logger_logs",
    "looked_for",
    "newest_complete",
    "version_files",
    "LOGGER_STORES",
]

log = logging.getLogger(__name__)


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


def newest_complete(ckpts: list[tuple[int, Path]]) -> Path | None:
    """The newest of `ckpts` (step, path; by step) that is complete by its format's rule, each
    newer one passed over said in the log (a save that died half-way may hold a torn log)."""
    if not ckpts:
        return None
    found, skipped = first_complete(list(reversed(ckpts)))
    for note in skipped:
        log.info("training log: %s", note)
    return found[1] if found is not None else None


def version_files(run_dir: Path, pattern: str) -> list[Path]:
    """A logger's files in its `version_N` folders (one a launch), by N."""
    return sorted(run_dir.glob(pattern), key=lambda p: int(p.parent.name.split("_")[-1]))


def _metrics_file(run: RunFiles) -> list[Path]:
    for name in ("metrics.jsonl", "metrics.csv"):
        if (run.path / name).is_file():
            return [run.path / name]
    return []


def _events(run: RunFiles) -> list[Path]:
    return [f for f in run.files if f.name.startswith("events.out.tfevents.")]


def _wandb(run: RunFiles) -> list[Path]:
    """wandb/latest-run's `.wandb` file and those of its earlier legs (W&B names every run
    folder `{offline-,}run-<date>-<id>`; a resumed run keeps its id)."""
    root = run.path / "wandb"
    if not root.is_dir():
        return []
    latest = root / "latest-run"
    runs = sorted(root.glob("*run-*-*/run-*.wandb"))
    if not runs:
        return []
    last = next(iter(latest.glob("run-*.wandb")), None) if latest.exists() else None
    run_id = (last or runs[-1]).stem.removeprefix("run-")
    return [r for r in runs if r.stem == f"run-{run_id}"]


def _mlflow(run: RunFiles) -> list[Path]:
    """The newest MLflow run under mlruns/ and the earlier runs of the same experiment and
    name (a trainer resumed without MLFLOW_RUN_ID opens a new run under the same name)."""
    root = run.path / "mlruns"
    if not root.is_dir():
        return []
    runs = [m.parent for m in root.glob("*/*/meta.yaml") if (m.parent / "metrics").is_dir()]
    if not runs:
        return []
    newest = max(runs, key=lambda r: (r / "meta.yaml").stat().st_mtime)
    name = mlflow_run_name(newest)
    return sorted(r for r in runs if r.parent == newest.parent and mlflow_run_name(r) == name)


def _mlflow_db(run: RunFiles) -> list[Path]:
    """MLflow 3's default store."""
    db = run.path / "mlflow.db"
    return [db] if db.is_file() else []


def find_logs(run_dir: Path) -> list[Path]:
    """Every file of the run's training log, for the first kind found, in the order the places
    are registered: metrics.jsonl / metrics.csv; each trainer's own (its CSVLogger's files,
    every version_N: one per launch; the newest checkpoint's trainer_state.json, whose history
    spans every leg; metrics_step{N}.json; a printed log: *.log, *.out, *.txt, slurm-*.out);
    TensorBoard event files (tb/, runs/*/, tensorboard/, a logger's version_N/, a trainer's
    --tensorboard-dir); the W&B run of wandb/latest-run; the newest MLflow run in mlruns/ or
    mlflow.db (MLflow 3's default store). [] when there is none."""
    if not run_dir.is_dir():
        return []
    run = RunFiles(run_dir)
    return next((found for f in FINDERS if (found := f.find(run))), [])


# A logger's store that a run folder holds and `RunFiles` does not walk: given as the log,
# the places are asked of the run folder above it first.
LOGGER_STORES = ("wandb", "mlruns")


def logger_logs(folder: Path) -> list[Path]:
    """The log a logger wrote in `folder`, a folder of its own inside the run (`wandb/`,
    `wandb/latest-run`, `runs/`, `lightning_logs/`, `mlruns/`, `tb/`): each place registered
    asked of the run folder above it, in order, keeping the first that finds files inside
    `folder`. [] when none does."""
    if not folder.is_dir():
        return []
    inside = Path(os.path.realpath(folder))
    run = RunFiles(folder.parent)
    for f in FINDERS:
        found = [p for p in f.find(run) if _within(p, inside)]
        if found:
            return found
    return []


def _within(path: Path, folder: Path) -> bool:
    real = Path(os.path.realpath(path))
    return real == folder or folder in real.parents


def looked_for() -> str:
    """What `find_logs` looks for, as an error names it."""
    return ", ".join(f.what for f in FINDERS if f.what)


# The generic places, among which each trainer's `logs.py` places its own (order 20-70).
register_finder("metrics", _metrics_file, order=10, what="metrics.jsonl / .csv")
register_finder("tensorboard", _events, order=80, what="TensorBoard events (tb/, runs/, --tensorboard-dir)")  # fmt: skip
register_finder("wandb", _wandb, order=90, what="wandb/latest-run")
register_finder("mlflow", _mlflow, order=100, what="mlruns/")
register_finder("mlflow.db", _mlflow_db, order=110)
