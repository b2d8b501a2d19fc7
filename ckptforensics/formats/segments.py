"""The flight recorder's on-disk batch log: one HDF5 segment per checkpoint interval and rank.

A segment is written in HDF5's single-writer/multiple-reader mode (SWMR, `libver="latest"`)
and flushed after every step: HDF5 orders SWMR metadata writes so that the file on disk is
always consistent, so a run killed mid-step leaves a segment readable up to its last
flushed step (opened with `swmr=True`; a plain open refuses a file whose writer never
closed it). `/step` is flushed last, so no step is listed before its rows are on disk.
Segments are whole files, so the ring drops an old interval by deleting its file, which a
single growing HDF5 file could not do (HDF5 never shrinks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["Segment", "SEGMENT", "FILL", "segment_name", "list_segments", "pad_rows"]

log = logging.getLogger(__name__)

# segment-<first step, 9 digits>-rank<r>.h5: sorting by name sorts by step.
SEGMENT = re.compile(r"^segment-(\d{9})-rank(\d+)\.h5$")
_CHUNK_ROWS = 64  # scalar series grow in chunks of 64 steps
# What pads a step's rows out to the segment's widest (the HF conventions: labels -100 are
# ignored by the loss, attention_mask 0 hides the position; a sample id of -1 is none).
FILL = {"input_ids": 0, "attention_mask": 0, "labels": -100, "sample_id": -1}


def pad_rows(x: torch.Tensor, width: int, key: str) -> torch.Tensor:
    """Rows [B, T] padded out to `width` with the key's `FILL` (a narrower micro-batch or rank)."""
    if x.shape[-1] == width:
        return x
    out = torch.full((*x.shape[:-1], width), FILL.get(key, 0), dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def segment_name(first_step: int, rank: int) -> str:
    return f"segment-{first_step:09d}-rank{rank}.h5"


def list_segments(root: Path) -> list[tuple[int, int, Path]]:
    """(first step, rank, path) of every segment under a recorder directory, in step order."""
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        m = SEGMENT.match(p.name)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), p))
    return sorted(out)


@dataclass
class Segment:
    """One open segment: datasets created on the first step (their shapes come from it)."""

    path: Path
    attrs: dict[str, object]
    compression: str | None = "gzip"
    n: int = 0
    _h: object = None
    _ds: dict[str, object] = field(default_factory=dict)

    def write(self, step: int, rows: dict[str, np.ndarray], series: dict[str, np.ndarray]) -> None:
        """Append one step: `rows` are [B, T] or [B] arrays, `series` per-step values ([] or [G]).

        Rows of a step may be wider (dynamic padding) or fewer (an epoch's last batch) than
        earlier steps': the row datasets grow in B and T, padded with `FILL`, and `/rows`
        and `/seq_len` say how much of each step is its own, so a reader trims it back."""
        import h5py

        if self._h is None:
            h = h5py.File(self.path, "w", libver="latest")
            for k, v in self.attrs.items():
                if v is not None:
                    h.attrs[k] = v
            for k, v in rows.items():
                a = np.asarray(v)
                self._ds[k] = h.create_dataset(
                    k, shape=(0, *a.shape), maxshape=(None,) * (a.ndim + 1), chunks=(1, *a.shape), dtype=a.dtype,
                    compression=self.compression, shuffle=self.compression is not None, fillvalue=FILL.get(k, 0),
                )  # fmt: skip
            for k, v in series.items():
                a = np.asarray(v)
                self._ds[k] = h.create_dataset(
                    k,
                    shape=(0, *a.shape),
                    maxshape=(None, *a.shape),
                    chunks=(_CHUNK_ROWS, *a.shape),
                    dtype=a.dtype,
                )
            for k in ("rows", "seq_len", "step"):
                self._ds[k] = h.create_dataset(
                    k, shape=(0,), maxshape=(None,), chunks=(_CHUNK_ROWS,), dtype=np.int64
                )
            h.swmr_mode = True
            self._h = h
        i = self.n
        b, t = 0, 0
        for k, v in rows.items():
            a, ds = np.asarray(v), self._ds.get(k)
            if ds is None or ds.ndim != a.ndim + 1:
                log.warning(
                    "%s: step %d's %s has shape %s, unlike the segment's: not recorded",
                    self.path.name,
                    step,
                    k,
                    a.shape,
                )
                continue
            grow = tuple(max(x, y) for x, y in zip(ds.shape[1:], a.shape, strict=True))
            ds.resize((i + 1, *grow))
            ds[(i, *(slice(0, x) for x in a.shape))] = a
            ds.flush()
            b, t = a.shape[0], (a.shape[1] if a.ndim > 1 else t)
        for k, v in series.items():
            ds = self._ds.get(k)
            if ds is None or ds.shape[1:] != np.shape(v):
                log.warning(
                    "%s: step %d's %s has shape %s, unlike the segment's: not recorded",
                    self.path.name,
                    step,
                    k,
                    np.shape(v),
                )
                continue
            ds.resize(i + 1, axis=0)
            ds[i] = v
            ds.flush()
        for k, v in (("rows", b), ("seq_len", t), ("step", step)):
            ds = self._ds[k]
            ds.resize(i + 1, axis=0)
            ds[i] = v
            ds.flush()  # `step` last: a listed step has its rows on disk
        self.n += 1

    def flush(self) -> None:
        if self._h is not None:
            self._h.flush()

    def close(self) -> None:
        if self._h is not None:
            self._h.close()
            self._h = None


def drop_oldest(root: Path, keep: int, rank: int) -> list[Path]:
    """Delete this rank's segments beyond the newest `keep` (the ring); returns what went."""
    mine = [p for _, r, p in list_segments(root) if r == rank]
    gone = mine[:-keep] if keep > 0 else mine
    for p in gone:
        with contextlib.suppress(FileNotFoundError):  # another process's ring got there first
            os.remove(p)
    return gone
