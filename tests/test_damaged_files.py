"""A file damaged on disk is named as damaged (issue #46, item 4), never diagnosed.

Real checkpoints of a tiny real run (`fixtures.zoo.healthy`, nanoGPT format) and real files
written by torch's own writers, then damaged as a disk or a copy would: 64 bytes of 0xFF over
a tensor's data in the middle of a complete file. The file stays complete by every size and
end record, and its tensors still read as numbers; only the zip's CRC-32 of that member tells.
Each test asserts the exit code and the exact line against what was planted: the file, the
zip member, the tensor, and the CRC-32 the zip records and the one the bytes now give
(computed here with zlib, independently of the tool).
"""

from __future__ import annotations

import io
import shutil
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from ckptforensics.cli import cli
from fixtures.zoo import healthy

TENSOR = "model.transformer.h.0.mlp.c_fc.weight"  # the tensor whose bytes are damaged


@dataclass(frozen=True)
class Planted:
    file: Path
    member: str
    tensor: str
    recorded: int
    read: int

    def line(self) -> str:
        what = f"zip member {self.member}" + (f" (tensor {self.tensor})" if self.tensor else "")
        return (
            f"error: {self.file}: damaged file: {what} fails its CRC-32 (recorded "
            f"{self.recorded:08x}, read {self.read:08x}): a storage fault (disk, copy or "
            "transfer), not a training problem; restore the file from a good copy, or pass "
            "another checkpoint"
        )


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_line(r: Result, line: str) -> None:
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [line], r.stderr
    assert "Traceback" not in r.output and r.stdout == ""


def _data_offset(z: zipfile.ZipFile, raw: bytes, name: str) -> tuple[int, int, int]:
    """(data offset, size, recorded CRC-32) of a stored member, from its local header."""
    info = z.getinfo(name)
    h = info.header_offset
    n = int.from_bytes(raw[h + 26 : h + 28], "little")
    m = int.from_bytes(raw[h + 28 : h + 30], "little")
    return h + 30 + n + m, info.compress_size, info.CRC


def damage(path: Path, member: str, tensor: str, where: float = 0.5) -> Planted:
    """64 bytes of 0xFF over `member`'s data, `where` of the way in."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        off, size, crc = _data_offset(z, bytes(raw), member)
    at = off + min(int(size * where), size - 64)
    raw[at : at + 64] = b"\xff" * 64
    path.write_bytes(raw)
    return Planted(path, member, tensor, crc, zlib.crc32(bytes(raw[off : off + size])))


def member_of(path: Path, key: str) -> str:
    """The zip member that holds the storage of `key` ('model.<parameter name>' in the
    saved dict): the one whose bytes are that storage's, compared byte for byte."""
    top, name = key.split(".", 1)
    st = torch.load(path, map_location="cpu", weights_only=True)[top][name].untyped_storage()
    with zipfile.ZipFile(path) as z:
        raw = path.read_bytes()
        for name in z.namelist():
            if "/data/" in name and not name.split("/")[-1].startswith("."):
                off, size, _ = _data_offset(z, raw, name)
                if size == st.nbytes() and raw[off : off + size] == bytes(st):
                    return name
    raise AssertionError(f"no member holds {key}")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny real nanoGPT-format run (checkpoints at steps 10..60)."""
    return healthy(tmp_path_factory.mktemp("damaged"))


@pytest.fixture
def pair(run: Path, tmp_path: Path) -> tuple[Path, Planted]:
    """steps 30 and 40 of the run, 40 damaged in TENSOR's data."""
    d = tmp_path / "run"
    d.mkdir()
    for s in (30, 40):
        shutil.copy(run / f"step_{s}.pt", d / f"step_{s}.pt")
    f = d / "step_40.pt"
    return d, damage(f, member_of(f, TENSOR), TENSOR)


def test_the_run_diffs_clean_before_the_damage(run: Path) -> None:
    r = invoke("diff", "--run-dir", str(run), "--before", "30", "--after", "40")
    assert r.exit_code == 0 and "causes: none (100%)" in r.stdout, r.output


