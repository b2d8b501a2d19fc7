"""Whether a torch.save file's bytes are those torch.save wrote: each zip member's CRC-32,
checked over the bytes a read streams anyway (`formats.verify` checks whole files).

A bit rotted on disk or a block garbled in a copy leaves a file that is complete by every
size and end record, and whose tensors read as numbers: a diff would take the damage for a
training incident. torch.save writes a zip whose members (one per storage, stored
uncompressed) each carry a CRC-32. Loaded memory-mapped, a storage *is* its member's bytes:
`track` maps each storage of a loaded file to its member, and `consume`, called on every
chunk the diff streams, folds the chunk into its member's running CRC while it is in cache
(about 20 GB/s with the fused kernel's carry-less multiplies, no second read of the file).
A member whose bytes fail its CRC raises `DamagedCheckpoint`, naming the file, the member
and the tensor: a storage fault, never a training cause.
"""

from __future__ import annotations

import ctypes
import io
import logging
import struct
import zipfile
import zlib
from bisect import bisect_right, insort
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import ref

import torch

from ckptforensics.core import fused
from ckptforensics.core.errors import DamagedCheckpoint

__all__ = ["Member", "zip_members", "crc32_at", "crc32_combine", "file_crc", "damage_message"]
__all__ += ["storages_to_members", "track", "consume", "settle"]

log = logging.getLogger(__name__)

_LOCAL, _BLOCK = b"PK\x03\x04", 8 << 20  # _BLOCK: bytes per read of a whole member
# A member read in part is finished at the end if what is left is at most this (or a quarter).
_GAP_BYTES, _SMALL = 16 << 20, 64 << 10  # _SMALL: untouched members `settle` checks whole


@dataclass(frozen=True, slots=True)
class Member:
    """One zip member.

    Attributes:
        name: its name in the zip ('step_30/data/7').
        offset: where its data starts in the file, in bytes (after its local header).
        size: bytes of data as stored.
        crc: the CRC-32 the zip's directory records for it.
        stored: kept uncompressed (torch.save's members all are): its bytes on disk are
            the data the CRC is of.
    """

    name: str
    offset: int
    size: int
    crc: int
    stored: bool


def zip_members(path: Path, start: int = 0, length: int | None = None) -> list[Member]:
    """Every member of a zip file (or of the zip at bytes [start, start + length) of it: a
    DCP chunk), from its central directory and local headers; offsets are in the file.

    Raises:
        zipfile.BadZipFile, OSError: not a readable zip.
    """
    out = []
    with path.open("rb") as f:
        size = f.seek(0, io.SEEK_END) - start if length is None else length
        with zipfile.ZipFile(_Span(f, start, size)) as z:
            infos = z.infolist()
        for i in infos:
            f.seek(start + i.header_offset)
            head = f.read(30)
            if len(head) < 30 or head[:4] != _LOCAL:
                raise zipfile.BadZipFile(f"no local header for {i.filename}")
            n, m = struct.unpack("<HH", head[26:30])
            out.append(
                Member(
                    name=i.filename,
                    offset=start + i.header_offset + 30 + n + m,
                    size=i.compress_size,
                    crc=i.CRC,
                    stored=i.compress_type == zipfile.ZIP_STORED,
                )
            )
    return out


