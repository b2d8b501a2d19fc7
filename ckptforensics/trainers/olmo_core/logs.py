"""OLMo-core's training log: its MetricSaverCallback's `metrics_step{N}.json`, one file per step
in the save folder, a format of its own; registered with `logs` as this module loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckptforensics.logs.readers import mtime, numbers
from ckptforensics.logs.registry import Leg, Rows, RunFiles, register_finder, register_format

__all__ = ["METRICS"]

METRICS = re.compile(r"^metrics_step(\d+)\.json$")


def _metrics(folder: Path) -> list[Rows]:
    """Every `metrics_step{N}.json` of the folder: one leg."""
    rows: Rows = {}
    for f in folder.iterdir():
        m = METRICS.match(f.name)
        if m:
            rows[int(m.group(1))] = numbers(json.loads(f.read_text()))
    return [rows]


def _legs(path: Path) -> list[Leg]:
    """One metrics file stands for its folder's: their leg, started at the file's time."""
    return [Leg(str(path.parent), r, mtime(path), 0, "olmo-core") for r in _metrics(path.parent)]


def _metrics_files(run: RunFiles) -> list[Path]:
    found = sorted(run.path.glob("metrics_step*.json"))
    return found[:1]


# A format of OLMo-core's own: no other trainer's row conventions apply to it.
register_format("olmo-core", lambda p: bool(METRICS.match(p.name)), _legs, order=40, shared=False)
register_finder("olmo-core", _metrics_files, order=60, what="OLMo-core metrics_step*.json")