@pytest.mark.parametrize("workers", ["1", "2"])
def test_diff_names_the_damaged_file_member_and_tensor(
    pair: tuple[Path, Planted], workers: str
) -> None:
    d, planted = pair
    r = invoke("diff", "--run-dir", str(d), "--before", "30", "--after", "40", "--workers", workers)
    assert_one_line(r, planted.line())


def test_inspect_verify_names_it_and_checks_a_whole_file(pair: tuple[Path, Planted]) -> None:
    d, planted = pair
    assert_one_line(invoke("inspect", "--verify", str(planted.file)), planted.line())
    good = d / "step_30.pt"
    with zipfile.ZipFile(good) as z:
        n = len(z.infolist())
    r = invoke("inspect", "--verify", str(good))
    assert r.exit_code == 0, r.output
    size = good.stat().st_size / (1 << 20)
    assert (
        f"  checksums: {n} of {n} zip members' CRC-32 match in 1 file ({size:.1f} MiB read)\n"
        in r.stdout
    )
    # Without --verify nothing is read twice, and the line says what was not checked.
    r = invoke("inspect", str(planted.file))
    assert r.exit_code == 0 and (
        "  checksums: not checked (--verify reads every file whole and checks each zip "
        "member's CRC-32)\n" in r.stdout
    )


def test_a_damaged_pickle_is_damage_not_an_unsafe_global(run: Path, tmp_path: Path) -> None:
    """The same bytes over the pickle: torch's weights-only unpickler then meets garbage
    opcodes and says 'unsupported global'; the CRC-32 says what happened."""
    f = tmp_path / "step_40.pt"
    shutil.copy(run / "step_40.pt", f)
    planted = damage(f, "step_40/data.pkl", "", where=0.3)
    assert_one_line(invoke("inspect", str(f)), planted.line())


def test_formats_without_a_checksum_are_named_as_such(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(12.0).reshape(3, 4)}, str(f))
    r = invoke("inspect", "--verify", str(f))
    assert r.exit_code == 0, r.output
    assert (
        "  checksums: w.safetensors: safetensors carries no checksum, only its structure was checked\n"
        in r.stdout
    )


def test_a_dcp_chunk_is_checked_against_its_own_zip(tmp_path: Path) -> None:
    """torch's DCP writer saves each chunk as a torch.save zip inside the .distcp file:
    verify checks each chunk's members; the metadata (a pickle) carries no checksum."""
    import torch.distributed.checkpoint as dcp

    d = tmp_path / "dcp"
    sd = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    with pytest.warns(UserWarning):  # torch: no process group, saving as one process
        dcp.save(sd, checkpoint_id=str(d))
    r = invoke("inspect", "--verify", str(d))
    assert r.exit_code == 0, r.output
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("  checksums: "))
    assert line.endswith(
        "; .metadata: DCP metadata (a pickle) carries no checksum, only its structure was checked"
    )
    assert line.startswith("  checksums: 14 of 14 zip members' CRC-32 match in 1 file")
    f = d / "__0_0.distcp"
    raw = bytearray(f.read_bytes())
    # The chunk of `w` is the first zip in the file (up to its end record); its member
    # archive/data/0 holds w's bytes.
    z0 = bytes(raw[: raw.index(b"PK\x05\x06") + 22])
    with zipfile.ZipFile(io.BytesIO(z0)) as z:
        off, size, crc = _data_offset(z, z0, "archive/data/0")
    assert bytes(raw[off : off + size]) == sd["w"].numpy().tobytes()
    raw[off + 100 : off + 164] = b"\xff" * 64
    f.write_bytes(raw)
    read = zlib.crc32(bytes(raw[off : off + size]))
    r = invoke("inspect", "--verify", str(d))
    assert_one_line(
        r,
        Planted(f, "archive/data/0", "w, chunk at byte 0", crc, read).line(),
    )
