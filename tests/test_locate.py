import subprocess
import sys
from pathlib import Path

import pytest

from ckptforensics.checkpoints import list_checkpoints, resolve_checkpoint
from ckptforensics.core.errors import CheckpointNotFound
from ckptforensics.formats.locate import STEP_PATTERNS, register_step_names
from ckptforensics.trainers import loop


@pytest.mark.parametrize(
    "name",
    [
        "checkpoint-41950",
        "global_step41950",
        "iter_0041950",
        "step-41950",
        "step41950",
        "step_41950",
        "step_41950.pt",
        "epoch=3-step=41950.ckpt",
        "step_0041950.pt",
        "state_step0041950.pt",
        "ckpt_41950.pt",
        "model_41950.pt",
        "checkpoint_41950",
    ],
)
def test_every_trainer_naming_resolves(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-100").mkdir()
    assert resolve_checkpoint("41950", tmp_path) == tmp_path / name


def test_path_is_taken_as_path(tmp_path: Path) -> None:
    f = tmp_path / "weird name.bin"
    f.write_bytes(b"x")
    assert resolve_checkpoint(str(f), tmp_path / "elsewhere") == f


def test_missing_step_lists_what_was_found(tmp_path: Path) -> None:
    for s in (10, 20):
        (tmp_path / f"checkpoint-{s}").mkdir()
    with pytest.raises(
        CheckpointNotFound,
        match=r"no checkpoint for step 30 .* found: checkpoint-10, checkpoint-20",
    ):
        resolve_checkpoint("30", tmp_path)


def test_two_matches_are_ambiguous(tmp_path: Path) -> None:
    (tmp_path / "checkpoint-30").mkdir()
    (tmp_path / "global_step30").mkdir()
    with pytest.raises(CheckpointNotFound, match="ambiguous"):
        resolve_checkpoint("30", tmp_path)


def test_listing_is_sorted_by_step(tmp_path: Path) -> None:
    for s in (100, 20, 3):
        (tmp_path / f"step_{s}.pt").write_bytes(b"")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 20, 100]


def test_the_names_are_each_trainers_in_their_order() -> None:
    """Each trainer declares the names it writes (`STEP_NAMES`); several writers of one name
    share its entry."""
    assert [(who, rx.pattern) for who, rx in STEP_PATTERNS] == [
        ("HF Trainer", r"^checkpoint-(\d+)$"),
        ("DeepSpeed", r"^global_step(\d+)$"),
        ("Megatron", r"^iter_(\d+)$"),
        (
            "torchtitan / OLMo-core / step_N",
            r"^step[-_]?(\d+)(?:\.(?:pt|pth|bin|safetensors|ckpt))?$",
        ),
        ("Lightning", r"^.*step=(\d+).*\.ckpt$"),
        ("own loop", loop.STEP_NAMES[0][1]),
    ]
    with pytest.raises(ValueError, match="Megatron"):
        register_step_names("Megatron", r"^iter_(\d+)$", order=3)


def test_lightnings_version_folders_are_looked_in(tmp_path: Path) -> None:
    ckpt = tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=7.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    assert list_checkpoints(tmp_path) == [(7, ckpt)]


def test_the_cli_resolves_every_trainers_names_in_a_fresh_process(tmp_path: Path) -> None:
    """The CLI imports `formats.locate` alone; its --run-dir loads the trainers' names."""
    (tmp_path / "iter_0041950").mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "ckptforensics.cli", "inspect", "--run-dir", str(tmp_path), "41950"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "iter_0041950: a directory that is not a known" in r.stderr, (
        r.stderr
    )
