"""Fuzzing: malformed checkpoints, indexes and batch logs give a one-line error (exit 2), never a traceback.

Seeded (derandomized) for CI; `make fuzz` runs a longer campaign.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptforensics.cli import cli
from ckptforensics.core.errors import ForensicsError

EXAMPLES = int(os.environ.get("CKPTFORENSICS_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def seeds(zoo: dict[str, Path]) -> dict[str, bytes]:
    return {
        "safetensors": (zoo["healthy-safetensors"] / "step_30.safetensors").read_bytes(),
        "torch": (zoo["healthy-torch"] / "step_30.pt").read_bytes(),
        "index": b'{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}',
        "h5": (zoo["healthy"] / "batches.h5").read_bytes(),
    }


def _mangle(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    b = bytearray(data[: max(0, min(cut, len(data)))])
    for pos, val in flips:
        if b:
            b[pos % len(b)] = val
    return bytes(b)


def _inspect_ok(path: Path) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(path)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in (0, 2), r.output
    if r.exit_code == 2:
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


flips = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=6)


@FUZZ
@given(cut=st.integers(0, 4096), flips=flips)
def test_mangled_safetensors_header(
    seeds: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    cut: int,
    flips: list[tuple[int, int]],
) -> None:
    data = seeds["safetensors"]
    head = _mangle(data, len(data), [(p % 512, v) for p, v in flips])  # header region
    f = tmp_path_factory.mktemp("st") / "x.safetensors"
    f.write_bytes(head[: len(data) - cut] if cut else head)
    _inspect_ok(f)


@FUZZ
@given(cut=st.integers(0, 1 << 20), flips=flips)
def test_mangled_torch_zip(
    seeds: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    cut: int,
    flips: list[tuple[int, int]],
) -> None:
    f = tmp_path_factory.mktemp("pt") / "step_30.pt"
    f.write_bytes(_mangle(seeds["torch"], cut, flips))
    _inspect_ok(f)


@FUZZ
@given(
    text=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
    cut=st.integers(0, 120),
)
def test_mangled_index_json(
    zoo: dict[str, Path],
    seeds: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    text: bytes,
    cut: int,
) -> None:
    d = tmp_path_factory.mktemp("hf") / "checkpoint-30"
    d.mkdir()
    shutil.copy(zoo["hf-trainer"] / "checkpoint-30" / "config.json", d / "config.json")
    (d / "model-00001-of-00002.safetensors").write_bytes(seeds["safetensors"][: 200 + cut * 50])
    (d / "model.safetensors.index.json").write_bytes(text if text else seeds["index"][:cut])
    _inspect_ok(d)


@FUZZ
@given(cut=st.integers(0, 1 << 16), flips=flips, step=st.integers(-2, 70))
def test_mangled_batch_log(
    seeds: dict[str, bytes],
    tmp_path_factory: pytest.TempPathFactory,
    cut: int,
    flips: list[tuple[int, int]],
    step: int,
) -> None:
    from ckptforensics.formats.batches import open_batches

    f = tmp_path_factory.mktemp("h5") / "batches.h5"
    data = seeds["h5"]
    f.write_bytes(_mangle(data, len(data) - cut, flips))
    try:
        src = open_batches(str(f))
        src.batch(step)
    except ForensicsError as e:
        assert str(e) and "\n" not in str(e)
