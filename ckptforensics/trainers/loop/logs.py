"""LitGPT's training log: its CSVLogger's `logs/csv/version_N/metrics.csv`, whose steps are the
`iter` column; registered with `logs` as this module loads."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.logs.discover import version_files
from ckptforensics.logs.registry import register_finder, register_step_rule

# LitGPT logs each iteration at logger step iter_num - 1; its checkpoints count optimizer
# steps (step_count = iter_num without gradient accumulation): its `iter` column is the step.
_COLUMNS = {"iter", "iter_time", "remaining_time"}


def _steps(path: Path, fmt: str, cols: set[str]) -> tuple[str | None, int] | None:
    return ("iter", 0) if fmt == "csv" and cols >= _COLUMNS else None


register_step_rule("litgpt", _steps, order=10)
register_finder(
    "litgpt",
    lambda run: version_files(run.path, "logs/csv/version_*/metrics.csv"),
    order=40,
    what="LitGPT logs/csv",
)