class _Span(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a file of their own (for zipfile)."""

    def __init__(self, f: Any, start: int, size: int) -> None:
        self.f, self.start, self.size, self.pos = f, start, size, 0

    def seekable(self) -> bool:
        return True

    readable = seekable

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.size - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n]) if n else 0
        self.pos += got
        return got


def crc32_at(address: int, n: int, crc: int = 0) -> int:
    """The zip CRC-32 of the `n` bytes at `address`, continuing `crc`: the fused kernel's
    folding where the CPU has carry-less multiplies, else zlib's."""
    if n <= 0:
        return crc
    k = fused.load()
    got = k.crc32(address, n, crc) if k is not None else None
    if got is not None:
        return got
    return zlib.crc32((ctypes.c_char * n).from_address(address), crc)


# zlib's crc32_combine (1.2.12 and later), which Python's zlib does not expose: products of
# polynomials modulo the CRC's, bit-reflected as the CRC is.
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    t, p = [], 1 << 30  # x^1
    for _ in range(32):
        t.append(p)
        p = _multmodp(p, p)
    return t


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = CRC(A), crc2 = CRC(B) and len(B) (zlib's algorithm)."""
    p, k, n = 1 << 31, 3, len2  # x^(8 len2) = x^(len2 2^3)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


# ------------------------------------------------------------------ checks as a read streams
class _Tracked:
    """One member's storage in memory, and the runs of its bytes read so far:
    start -> [end, CRC of bytes start..end)."""

    __slots__ = ("path", "member", "label", "storage", "ptr", "runs", "starts", "covered")

    def __init__(self, path: Path, member: Member, label: str, storage: Any) -> None:
        self.path, self.member, self.label = path, member, label
        self.ptr = storage.data_ptr()
        self.storage = ref(storage, self._gone)
        self.runs: dict[int, list[int]] = {}
        self.starts: list[int] = []
        self.covered = 0

    def _gone(self, _: Any) -> None:  # the storage was freed: its address may be reused
        if _BY_PTR.get(self.ptr) is self:
            del _BY_PTR[self.ptr]

    def add(self, lo: int, n: int, address: int) -> None:
        """Bytes [lo, lo + n) of the member, at `address`, read by the diff."""
        hi = lo + n
        i = bisect_right(self.starts, lo)
        left = self.starts[i - 1] if i else None
        if left is not None and self.runs[left][0] > lo:
            return  # read before (the same file on both sides of a diff, a tied tensor)
        if i < len(self.starts) and self.starts[i] < hi:
            return  # overlaps a later run: left to the end's check
        if left is not None and self.runs[left][0] == lo:
            run = self.runs[left]
            run[0], run[1] = hi, crc32_at(address, n, run[1])
        else:
            left = lo
            self.runs[lo] = [hi, crc32_at(address, n)]
            insort(self.starts, lo)
        nxt = self.runs.pop(hi, None)  # a run read earlier that starts where this one ends
        if nxt is not None:
            self.starts.remove(hi)
            run = self.runs[left]
            run[0], run[1] = nxt[0], crc32_combine(run[1], nxt[1], nxt[0] - hi)
        self.covered += n
        if self.covered >= self.member.size:
            self.finish()

    def finish(self) -> None:
        """Compare the whole member's CRC with the zip's; on a mismatch, read the member
        again from the file (memory a process wrote into is not the file's fault) and raise
        DamagedCheckpoint if the file's own bytes fail it too."""
        _BY_PTR.pop(self.ptr, None)
        end, got = self.runs[0]  # one run by now, from 0: runs merge as they meet
        if end == self.member.size and got != self.member.crc:
            with self.path.open("rb") as f:
                got = file_crc(f, self.member)
            if got != self.member.crc:
                raise DamagedCheckpoint(damage_message(self.path, self.member, self.label, got))
            log.debug("%s: %s changed in memory, not on disk", self.path, self.member.name)

    def fill_gaps(self) -> bool:
        """Read what the diff did not (when little is left) and finish; False if left
        unchecked. Raises DamagedCheckpoint as `finish`."""
        st = self.storage()
        if st is None or self.member.size - self.covered > max(_GAP_BYTES, self.member.size // 4):
            return False
        gaps, at = [], 0
        for s in self.starts:
            if s > at:
                gaps.append((at, s - at))
            at = self.runs[s][0]
        if at < self.member.size:
            gaps.append((at, self.member.size - at))
        base = st.data_ptr()
        for lo, n in gaps:
            self.add(lo, n, base + lo)
        return True


# storage address -> its member; an entry leaves when its storage is freed.
_BY_PTR: dict[int, _Tracked] = {}


def damage_message(path: Path, member: Member, label: str | None, got: int) -> str:
    """The one line naming a damaged file: the file, the member, the tensor, the fix."""
    what = f"zip member {member.name}" + (f" (tensor {label})" if label else "")
    return (
        f"{path}: damaged file: {what} fails its CRC-32 (recorded {member.crc:08x}, read "
        f"{got:08x}): a storage fault (disk, copy or transfer), not a training problem; "
        "restore the file from a good copy, or pass another checkpoint"
    )


def _tensors(obj: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(key path, tensor) of every tensor in a loaded object, depth first."""
    if isinstance(obj, torch.Tensor):
        yield prefix or "<root>", obj
    elif depth > 16:
        return
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i), depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _tensors(vars(obj), prefix, depth + 1)


def _is_storage_member(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 3 and parts[1] == "data"


def storages_to_members(
    members: list[Member], obj: Any
) -> dict[int, tuple[Member, str, Any]] | None:
    """Storage address -> (its member, the first tensor's key path, the storage) for a file
    loaded memory-mapped, or None when the storages do not map onto the members (not an
    mmap'd load, or a layout this does not know).

    A memory-mapped load maps the whole file once and makes each storage the slice at its
    member's offset: one base address b has every storage at b + its member's offset, with
    its member's size.
    """
    found: dict[int, tuple[str, Any]] = {}
    for key, t in _tensors(obj):
        st = t.untyped_storage()
        if st.nbytes() > 0 and t.device.type == "cpu":
            found.setdefault(st.data_ptr(), (key, st))
    mems = sorted(
        (m for m in members if _is_storage_member(m.name) and m.size > 0 and m.stored),
        key=lambda m: m.offset,
    )
    if not found or not mems:
        return None
    by_offset = {m.offset: m for m in mems}
    first = min(found)
    size = found[first][1].nbytes()
    for cand in [m for m in mems if m.size == size][:16]:
        base = first - cand.offset
        out = {}
        for ptr, (key, st) in found.items():
            m = by_offset.get(ptr - base)
            if m is None or m.size != st.nbytes():
                break
            out[ptr] = (m, key, st)
        else:
            return out
    return None


def track(path: Path, obj: Any) -> None:
    """Check, as they are read, the members behind the storages of a torch.save file just
    loaded memory-mapped (`obj`); its small members (the pickle, byteorder, version) are
    checked now. A file that is not a zip, or not mapped, is left alone.

    Raises:
        DamagedCheckpoint: a small member fails its CRC-32.
    """
    try:
        members = zip_members(path)
    except (zipfile.BadZipFile, OSError, ValueError):
        return
    mapped = storages_to_members(members, obj)
    data = {m for m, _, _ in mapped.values()} if mapped else set()
    small = [m for m in members if m not in data and not _is_storage_member(m.name)]
    if small:
        with path.open("rb") as f:
            for m in small:
                got = file_crc(f, m)
                if got != m.crc:
                    raise DamagedCheckpoint(damage_message(path, m, None, got))
    for ptr, (m, key, st) in (mapped or {}).items():
        _BY_PTR[ptr] = _Tracked(path, m, key, st)


def consume(t: torch.Tensor) -> None:
    """Fold a chunk the diff has just read (a contiguous view of a loaded tensor) into its
    member's running CRC; when the member is whole, compare. Cheap when nothing is tracked.

    Raises:
        DamagedCheckpoint: the member's bytes fail the CRC-32 its zip records.
    """
    if not _BY_PTR or t.device.type != "cpu" or t.numel() == 0:
        return
    st = t.untyped_storage()
    e = _BY_PTR.get(st.data_ptr())
    if e is None or e.storage() is not st or not t.is_contiguous():
        return
    lo = t.data_ptr() - e.ptr
    e.add(lo, t.numel() * t.element_size(), t.data_ptr())


def settle(roots: Sequence[Path] = ()) -> int:
    """At the end of a read of the checkpoints at `roots` (files or directories; all when
    empty): members read in part are finished from memory when what is left is small, and
    small members no chunk touched (Adam's step, a loss scale: read as numbers) are checked
    whole. Returns how many members read in part are left unchecked.

    Raises:
        DamagedCheckpoint: a member fails its CRC-32.
    """
    left = 0
    for e in list(_BY_PTR.values()):
        if roots and not any(e.path == r or r in e.path.parents for r in roots):
            continue
        if (e.covered or e.member.size <= _SMALL) and not e.fill_gaps():
            left += 1
            log.debug("%s: %s read in part: its CRC-32 not checked", e.path, e.member.name)
    return left


def file_crc(f: Any, m: Member) -> int:
    """The CRC-32 of a member's bytes as stored, read from the open file `f`."""
    f.seek(m.offset)
    buf = bytearray(min(_BLOCK, max(m.size, 1)))
    view = memoryview(buf)
    address = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    crc, left = 0, m.size
    while left > 0:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            break  # cut short: the CRC cannot match
        crc = crc32_at(address, n, crc)
        left -= n
    return crc
