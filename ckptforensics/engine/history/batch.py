"""The one fixed batch every checkpoint of a history is measured on: the run's own, the first
step its batch log holds (`--batch`, else `batches.h5` or a flight recorder beside the
checkpoints), or the first batch rebuilt from its training data (`--data`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource, open_batches, with_rows
from ckptforensics.logs import log_dirs
from ckptforensics.trainers import hook, open_dataset

__all__ = ["FixedBatch", "fixed_batch"]

_KEYS = ("input_ids", "attention_mask", "labels")


@dataclass(frozen=True, slots=True)
class FixedBatch:
    """The batch and where it comes from, in words (for the report)."""

    batch: dict[str, torch.Tensor]
    source: str


def _discover(run_dir: Path, first: Path) -> str | None:
    """A batch log beside the checkpoints: the run dir's, else a folder above the first's."""
    for d in (run_dir, *log_dirs(first)):
        for cand in (d / "batches.h5", d / "flight"):
            if cand.exists():
                return str(cand)
    return None


def _source(batch: str | None, data: str | None, ck: Checkpoint, run_dir: Path) -> BatchSource:
    spec = batch or (None if data is not None else _discover(run_dir, ck.path))
    if spec is not None:
        src = open_batches(spec)
        if not src.ids_only:
            return src
        if data is None:
            raise ForensicsError(
                f"{spec}: the log keeps sample ids, not tokens: pass --data (the dataset they index) as well"
            )
        return with_rows(src, open_dataset(data), f"--data {data}")
    if data is None:
        raise ForensicsError(
            f"{run_dir}: no batch log found (batches.h5, flight/); pass --batch (a batch log or batch file) or --data"
        )
    rebuild = hook(ck, "batches")  # which trainers' data `--data` rebuilds: trainers/
    found = rebuild(data, ck, None) if rebuild is not None else None
    if not found:
        raise ForensicsError(
            f"{ck.path}: --data rebuilds batches only for the trainers that can; this is a {ck.format} checkpoint: pass --batch"
        )
    return found[0]


def fixed_batch(batch: str | None, data: str | None, ck: Checkpoint, run_dir: Path) -> FixedBatch:
    """The history's batch: the first step the source holds (a source of any step, a file or
    a callable: the step after the first checkpoint).

    Raises:
        ForensicsError: no batch log found and no --data, or one that cannot be read.
    """
    src = _source(batch, data, ck, run_dir)
    step = src.steps[0] if src.steps else (ck.step or 0) + 1
    got = src.batch(step)
    kept = {k: v for k, v in got.items() if k in _KEYS}
    return FixedBatch(kept, f"the batch of step {step} ({src.describe})")
