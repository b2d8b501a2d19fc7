"""Batch sources for replay: a batch file, a batch log (HDF5, one batch per step), or a callable."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.core.callables import load_callable
from ckptforensics.core.errors import ForensicsError
from ckptforensics.formats.segments import list_segments, pad_rows

__all__ = ["BatchSource", "open_batches", "BatchError"]

_KEYS = ("input_ids", "attention_mask", "labels")


class BatchError(ForensicsError):
    """A batch source that is missing, malformed, or lacks a requested step."""


@dataclass
class BatchSource:
    """Batches by training step, plus per-step training state when the log recorded it.

    Attributes:
        describe: what was opened (for the report).
        steps: the steps available (None: any step, e.g. a callable or a single file).
        lr: step -> LR per param group, when the batch log holds `/lr`.
        loss_scale: step -> loss scale, when recorded.
        grad_clip: the clip norm the batch log states, if any.
        sample_ids: step -> dataset index of each row, when recorded.
        labels_shifted: what the source declares of its `/labels`: next-token targets
            (True: Megatron, OLMo-core, LitGPT, nanoGPT, torchtitan: `labels[t]` is the token
            after `t`), the inputs (False: HF, shifted inside the loss), or nothing (None).
            The replay measures the convention from the data (`conventions.settle_labels`);
            a declaration the data contradicts is an error.
        micro_batch_size: rows per forward/backward when the step accumulated gradients
            (the `micro_batch_size` attribute), for losses averaged per micro-batch.
        rebuilt: the batches were rebuilt from the run's data pipeline rather than read
            from what the run recorded: checked against the log before they are trusted.
        fingerprint: what identifies the dataset the sample ids index, when recorded.
        ids_only: the log kept sample ids, not tokens (the recorder's `tokens=False`): the
            rows come from the dataset (`with_rows`).
        collator: the collator that builds rebuilt batches (HF `--data`), by name.
    """

    describe: str
    get: Callable[[int], dict[str, torch.Tensor]]
    steps: list[int] | None = None
    lr: dict[int, list[float]] = field(default_factory=dict)
    loss_scale: dict[int, float] = field(default_factory=dict)
    grad_clip: float | None = None
    sample_ids: dict[int, list[int]] = field(default_factory=dict)
    labels_shifted: bool | None = None
    micro_batch_size: int | None = None
    rebuilt: bool = False
    fingerprint: str | None = None
    ids_only: bool = False
    collator: str | None = None

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        if self.steps is not None and step not in self.steps:
            shown = f"{self.steps[0]}..{self.steps[-1]}" if self.steps else "none"
            raise BatchError(
                f"{self.describe}: no batch for step {step} (steps {shown}); record the window's batches"
            )
        out = self.get(step)
        if "input_ids" not in out:
            raise BatchError(f"{self.describe}: batch of step {step} has no input_ids")
        ids = out["input_ids"]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise BatchError(
                f"{self.describe}: input_ids of step {step} must be integer [B, T], got {ids.dtype} {list(ids.shape)}"
            )
        return {k: v.long() if k != "attention_mask" else v for k, v in out.items()}


def open_batches(spec: str) -> BatchSource:
    """`--batch SPEC`: a .h5 batch log, a .pt/.safetensors/.npz/.h5 batch, or module:function."""
    path = Path(spec)
    if path.is_dir():
        return _recorder_dir(path)
    if path.is_file():
        if path.suffix in (".h5", ".hdf5"):
            return _h5(path)
        return _single(path)
    if ":" in spec and not path.exists():
        fn = load_callable(spec, "--batch")
        return BatchSource(
            describe=spec, get=lambda s: {k: torch.as_tensor(v) for k, v in fn(s).items()}
        )
    raise BatchError(f"--batch {spec}: no such file, and not a module:function")


def _single(path: Path) -> BatchSource:
    """One batch for any step (the suspect batch saved on its own)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            data = load_file(str(path))
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                data = {k: torch.from_numpy(z[k]) for k in z.files}
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any decoding failure of an untrusted batch file
        raise BatchError(
            f"{path}: not a readable batch file ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    if not isinstance(data, dict):
        raise BatchError(f"{path}: expected a dict of tensors with input_ids")
    batch = {k: v for k, v in data.items() if k in _KEYS and isinstance(v, torch.Tensor)}
    return BatchSource(describe=str(path), get=lambda s: batch)


def _open_h5(path: Path) -> object:
    """Open an HDF5 batch log; a flight-recorder segment whose writer was killed is still
    marked open for writing, which a plain open refuses: it is read in SWMR mode, whose
    file is consistent up to its last flush (formats/segments.py)."""
    import h5py

    try:
        return h5py.File(path, "r")
    except (OSError, RuntimeError, ValueError) as e:
        try:
            return h5py.File(path, "r", swmr=True)
        except (
            OSError,
            RuntimeError,
            ValueError,
        ):  # h5py raises RuntimeError on a mangled superblock
            raise BatchError(
                f"{path}: not a readable HDF5 file ({str(e).splitlines()[0][:160]})"
            ) from None


def _h5(path: Path) -> BatchSource:
    """A batch log (or one batch) in HDF5; any corruption h5py meets while the log's index
    is read (a dataset header, an attribute) is the log's fault, said in one line."""
    try:
        return _h5_source(path)
    except ForensicsError:
        raise
    except (OSError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        raise BatchError(
            f"{path}: malformed batch log ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
        ) from None


def _h5_source(path: Path) -> BatchSource:
    h = _open_h5(path)
    ids_only = (
        "input_ids" not in h and "sample_id" in h and "step" in h
    )  # the recorder's tokens=False
    if "input_ids" not in h and not ids_only:
        raise BatchError(f"{path}: HDF5 without /input_ids")
    try:
        ids = None if ids_only else h["input_ids"]
        np.asarray(h["step"]) if "step" in h else None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise BatchError(
            f"{path}: malformed batch log ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        ) from None
    if "step" not in h:
        # A single batch stored as HDF5 datasets [B, T].
        batch = {k: torch.from_numpy(np.asarray(h[k])) for k in _KEYS if k in h}
        return BatchSource(describe=str(path), get=lambda s: batch)
    steps = [int(s) for s in np.asarray(h["step"])]
    if "recorder" in h.attrs:  # a flight-recorder segment: /step is flushed last
        steps = steps[
            : min(h[k].shape[0] for k in (*_KEYS, "sample_id", "rows", "seq_len") if k in h)
        ]
    if ids is not None and (ids.ndim != 3 or ids.shape[0] != len(steps)):
        raise BatchError(f"{path}: /input_ids must be [S, B, T] with S = len(/step)")
    row = {s: i for i, s in enumerate(steps)}
    # Steps narrower or smaller than the segment's widest: /rows and /seq_len say how much is theirs.
    rows_ = np.asarray(h["rows"]) if "rows" in h else None
    seq_ = np.asarray(h["seq_len"]) if "seq_len" in h else None

    def get(step: int) -> dict[str, torch.Tensor]:
        if ids_only:
            raise BatchError(
                f"{path}: the log keeps the sample ids of step {step}, not its tokens: pass --data (the dataset they index)"
            )
        i = row[step]
        b = int(rows_[i]) if rows_ is not None else None
        t = int(seq_[i]) if seq_ is not None else None
        try:
            return {k: torch.from_numpy(np.asarray(h[k][i][:b, :t])) for k in _KEYS if k in h}
        except (OSError, ValueError, TypeError, IndexError, KeyError) as e:
            raise BatchError(
                f"{path}: batch of step {step} is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            ) from None

    src = BatchSource(describe=str(path), get=get, steps=steps, ids_only=ids_only)
    if "lr" in h:
        lr = np.asarray(h["lr"], dtype=np.float64)
        src.lr = {s: [float(x) for x in np.atleast_1d(lr[i])] for s, i in row.items()}
    if "loss_scale" in h:
        ls = np.asarray(h["loss_scale"], dtype=np.float64)
        src.loss_scale = {
            s: float(ls[i]) for s, i in row.items() if math.isfinite(ls[i])
        }  # NaN: no scaler that step
    if "sample_id" in h:
        sid = np.asarray(h["sample_id"])
        src.sample_ids = {
            s: [int(x) for x in sid[i][: None if rows_ is None else int(rows_[i])]]
            for s, i in row.items()
        }
    declared = h.attrs.get("labels_shifted")
    src.labels_shifted = None if declared is None else bool(declared)
    mbs = h.attrs.get("micro_batch_size")
    src.micro_batch_size = int(mbs) if mbs is not None and int(mbs) > 0 else None
    clip = h.attrs.get("grad_clip")
    if clip is not None and math.isfinite(float(clip)):
        src.grad_clip = float(clip)
    fp = h.attrs.get("dataset_fingerprint")
    src.fingerprint = str(fp) if fp is not None else None
    return src


def with_rows(src: BatchSource, dataset: Any, describe: str) -> BatchSource:
    """An ids-only log joined with the dataset its ids index: each step's rows are the
    dataset's rows at the recorded ids (padded as the recorder pads). Checked like rebuilt
    batches (the first replayed step's loss against the log), and refused outright when the
    dataset's fingerprint is not the recorded one."""
    got = getattr(dataset, "_fingerprint", None)
    if src.fingerprint is not None and got is not None and str(got) != src.fingerprint:
        raise BatchError(
            f"{describe}: dataset fingerprint {got} is not the recorded {src.fingerprint}: not the data the run read"
        )

    def get(step: int) -> dict[str, torch.Tensor]:
        ids = src.sample_ids.get(step)
        if ids is None:
            raise BatchError(f"{src.describe}: no sample ids for step {step}")
        try:
            rows = [dataset[i] for i in ids]
        except (IndexError, KeyError) as e:
            raise BatchError(
                f"{describe}: sample id of step {step} not in the dataset ({e})"
            ) from None
        out: dict[str, torch.Tensor] = {}
        for k in _KEYS:
            if all(k in r for r in rows):
                parts = [torch.as_tensor(r[k]).reshape(1, -1) for r in rows]
                width = max(x.shape[1] for x in parts)
                out[k] = torch.cat([pad_rows(x, width, k) for x in parts])
        return out

    joined = BatchSource(describe=f"{src.describe} + {describe}", get=get, steps=src.steps, lr=src.lr, loss_scale=src.loss_scale,
                         grad_clip=src.grad_clip, sample_ids=src.sample_ids, micro_batch_size=src.micro_batch_size, rebuilt=True)  # fmt: skip
    return joined


def _recorder_dir(root: Path) -> BatchSource:
    """A flight recorder's directory (ckptforensics.record): its segments, one per checkpoint
    interval and rank, merged. A step's global batch is the ranks' rows in rank order (the
    contiguous split of DDP's and FSDP's samplers); a step is there when every rank has it."""

    segs = list_segments(root)
    if not segs:
        raise BatchError(
            f"{root}: a directory without flight-recorder segments (segment-*-rank*.h5)"
        )
    ranks = sorted({r for _, r, _ in segs})
    per_rank: dict[int, list[BatchSource]] = {
        r: [_h5(p) for _, rr, p in segs if rr == r] for r in ranks
    }
    owner: dict[int, dict[int, BatchSource]] = {
        r: {s: src for src in srcs for s in src.steps or []} for r, srcs in per_rank.items()
    }
    steps = sorted(set.intersection(*(set(o) for o in owner.values())))

    def get(step: int) -> dict[str, torch.Tensor]:
        parts = [owner[r][step].get(step) for r in ranks]
        if len(parts) == 1:
            return parts[0]
        width = max(p["input_ids"].shape[1] for p in parts)
        return {
            k: torch.cat([pad_rows(p[k], width, k) for p in parts])
            for k in parts[0]
            if all(k in p for p in parts)
        }

    first = per_rank[ranks[0]][0]
    src = BatchSource(
        describe=f"{root} (flight recorder, {len(ranks)} rank{'s' if len(ranks) > 1 else ''})",
        get=get,
        steps=steps,
    )
    src.ids_only, src.fingerprint = first.ids_only, first.fingerprint
    for s in steps:
        lead = owner[ranks[0]][s]
        if s in lead.lr:
            src.lr[s] = lead.lr[s]
        if s in lead.loss_scale:
            src.loss_scale[s] = lead.loss_scale[s]
        ids = [owner[r][s].sample_ids.get(s) for r in ranks]
        if all(x is not None for x in ids):
            src.sample_ids[s] = [i for x in ids for i in x]  # type: ignore[union-attr]
    src.grad_clip, src.labels_shifted = first.grad_clip, first.labels_shifted
    src.micro_batch_size = first.micro_batch_size
    return src
