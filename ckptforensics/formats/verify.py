"""`inspect --verify`: every file of a checkpoint read whole against the checksums it carries.

torch.save files are zips whose members each carry a CRC-32, and torch's DCP writer saves each
chunk of a `.distcp` file as such a zip: every member is read once, in file order, and
compared. safetensors, JSON and DCP's metadata carry no checksum: they are named as such,
so that a report never implies their bytes were checked when only their structure was.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import ForensicsError
from ckptforensics.formats.base import rel_name
from ckptforensics.formats.dcp import read_metadata
from ckptforensics.formats.integrity import (
    Member,
    damage_message,
    file_crc,
    storages_to_members,
    zip_members,
)
from ckptforensics.formats.torchfile import load_torch_file

__all__ = ["FileCheck", "Verification", "verify_files", "check_zip", "check_blobs", "member_labels"]

_BLOCK = 8 << 20  # bytes per read of a compressed member


def _zip_crc(path: Path, m: Member) -> int:
    """A compressed member's CRC-32, over its data as zipfile inflates it (not torch.save's:
    its members are stored); a member that does not inflate cannot match."""
    crc = 0
    try:
        with zipfile.ZipFile(path) as z, z.open(m.name) as f:
            while block := f.read(_BLOCK):
                crc = zlib.crc32(block, crc)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError):
        return crc if crc != m.crc else crc ^ 0xFFFFFFFF
    return crc


@dataclass(frozen=True, slots=True)
class FileCheck:
    """One file of a checkpoint, verified whole.

    Attributes:
        name: the file, relative to the checkpoint.
        kind: 'zip' (every member's CRC-32 checked) or the name of a format that carries
            no checksum ('safetensors', 'json', ...).
        members: zip members checked (0 for the rest).
        bytes: the file's size.
        damaged: one line per member that fails its CRC-32 (names the member and tensor).
    """

    name: str
    kind: str
    members: int = 0
    bytes: int = 0
    damaged: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Verification:
    """A whole checkpoint verified: each file's `FileCheck`."""

    files: tuple[FileCheck, ...]

    @property
    def damaged(self) -> list[str]:
        return [d for f in self.files for d in f.damaged]

    def summary(self) -> str:
        """One line: what was checked and how, and what carries no checksum."""
        zips = [f for f in self.files if f.kind == "zip"]
        parts = []
        if zips:
            n = sum(f.members for f in zips)
            size = sum(f.bytes for f in zips) / (1 << 20)
            bad = len(self.damaged)
            parts.append(
                f"{n - bad} of {n} zip members' CRC-32 match in {len(zips)} file{'s' * (len(zips) > 1)} "
                f"({size:.1f} MiB read)"
            )
        plain: dict[str, list[str]] = {}
        for f in self.files:
            if f.kind != "zip":
                plain.setdefault(f.kind, []).append(f.name)
        for kind, names in plain.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{shown}: {kind} carries no checksum, only its structure was checked")
        return "; ".join(parts) if parts else "no files"


def check_zip(path: Path, labels: Mapping[str, str] | None = None) -> tuple[int, list[str]]:
    """Every member of a zip file against its CRC-32, read once, in file order.

    Args:
        path: the file.
        labels: member name -> the tensor it holds (named in what is damaged).

    Returns:
        (members checked, one damage line per member that fails).
    """
    members = sorted(zip_members(path), key=lambda m: m.offset)
    bad = []
    with path.open("rb") as f:
        for m in members:
            got = file_crc(f, m) if m.stored else _zip_crc(path, m)
            if got != m.crc:
                bad.append(damage_message(path, m, (labels or {}).get(m.name), got))
    return len(members), bad


def check_blobs(path: Path, blobs: list[tuple[int, int, str]]) -> tuple[int, list[str]]:
    """The zips laid end to end in one file (DCP's `.distcp`: each chunk a torch.save blob),
    each member against its CRC-32.

    Args:
        path: the file.
        blobs: (offset, length, what it holds) of each zip in it.

    Returns:
        (members checked, one damage line per member that fails or blob that is no zip).
    """
    n, bad = 0, []
    with path.open("rb") as f:
        for start, length, what in sorted(blobs):
            try:
                members = zip_members(path, start, length)
            except (zipfile.BadZipFile, OSError, ValueError, KeyError):
                bad.append(
                    f"{path}: damaged file: the chunk of {what} at byte {start} is not a whole zip"
                )
                continue
            for m in members:
                got = file_crc(f, m)
                if got != m.crc:
                    bad.append(damage_message(path, m, f"{what}, chunk at byte {start}", got))
            n += len(members)
    return n, bad


# Files whose format carries no checksum of its own, by suffix: what `verify` says of them.
_NO_CHECKSUM = {
    ".safetensors": "safetensors",
    ".json": "JSON",
    ".distcp": "DCP (.distcp) written raw",
    ".metadata": "DCP metadata (a pickle)",
    ".yaml": "YAML",
    ".txt": "text",
}


def verify_files(target: Path) -> Verification:
    """Every file of the checkpoint `target` (a file, or a directory and all below it) read
    whole against the checksums it carries (see the module's docstring)."""
    root = target if target.is_dir() else target.parent
    files = sorted(f for f in target.rglob("*") if f.is_file()) if target.is_dir() else [target]
    return Verification(tuple(_verify_file(f, root) for f in files))


def _verify_file(f: Path, root: Path) -> FileCheck:
    name, size = rel_name(f, root), f.stat().st_size
    blobs = _dcp_blobs(f) if f.suffix == ".distcp" else None
    if blobs:  # torch's DCP writer saves each chunk as a torch.save zip, end to end
        n, bad = check_blobs(f, blobs)
        return FileCheck(name, "zip", n, size, tuple(bad))
    if f.suffix != ".distcp" and zipfile.is_zipfile(f):
        n, bad = check_zip(f, _labels(f))
        return FileCheck(name, "zip", n, size, tuple(bad))
    suffix = f.suffix or f.name  # `.metadata` is all suffix
    kind = _NO_CHECKSUM.get(suffix, f"{suffix.lstrip('.') or 'plain'} file")
    return FileCheck(name, kind, 0, size)


def _labels(f: Path) -> dict[str, str]:
    """Zip member -> the tensor it holds, from a memory-mapped load (no data read); {} when
    the file does not load (its damage is then named by member alone)."""
    try:
        obj, mapped = load_torch_file(f)
    except ForensicsError:
        return {}
    return member_labels(f, obj) if mapped else {}


def _dcp_blobs(f: Path) -> list[tuple[int, int, str]] | None:
    """(offset, length, what) of each chunk its DCP metadata places in `f`; None when the
    metadata does not read."""
    try:
        md = read_metadata(f.parent)
    except ForensicsError:
        return None
    out = []
    for idx, info in md.storage_data.items():
        if (f.parent / str(info.relative_path)) == f:
            where = list(getattr(idx, "offset", None) or ())
            what = f"{getattr(idx, 'fqn', idx)}" + (f" at {where}" if any(where) else "")
            out.append((int(info.offset), int(info.length), what))
    return out


def member_labels(path: Path, obj: Any) -> dict[str, str]:
    """Member name -> the key path of the first tensor on its storage (a file loaded
    memory-mapped); {} when the storages do not map onto the members."""
    try:
        mapped = storages_to_members(zip_members(path), obj)
    except (zipfile.BadZipFile, OSError, ValueError):
        return {}
    return {m.name: key for m, key, _ in (mapped or {}).values()}
