"""The format registry: sniffing asks the registered readers; plugins join through the
`ckptforensics.formats` entry point; `--format` accepts what is registered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptforensics import formats

PLUGIN = Path(__file__).resolve().parent / "plugin"


def test_builtin_layouts_are_sniffed_by_their_registered_reader(zoo: dict[str, Path]) -> None:
    assert formats.sniff(zoo["hf-trainer"] / "checkpoint-10") == "hf-trainer"
    assert formats.sniff(zoo["healthy-safetensors"] / "step_10.safetensors") == "safetensors"
    assert formats.sniff(zoo["healthy-torch"] / "step_10.pt") == "torch-file"
    assert {"megatron-dist", "dcp", "deepspeed"} <= set(formats.format_names())


def test_a_plugin_reader_registers_through_its_entry_point(tmp_path: Path) -> None:
    f = tmp_path / "w.npz"
    want = {
        "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layer.bias": np.ones(2, np.float32),
    }
    np.savez(f, **want)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from ckptforensics.checkpoints import open_checkpoint, format_names, is_builtin;"
        "ck = open_checkpoint(sys.argv[2]);"
        "print(ck.format, sorted(ck.names()), float(ck.tensor('layer.weight').sum()), 'npz' in format_names(), is_builtin('npz'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(PLUGIN), str(f)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == [
        "npz",
        "['layer.bias',",
        "'layer.weight']",
        str(float(want["layer.weight"].sum())),
        "True",
        "False",
    ]


def test_cli_format_choices_come_from_the_registry(tmp_path: Path) -> None:
    f = tmp_path / "w.npz"
    np.savez(f, w=np.zeros(3, np.float32))
    env_path = str(PLUGIN)
    cmd = [
        sys.executable,
        "-c",
        "import sys; sys.path.insert(0, sys.argv[1]); from ckptforensics.cli import cli; cli(sys.argv[2:])",
    ]
    listed = subprocess.run(
        [*cmd, env_path, "formats"], capture_output=True, text=True, check=True
    ).stdout
    assert "npz" in listed and "plugin" in listed and "megatron-dist" in listed
    shown = subprocess.run(
        [*cmd, env_path, "inspect", "--format", "npz", str(f)], capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    bad = subprocess.run(
        [*cmd, env_path, "inspect", "--format", "nope", str(f)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not a registered format" in bad.stderr


def test_a_second_reader_under_a_taken_name_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        formats.register("dcp", lambda p: formats.open_checkpoint(p))
