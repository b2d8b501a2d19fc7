"""--out: refused in one line before any work when it cannot be written; a report written all
at once, so a full disk or an interrupt leaves the previous one as it was. On LitGPT's own
checkpoints (committed); no training."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.core.errors import OutputNotWritable
from ckptforensics.report import write_files
from tests.crash_corpus import unprivileged

ROOT = Path(__file__).resolve().parents[2]
LITGPT = ROOT / "fixtures" / "data" / "litgpt-0.5"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """LitGPT's steps 10 and 20, with step 30 cut short (a bad input the command would
    report, if it got as far as reading it)."""
    r = tmp_path / "run"
    for step in ("step-00000010", "step-00000020", "step-00000030"):
        shutil.copytree(LITGPT / step, r / step)
    f = r / "step-00000030" / "lit_model.pth"
    f.write_bytes(f.read_bytes()[:1000])
    return r


def _one_line(r: object, words: str) -> None:
    lines = r.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert r.exit_code == 2 and len(lines) == 1 and words in lines[0], r.stderr  # type: ignore[attr-defined]


def test_a_file_in_the_way_is_refused_before_the_input_is_read(run: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file\n")
    r = CliRunner().invoke(
        cli,
        [
            "diff",
            "--run-dir",
            str(run),
            "--before",
            "20",
            "--after",
            "30",
            "--out",
            str(tmp_path / "taken"),
        ],
    )
    _one_line(
        r, f"--out {tmp_path / 'taken'}: a file is in the way"
    )  # not step 30's truncation: no work was done
    r = CliRunner().invoke(
        cli,
        [
            "diff",
            "--run-dir",
            str(run),
            "--before",
            "10",
            "--after",
            "20",
            "--out",
            str(tmp_path / "taken" / "rep"),
        ],
    )
    _one_line(r, f"{tmp_path / 'taken'} is not a directory")
    assert (tmp_path / "taken").read_text() == "a file\n"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may enter (the read-only case runs as nobody when the tests run as root)."""
    d = Path(tempfile.mkdtemp(prefix="ckptforensics-out-"))
    d.chmod(0o755)
    yield d
    for p in (d, *d.rglob("*")):
        p.chmod(0o755)
    shutil.rmtree(d)


def test_a_read_only_out_is_refused_before_the_input_is_read(shared: Path) -> None:
    run = shared / "run"
    for step in ("step-00000020", "step-00000030"):
        shutil.copytree(LITGPT / step, run / step)
    for p in (run, *run.rglob("*")):
        p.chmod(0o755 if p.is_dir() else 0o644)
    ro = shared / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with unprivileged():
        r = CliRunner().invoke(
            cli,
            [
                "diff",
                "--run-dir",
                str(run),
                "--before",
                "20",
                "--after",
                "30",
                "--out",
                str(ro / "rep"),
            ],
        )
    _one_line(r, f"--out {ro / 'rep'}: cannot create {ro / 'rep'} (Permission denied)")
    assert list(ro.iterdir()) == []


def _limited(limit: int, *args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process, its files capped at `limit` bytes (RLIMIT_FSIZE: what a
    full disk does to a write; Python ignores SIGXFSZ, so the write fails with EFBIG)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "ckptforensics.cli", "-q", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=cap,
    )


def test_a_full_disk_is_refused_before_any_work(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    p = _limited(
        1000, "diff", "--run-dir", str(run), "--before", "20", "--after", "30", "--out", str(out)
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"error: --out {out}: cannot write in {out} (File too large)"
    ], p.stderr
    assert not out.exists()  # the directory it made for the probe is gone again


def test_a_full_disk_mid_report_leaves_the_previous_report_as_it_was(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "rep"
    first = CliRunner().invoke(
        cli,
        ["-q", "diff", "--run-dir", str(run), "--before", "10", "--after", "20", "--out", str(out)],
    )
    assert first.exit_code == 0, first.output
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert set(before) == {"report.json", "report.md", "report.html", "evidence.h5"}
    big = max(len(b) for b in before.values())
    p = _limited(
        big // 2,
        "diff",
        "--run-dir",
        str(run),
        "--before",
        "10",
        "--after",
        "20",
        "--out",
        str(out),
    )
    lines = p.stderr.strip().splitlines()
    assert (
        p.returncode == 2
        and len(lines) == 1
        and "cannot be written (File too large); every file already in" in lines[0]
    ), p.stderr
    assert {
        f.name: f.read_bytes() for f in out.iterdir()
    } == before  # no temp file left, nothing half-written


def test_an_interrupted_write_leaves_every_previous_file(tmp_path: Path) -> None:
    # (not named report.json: every report.json a test leaves is validated as it ends, tests/conftest.py)
    a, b, c = tmp_path / "triage.md", tmp_path / "report.md", tmp_path / "evidence.h5"
    write_files({a: "old json", b: "old md", c: "old h5"})

    def interrupted(tmp: Path) -> None:
        tmp.write_bytes(b"half an evidence file")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_files({a: "new json", b: "new md", c: interrupted})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evidence.h5", "report.md", "triage.md"]
    assert (a.read_text(), b.read_text(), c.read_text()) == ("old json", "old md", "old h5")


def test_a_write_that_fails_names_the_file(tmp_path: Path) -> None:
    def fails(tmp: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(
        OutputNotWritable, match=r"report.html: cannot be written \(No space left on device\)"
    ):
        write_files({tmp_path / "report.md": "# a report", tmp_path / "report.html": fails})
    assert list(tmp_path.iterdir()) == []
