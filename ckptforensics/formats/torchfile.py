"""Safe loading of torch.save files: weights-only, memory-mapped, errors made readable."""

from __future__ import annotations

import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint, UnsafeCheckpoint
from ckptforensics.formats import integrity
from ckptforensics.formats.base import Completeness, file_problem, rel_name
from ckptforensics.formats.inert import allowed_names, safe_load_globals

__all__ = ["load_torch_file", "is_torch_zip", "torch_file_problem", "torch_file_completeness"]

log = logging.getLogger(__name__)


def is_torch_zip(path: Path) -> bool:
    """True for the zip container torch.save has written since torch 1.6."""
    try:
        return zipfile.is_zipfile(path)
    except OSError:
        return False


def torch_file_problem(path: Path, root: Path | None = None) -> str | None:
    """What keeps a torch.save file from being whole, or None; reads only its end.

    torch.save (since torch 1.6) writes a zip whose central directory and end record come
    last, after every tensor: a file cut short anywhere has lost them. The directory's
    members must also lie before it, and `data.pkl` must be one of them. A legacy
    (pre-zip) file has no end record to check and passes on its size alone.
    """
    bad = file_problem(path, root)
    if bad is not None:
        return bad
    name = rel_name(path, root)
    with path.open("rb") as f:
        head = f.read(2)
    if head == b"\x80\x02" or head[:1] == b"\x80":
        return None  # legacy torch.save: a pickle stream, no end record
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            start_dir = int(getattr(z, "start_dir", 0))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return f"{name}: truncated or not a torch file (no zip end record)"
    if not any(i.filename.endswith("data.pkl") for i in infos):
        return f"{name}: truncated or not a torch file (no data.pkl in its zip directory)"
    end = max((i.header_offset + i.compress_size for i in infos), default=0)
    if start_dir and end > start_dir:
        return f"{name}: truncated or not a torch file (a member runs past the zip directory)"
    return None


def torch_file_completeness(path: Path, format: str = "torch") -> Completeness:
    """A one-file torch.save checkpoint (nanoGPT, Lightning `.ckpt`, LitGPT, plain state
    dicts): whole when its zip end record and directory are."""
    bad = torch_file_problem(path, path.parent)
    rule = "a torch.save file: its zip end record and directory intact, every member before them"
    return Completeness(format, rule, (bad,) if bad else ())


def load_torch_file(path: Path) -> tuple[Any, bool]:
    """Load a torch.save file without executing pickled code.

    Uses torch's weights-only unpickler. Classes that training frameworks pickle into
    otherwise plain files (Lightning's AttributeDict, argparse.Namespace, ...) are
    admitted only as inert stand-ins from `inert.py`; anything else is refused. The zip's
    small members are checked against their CRC-32 now, each storage's as a diff streams
    it (`integrity.track`).

    Args:
        path: the file.

    Returns:
        (object, memory_mapped): tensors are mmap-backed when memory_mapped is True.

    Raises:
        UnsafeCheckpoint: the pickle asks for a global outside the allowlist.
        DamagedCheckpoint: a member's bytes fail the CRC-32 the zip records for it.
        CorruptCheckpoint: truncated or not a torch file.
    """
    mm = is_torch_zip(path)
    try:
        with torch.serialization.safe_globals(safe_load_globals()):
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mm)
    except pickle.UnpicklingError as e:
        msg = str(e)
        _damaged(path, mm)  # a garbled pickle asks for anything: damage, not a threat
        if "Weights only load failed" in msg or "Unsupported global" in msg or "GLOBAL" in msg:
            bad = _first_unsafe_global(path) or _global_from_message(msg)
            raise UnsafeCheckpoint(
                f"{path}: refused to unpickle {bad or 'a global'} (code execution risk); "
                "nothing was run. Only tensors, containers and known inert records are read"
            ) from None
        raise CorruptCheckpoint(f"{path}: not a readable torch file ({_short(msg)})") from None
    except (
        RuntimeError,
        EOFError,
        ValueError,
        OSError,
        zipfile.BadZipFile,
        KeyError,
        AttributeError,
        TypeError,
    ) as e:
        _damaged(path, mm)
        raise CorruptCheckpoint(
            f"{path}: truncated or not a torch file ({_short(str(e))})"
        ) from None
    if mm:
        integrity.track(path, obj)
    return obj, mm


def _damaged(path: Path, is_zip: bool) -> None:
    """A zip torch would not read: if its pickle or another small member fails its CRC-32,
    the file is damaged, not cut short; say so (DamagedCheckpoint)."""
    if is_zip:
        integrity.track(path, None)


def _first_unsafe_global(path: Path) -> str | None:
    try:
        bad = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # the file may be too mangled to scan; the refusal stands anyway
        return None
    rest = [g for g in bad if g not in allowed_names()]
    return rest[0] if rest else None


def _global_from_message(msg: str) -> str | None:
    m = re.search(r"but got <class '([\w.]+)'>", msg)
    if m:  # BUILD of a class outside the allowlist (a numpy object array's dtype, ...)
        return m.group(1) + (
            " (a numpy object array: Python objects, not data)"
            if m.group(1).endswith("ObjectDType")
            else ""
        )
    for line in msg.splitlines():
        if "Unsupported global" in line:
            return line.split("GLOBAL", 1)[-1].strip().split(" ")[0]
    return None


def _short(msg: str) -> str:
    first = msg.strip().splitlines()[0] if msg.strip() else "unknown error"
    return first[:160]
