"""Plain `.safetensors` files, read lazily from their header and memory-mapped per tensor."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.formats.base import Checkpoint, Completeness, TensorMeta, file_problem, rel_name

__all__ = ["SafetensorsFile", "open_safetensors", "safetensors_problem", "safetensors_completeness"]

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit on header size


class SafetensorsFile:
    """Header of one safetensors file plus lazy, file-backed tensor access.

    Why not `safe_open`: we need each tensor as a clean private file mapping so that
    streamed pages can be released again (see `release_pages`), and a header that is
    validated against the file size before any data is touched.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpoint(f"{path}: truncated safetensors file (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CorruptCheckpoint(
                    f"{path}: truncated or corrupt safetensors header (length {n}, file {size} bytes)"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpoint(
                f"{path}: safetensors header is not valid JSON ({e.msg if hasattr(e, 'msg') else e})"
            ) from None
        if not isinstance(header, dict):
            raise CorruptCheckpoint(f"{path}: safetensors header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.entries: dict[str, tuple[TensorMeta, int, int]] = {}
        for name, info in header.items():
            try:
                dtype = _DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                lo, hi = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpoint(
                    f"{path}: tensor {name!r} has a malformed or unsupported header entry"
                ) from None
            meta = TensorMeta(shape, dtype)
            nbytes = meta.numel * torch.empty((), dtype=dtype).element_size()
            if (
                hi - lo != nbytes
                or lo < 0
                or self.data_start + hi > size
                or any(s < 0 for s in shape)
            ):
                raise CorruptCheckpoint(
                    f"{path}: tensor {name!r} lies outside the file or disagrees with its shape (truncated file?)"
                )
            self.entries[name] = (meta, lo, hi)
        self._mm: np.memmap | None = None

    def _map(self) -> np.memmap:
        if self._mm is None:
            # mode "c": private copy-on-write mapping; the file is never written.
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="c")
        return self._mm

    def tensor(self, name: str) -> torch.Tensor:
        meta, lo, hi = self.entries[name]
        if meta.numel == 0:
            return torch.empty(meta.shape, dtype=meta.dtype)
        raw = torch.from_numpy(self._map()[self.data_start + lo : self.data_start + hi])
        return raw.view(meta.dtype).view(meta.shape)

    def close(self) -> None:
        if self._mm is not None:
            mm = getattr(self._mm, "_mmap", None)
            self._mm = None
            if mm is not None:
                # Tensors still alive hold the mapping; the GC closes it then.
                with contextlib.suppress(BufferError):
                    mm.close()


def add_file(ckpt: Checkpoint, st: SafetensorsFile, only: set[str] | None = None) -> None:
    """Expose the tensors of one safetensors file through a Checkpoint view."""
    for name, (meta, _, _) in st.entries.items():
        if only is not None and name not in only:
            continue
        ckpt.add_tensor(name, meta, _getter(st, name))
    ckpt._closers.append(st.close)


def _getter(st: SafetensorsFile, name: str) -> Any:
    return lambda: st.tensor(name)


def open_safetensors(path: Path) -> Checkpoint:
    """A plain `.safetensors` file: weights only, no optimizer state."""
    st = SafetensorsFile(path)
    ckpt = Checkpoint(path=path, format="safetensors", file_backed=True)
    add_file(ckpt, st)
    step = st.metadata.get("step") or st.metadata.get("global_step")
    if step is not None and str(step).isdigit():
        ckpt.scalars["global_step"] = int(step)
    return ckpt


def safetensors_problem(
    path: Path, root: Path | None = None, names: set[str] | None = None
) -> str | None:
    """What keeps a safetensors file from being whole, or None; reads its header only.

    The header (8-byte length, then JSON) places every tensor at byte offsets; a file
    cut short ends before the last of them. `names`: tensors an index places in it.
    """
    bad = file_problem(path, root)
    if bad is not None:
        return bad
    name = rel_name(path, root)
    try:
        st = SafetensorsFile(path)
    except CorruptCheckpoint as e:
        return f"{name}: {str(e).removeprefix(f'{path}: ')}"
    if names:
        missing = sorted(names - set(st.entries))
        if missing:
            return f"{name}: lacks {missing[0]}{f' and {len(missing) - 1} more' if len(missing) > 1 else ''} that the index places there"
    return None


def safetensors_completeness(path: Path) -> Completeness:
    """One safetensors file: its header and every tensor it places within the file."""
    bad = safetensors_problem(path, path.parent)
    return Completeness(
        "safetensors",
        "a safetensors file: its header, and every tensor it places, within the file",
        (bad,) if bad else (),
    )
