from pathlib import Path

import pytest

from ckptforensics.core.errors import CheckpointNotFound
from ckptforensics.formats.locate import list_checkpoints, resolve_checkpoint


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
