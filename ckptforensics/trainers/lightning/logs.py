"""Lightning's loggers: where they write (`lightning_logs/version_N/`, a CSVLogger's
`metrics.csv` beside its `checkpoints/`) and how they count steps (one behind the optimizer
steps); registered with `logs` as this module loads."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.logs.discover import version_files
from ckptforensics.logs.registry import (
    RunFiles,
    register_finder,
    register_step_key,
    register_step_rule,
)

__all__ = ["logger_folder"]


def logger_folder(path: Path) -> bool:
    """A log in a Lightning logger's version folder (`hparams.yaml` beside it, or
    `lightning_logs/version_N`). Lightning logs a training step's metrics under
    `global_step` before that step's optimizer step counts, so optimizer step s is logged
    as s - 1 (measured on a CSVLogger run: the first step's loss sits at step 0); its
    checkpoints count completed steps."""
    return (path.parent / "hparams.yaml").is_file() or (
        path.parent.parent.name == "lightning_logs" and path.parent.name.startswith("version_")
    )


def _steps(path: Path, fmt: str, cols: set[str]) -> tuple[str | None, int] | None:
    """A logger folder's event file, or its CSVLogger's file (an `epoch` column on every row:
    its logger connector adds it), counts steps one behind."""
    if fmt == "tensorboard" or (fmt == "csv" and "epoch" in cols and "step" in cols):
        return (None, 1) if logger_folder(path) else None
    return None


def _beside_checkpoints(run: RunFiles) -> list[Path]:
    """Given version_N/checkpoints: the CSVLogger's metrics.csv beside it and, inside
    `lightning_logs/`, every version's: a job resumed with `fit(ckpt_path=...)` logs into a
    version of its own, and each is a leg of the run's log (the later wins on a step both hold)."""
    csv = run.path.parent / "metrics.csv"
    if run.path.name != "checkpoints" or not csv.is_file():
        return []
    if run.path.parent.parent.name == "lightning_logs":
        return version_files(run.path.parent.parent.parent, "lightning_logs/version_*/metrics.csv")
    return [csv]


register_step_rule("lightning", _steps, order=20)
# WandbLogger (and a CSV holding its columns): the trainer's global step, one behind.
register_step_key("trainer/global_step", 1, order=20)
register_finder("lightning-checkpoints", _beside_checkpoints, order=20)
# CSVLogger: one version_N a launch, every one a leg.
register_finder(
    "lightning",
    lambda run: version_files(run.path, "lightning_logs/version_*/metrics.csv"),
    order=30,
    what="lightning_logs",
)
