"""Paths a run recorded relative to its launch directory (`replay/paths.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptforensics.core.paths import resolve_recorded


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """launch/ holding the run (launch/out/run) and its cache (launch/cache), data beside it."""
    for d in (
        "launch/out/run/checkpoint-5",
        "launch/cache",
        "launch/out/run/cache",
        "store/data",
        "store/cache-only-here",
    ):
        (tmp_path / d).mkdir(parents=True)
    return tmp_path


def test_the_run_directory_comes_first_then_its_parents_then_datas_parent(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tree / "launch" / "out" / "run"
    monkeypatch.chdir(tree / "store")  # the working directory is never a base
    got = resolve_recorded("cache", run, tree / "store" / "data")
    assert got is not None and got.path == run / "cache" and "the run directory" in got.how
    (run / "cache").rmdir()
    got = resolve_recorded("cache", run, tree / "store" / "data")
    assert (
        got is not None
        and got.path == tree / "launch" / "cache"
        and f"the run directory's parent {tree / 'launch'}" in got.how
    )
    got = resolve_recorded("cache-only-here", run, tree / "store" / "data")
    assert (
        got is not None
        and got.path == tree / "store" / "cache-only-here"
        and "--data's parent" in got.how
    )
    assert resolve_recorded("cache-only-here", run, None) is None  # under no base without --data
    assert resolve_recorded("nowhere", run, tree / "store" / "data") is None


def test_absolute_paths_are_taken_as_recorded_and_holds_decides(tree: Path) -> None:
    run = tree / "launch" / "out" / "run"
    absolute = str(tree / "launch" / "cache")
    got = resolve_recorded(absolute, run)
    assert got is not None and got.path == Path(absolute) and "absolute, as recorded" in got.how
    assert resolve_recorded(str(tree / "gone"), run) is None
    # `holds`: the first base whose path holds what is looked for, not merely exists
    (tree / "launch" / "cache" / "marker").write_text("x")
    got = resolve_recorded("cache", run, holds=lambda p: (p / "marker").is_file())
    assert got is not None and got.path == tree / "launch" / "cache"
    assert resolve_recorded(None, run) is None and resolve_recorded("", run) is None
