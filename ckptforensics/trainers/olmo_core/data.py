"""OLMo-core's training data, read without OLMo-core: the batch of a step rebuilt.

What OLMo-core 3.0's `NumpyFSLDataset` and `NumpyFSLDataLoader` do (olmo_core/data/
numpy_dataset.py, data_loader.py), from what the checkpoint records (`config.json`'s
`dataset` and `data_loader`, `train/rank0.pt`'s `data_loader` state):

- each token file (`dataset.paths`, a raw memmap of `dataset.dtype`, no header) is cut into
  instances of `sequence_length` tokens, the file's tail dropped; instances are numbered
  file after file;
- an epoch's order is `arange(n)` shuffled by `np.random.Generator(PCG64(seed + epoch))`
  (epochs count from 1; `chunk_size` 1), its tail cut to whole batches;
- a global batch is `global_batch_size / sequence_length` consecutive instances of that
  order; optimizer step s is batch s - 1 counted over the epochs;
- labels are the inputs shifted by one, the last position ignored (-100).

`dataset.paths` are recorded as the launch script gave them, mostly relative to the launch
directory: each is looked for under `--data` (as the directory they are relative to, or
holding files of those names), else resolved against the run directory, its parents and
`--data`'s parent (`paths.resolve_recorded`); where each was found is stated.

Checked in the test against the batches OLMo-core's own Trainer fed its model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.core.paths import resolve_recorded
from ckptforensics.formats.batches import BatchError, BatchSource
from ckptforensics.formats.torchfile import load_torch_file

__all__ = ["olmo_batches", "is_olmo_checkpoint"]

_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}


def is_olmo_checkpoint(path: Path) -> bool:
    return (
        (path / "train" / "rank0.pt").is_file()
        and (path / "config.json").is_file()
        and (path / "model_and_optim").is_dir()
    )


def _run_config(ckpt_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    import json

    try:
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        state, _ = load_torch_file(ckpt_dir / "train" / "rank0.pt")
    except (OSError, ValueError) as e:
        raise BatchError(
            f"{ckpt_dir}: no OLMo-core run config or train state ({type(e).__name__}: {e})"
        ) from None
    ds, dl = cfg.get("dataset") or {}, cfg.get("data_loader") or {}
    if not str(ds.get("_CLASS_", "")).endswith("NumpyFSLDatasetConfig"):
        raise BatchError(
            f"{ckpt_dir}: --data rebuilds OLMo-core's NumpyFSLDataset; this run's dataset is {ds.get('_CLASS_')}: pass --batch"
        )
    loader = state.get("data_loader") if isinstance(state, dict) else None
    return ds, dl, loader if isinstance(loader, dict) else {}


def olmo_batches(data: str, ckpt_dir: Path) -> BatchSource:
    """The global batch of every step, from the token files under `data` (the directory the
    run's `dataset.paths` are relative to, or holding files of those names)."""
    ds, dl, loader = _run_config(ckpt_dir)
    seq = int(ds.get("sequence_length") or loader.get("sequence_length") or 0)
    gbs, seed = dl.get("global_batch_size"), dl.get("seed", loader.get("seed"))
    if seq < 1 or not isinstance(gbs, int) or gbs % seq or not isinstance(seed, int):
        raise BatchError(
            f"{ckpt_dir}: the run's config gives no usable sequence length, global batch size (tokens) and seed"
        )
    if int(dl.get("chunk_size", 1) or 1) != 1:
        raise BatchError(
            f"{ckpt_dir}: data_loader.chunk_size {dl.get('chunk_size')}: only chunk_size 1 is rebuilt; pass --batch"
        )
    dtype = _DTYPES.get(str(ds.get("dtype", "uint16")))
    if dtype is None:
        raise BatchError(f"{ckpt_dir}: dataset dtype {ds.get('dtype')} is not a token dtype")
    root = Path(data)
    arrays, said = [], []
    for p in ds.get("paths") or []:
        f, how = _token_file(str(p), root, ckpt_dir.parent)
        said.append(how)
        arrays.append(np.memmap(f, dtype=dtype, mode="r"))
    if not arrays:
        raise BatchError(f"{ckpt_dir}: the run's dataset lists no token files")
    per_file = [a.size // seq for a in arrays]
    starts = np.cumsum([0, *per_file])
    n, ipb = int(starts[-1]), gbs // seq
    per_epoch = n // ipb
    if per_epoch < 1:
        raise BatchError(f"--data {data}: {n} instances, fewer than one global batch of {ipb}")
    orders: dict[int, np.ndarray] = {}

    def instance(i: int) -> np.ndarray:
        k = int(np.searchsorted(starts, i, side="right") - 1)
        j = i - int(starts[k])
        return np.asarray(arrays[k][j * seq : (j + 1) * seq], dtype=np.int64)

    def get(step: int) -> dict[str, torch.Tensor]:
        epoch, b = 1 + (step - 1) // per_epoch, (step - 1) % per_epoch
        if epoch not in orders:
            order = np.arange(n, dtype=np.uint32)
            np.random.Generator(np.random.PCG64(seed=seed + epoch)).shuffle(order)
            orders[epoch] = order
        ids = torch.from_numpy(
            np.stack([instance(int(i)) for i in orders[epoch][b * ipb : (b + 1) * ipb]])
        )
        labels = torch.cat(
            [ids[:, 1:], torch.full((ids.shape[0], 1), -100, dtype=ids.dtype)], dim=1
        )
        return {"input_ids": ids, "labels": labels}

    shown = "; ".join(said[:3]) + (f"; {len(said) - 3} more" if len(said) > 3 else "")
    src = BatchSource(
        describe=f"{data} (OLMo-core NumpyFSLDataset, {n} instances, {ipb} a batch, seed {seed}; token files: {shown})",
        get=get,
        labels_shifted=True,
        rebuilt=True,
    )
    return src


def _token_file(recorded: str, root: Path, run_dir: Path) -> tuple[Path, str]:
    """Where one of the run's `dataset.paths` is now, and how it was found: under `--data`
    (`root`) first, the path the user gave; else as the run recorded it, relative to its
    launch directory (`resolve_recorded`)."""
    rel = Path(recorded)
    if not rel.is_absolute():
        for f, how in (
            (root / rel, f"{recorded} under --data"),
            (root / rel.name, f"{rel.name} in --data"),
        ):
            if f.is_file():
                return f, how
    elif (root / rel.name).is_file():
        return root / rel.name, f"{rel.name} in --data"
    found = resolve_recorded(recorded, run_dir, root, holds=Path.is_file)
    if found is None:
        raise BatchError(
            f"--data {root}: no token file {recorded} (the run's dataset.paths), neither under --data nor against the run directory "
            f"{run_dir}, its parents or --data's parent"
        )
    return found.path, found.how
