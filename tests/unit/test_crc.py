"""The zip CRC-32 behind damaged-file detection: the fused kernel's folding paths against
zlib, zlib's combine, and a member read out of order or in part (a shared flat buffer)."""

from __future__ import annotations

import ctypes
import os
import random
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from ckptforensics.core import fused
from ckptforensics.core.errors import DamagedCheckpoint
from ckptforensics.formats import integrity
from ckptforensics.formats.torchfile import load_torch_file
from ckptforensics.formats.verify import check_zip, member_labels

LENGTHS = [*range(0, 300), 511, 512, 513, 4095, 4096, 65537, (1 << 20) + 48]


@pytest.mark.parametrize("most", [0, 1, 2])
def test_each_kernel_path_is_zlibs_crc32(most: int) -> None:
    k = fused.load()
    if k is None or (most > 0 and k.crc_level < most):
        pytest.skip("no fused kernel, or this CPU has no such path")
    rng = random.Random(most)
    for n in LENGTHS:
        data = os.urandom(n)
        buf = (ctypes.c_char * max(n, 1)).from_buffer_copy(data or b"\0")
        start = rng.getrandbits(32) if n % 3 else 0
        assert k.crc32(ctypes.addressof(buf), n, start, most) == zlib.crc32(data, start), n


def test_combine_is_the_crc_of_the_concatenation() -> None:
    rng = random.Random(0)
    for _ in range(50):
        a, b = os.urandom(rng.randrange(0, 3000)), os.urandom(rng.randrange(0, 3000))
        got = integrity.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert got == zlib.crc32(a + b)


def _saved(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {"w": torch.randn(1000, 64), "v": torch.randn(300)}
    f = tmp_path / "x.pt"
    torch.save(sd, f)
    return f, sd


def _flip(f: Path, member_suffix: str, at: int) -> None:
    (m,) = [m for m in integrity.zip_members(f) if m.name.endswith(member_suffix)]
    raw = bytearray(f.read_bytes())
    raw[m.offset + at] ^= 0x01  # one bit
    f.write_bytes(raw)


def _member(f: Path, obj: dict, key: str) -> str:
    return {v: k for k, v in member_labels(f, obj).items()}[key]


def test_a_member_read_backwards_in_chunks_is_checked(tmp_path: Path) -> None:
    """Chunks fed last first (Megatron's buffers hold parameters in reverse): the runs are
    combined, and one flipped bit anywhere is found once the member is whole."""
    f, _ = _saved(tmp_path)
    obj, _ = load_torch_file(f)
    name = _member(f, obj, "w")
    flat = obj["w"].reshape(-1)
    for lo in range(flat.numel() - 4096, -1, -4096):  # in reverse, all but the first chunk
        integrity.consume(flat[lo : lo + 4096])
    integrity.consume(flat[: flat.numel() % 4096 or 4096])
    assert integrity.settle() == 0  # nothing left over: it finished, and matched
    del obj
    _flip(f, name.split("/", 1)[1], 17)
    obj, _ = load_torch_file(f)
    flat = obj["w"].reshape(-1)
    with pytest.raises(DamagedCheckpoint, match=rf"zip member {name} \(tensor w\) fails"):
        for lo in range(0, flat.numel(), 8192):
            integrity.consume(flat[lo : lo + 8192])


def test_a_member_read_in_part_is_finished_at_the_end(tmp_path: Path) -> None:
    f, _ = _saved(tmp_path)
    name = _member(f, load_torch_file(f)[0], "v")
    _flip(f, name.split("/", 1)[1], 1100)  # past what the read below takes
    obj, _ = load_torch_file(f)
    integrity.consume(obj["v"][:200])  # 800 of 1200 bytes
    with pytest.raises(DamagedCheckpoint, match=rf"zip member {name} \(tensor v\)"):
        integrity.settle()


def test_whole_file_check_counts_every_member(tmp_path: Path) -> None:
    f, _ = _saved(tmp_path)
    with zipfile.ZipFile(f) as z:
        n = len(z.infolist())
    assert check_zip(f) == (n, [])


def test_a_scalar_no_chunk_reads_is_checked_when_the_diff_settles(tmp_path: Path) -> None:
    """Adam's step is read as a number, never streamed: `settle` checks such small members
    whole, for the checkpoints it is given (torch numbers storages in pickle order: `step`'s
    is data/1)."""
    f = tmp_path / "o.pt"
    torch.save({"exp_avg": torch.randn(256), "step": torch.tensor(40.0)}, f)
    (m,) = [m for m in integrity.zip_members(f) if m.name.endswith("/data/1")]
    raw = bytearray(f.read_bytes())
    raw[m.offset : m.offset + 4] = b"\xff" * 4  # a NaN where 40.0 was
    f.write_bytes(raw)
    obj, _ = load_torch_file(f)
    assert torch.isnan(obj["step"])
    integrity.settle([tmp_path / "elsewhere"])  # not this checkpoint: left alone
    with pytest.raises(DamagedCheckpoint, match=rf"zip member {m.name} \(tensor step\) fails"):
        integrity.settle([f])


def test_memory_a_process_wrote_into_is_not_a_damaged_file(tmp_path: Path) -> None:
    """A loaded (copy-on-write) tensor written in place (an optimizer stepping on loaded
    state) differs from its member in memory only: the file is read again, found whole,
    and nothing is raised; the file itself untouched."""
    f, _ = _saved(tmp_path)
    before = f.read_bytes()
    obj, _ = load_torch_file(f)
    obj["v"].mul_(2.0)  # private mapping: the page is copied, the file keeps its bytes
    integrity.consume(obj["v"])
    assert integrity.settle([f]) == 0 and f.read_bytes() == before
