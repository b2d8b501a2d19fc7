"""The HF Trainer's training log: `trainer_state.json`'s `log_history` (a format of its own,
found in the run's newest complete checkpoint) and the step column its logging callbacks write
(`train/global_step`); registered with `logs` as this module loads."""

from __future__ import annotations

import json
from pathlib import Path

from ckptforensics.formats.locate import list_checkpoints
from ckptforensics.logs.discover import newest_complete
from ckptforensics.logs.readers import file_legs, numbers
from ckptforensics.logs.registry import (
    Rows,
    RunFiles,
    register_finder,
    register_format,
    register_step_key,
)


def _trainer_state(path: Path) -> list[Rows]:
    state = json.loads(path.read_text())
    rows: Rows = {}
    for r in state.get("log_history", []):
        if "step" in r:
            d = rows.setdefault(int(r["step"]), {})
            d.update(numbers(r, ("step",)))
            if "learning_rate" in r:
                d["lr"] = float(r["learning_rate"])
    return [rows]


def _newest_state(run: RunFiles) -> list[Path]:
    """The newest complete checkpoint's trainer_state.json: its history spans every leg (a
    save that died half-way may hold a torn one)."""
    found = newest_complete(
        [(s, p) for s, p in list_checkpoints(run.path) if (p / "trainer_state.json").is_file()]
    )
    return [found / "trainer_state.json"] if found is not None else []


register_format(
    "trainer_state", lambda p: p.suffix == ".json", lambda p: file_legs(p, _trainer_state, "trainer_state"), order=60
)  # fmt: skip
register_finder("trainer_state", _newest_state, order=50, what="trainer_state.json")
# Its TensorBoard / W&B callbacks log the Trainer's global step beside the metrics.
register_step_key("train/global_step", 0, order=10)
