"""Every failure is one line: bad input exits 2, a fault of the tool exits 3 and says what it
was reading or computing; every torchrun rank prints the same line. No training here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as tmp_mp
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.core.errors import CorruptCheckpoint, Failed, doing, one_line
from ckptforensics.formats.base import read_rows

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "tests" / "plugin"
LITGPT = ROOT / "fixtures" / "data" / "litgpt-0.5"


def test_bad_input_is_its_message_on_one_line() -> None:
    assert one_line(CorruptCheckpoint("a.pt: cut\nshort")) == (2, "error: a.pt: cut short")


def test_an_os_error_names_the_path_and_the_errno_words(tmp_path: Path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OSError) as e:
        loop.stat()  # the OS's own error
    assert one_line(e.value) == (
        2,
        f"error: {loop}: Too many levels of symbolic links (a symlink loop)",
    )


def test_a_fault_says_what_was_being_done_and_where() -> None:
    with (
        pytest.raises(TypeError) as e,
        doing("reading checkpoint a.pt"),
        doing("reading tensor w of a.pt"),
    ):
        read_rows(None, 0, 1)  # a bug's shape: None where a loader was due
    code, line = one_line(e.value)
    assert code == 3
    assert line.startswith("error: internal error while reading tensor w of a.pt: TypeError: ")
    assert "[at formats/base.py:" in line and line.endswith("; run with --debug and report it")
    assert "(ckptforensics was reading tensor w of a.pt)" in e.value.__notes__  # shown with --debug


def test_bad_input_keeps_its_own_message_inside_doing() -> None:
    with pytest.raises(CorruptCheckpoint) as e, doing("reading checkpoint a.pt"):
        raise CorruptCheckpoint("a.pt: truncated")
    assert one_line(e.value) == (2, "error: a.pt: truncated") and not hasattr(
        e.value, "ckptforensics_doing"
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in its own process with the test's plugin reader installed (`tests/plugin`)."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); from ckptforensics.cli import main; sys.argv[1:2] = []; main()"
    return subprocess.run(
        [sys.executable, "-c", code, str(PLUGIN), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_a_reader_that_faults_exits_3_with_one_line_and_a_traceback_only_with_debug(
    tmp_path: Path,
) -> None:
    """A third-party reader that lets numpy's error out on a truncated archive: the tool's
    fault to report (exit 3), named by what it was reading; --debug shows the traceback."""
    f = tmp_path / "w.npz"
    np.savez(f, w=np.arange(1000, dtype=np.float32))
    f.write_bytes(f.read_bytes()[:300])
    r = _cli("inspect", "--format", "npz", str(f))
    assert r.returncode == 3, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: internal error while reading checkpoint {f}: BadZipFile: ")
    assert lines[0].endswith("run with --debug and report it")
    d = _cli("--debug", "inspect", "--format", "npz", str(f))
    assert (
        d.returncode == 1
        and "Traceback" in d.stderr
        and "ckptforensics was reading checkpoint" in d.stderr
    )


def test_help_and_readme_document_exit_code_3() -> None:
    top = CliRunner().invoke(cli, ["--help"]).output
    assert "3  internal error" in top and "--debug" in top
    assert "`3` internal error" in (ROOT / "README.md").read_text()


def test_an_input_that_is_a_symlink_loop_is_bad_input(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(LITGPT / "step-00000010", run / "step-00000010")
    (run / "step-00000020").symlink_to(run / "step-00000020")
    r = CliRunner().invoke(cli, ["diff", "--run-dir", str(run), "--before", "10", "--after", "20"])
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        f"error: {run / 'step-00000020'}: a symlink loop (Too many levels of symbolic links); pass the checkpoint itself"
    ]


# ---------------------------------------------------------------- torchrun ranks
def _rank(rank: int, world: int, port: int, where: str, out: str) -> None:
    """One rank: fail (only on rank 1) inside `agree` or the diff's `gather_to_rank0`,
    and write the line the CLI would print."""
    import torch
    import torch.distributed as dist

    from ckptforensics.core.errors import CorruptCheckpoint, one_line
    from ckptforensics.engine.diff.shard import gather_to_rank0
    from ckptforensics.engine.replay.distributed import Ranks, agree

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    ranks = Ranks(rank=rank, world=world, mesh=None, device=torch.device("cpu"))
    try:
        if where == "agree":
            agree(
                ranks, lambda: read_rows(None, 0, 1) if rank == 1 else 0
            )  # a fault on rank 1 only
        else:
            gather_to_rank0([], CorruptCheckpoint("b.pt: truncated") if rank == 1 else None, [])
        line = "no failure"
    except Exception as e:
        code, text = one_line(e)
        line = f"{code} {text}"
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(line)


@pytest.mark.parametrize("where", ["agree", "gather"])
def test_every_rank_prints_the_same_line(tmp_path: Path, where: str) -> None:
    from tests.conftest import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    tmp_mp.start_processes(
        _rank, args=(2, free_port(), where, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    lines = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert lines[0] == lines[1], lines
    if where == "agree":
        assert (
            lines[0].startswith("3 error: internal error: TypeError: ")
            and "[at formats/base.py:" in lines[0]
        )
    else:
        assert lines[0] == "2 error: b.pt: truncated"


def test_a_failure_carried_to_another_rank_keeps_its_code() -> None:
    assert one_line(Failed("error: x", 3)) == (3, "error: x")


_LEAVE = """
import atexit, sys
from ckptforensics.engine.diff.shard import leave_rank
atexit.register(lambda: print("handler"))
print("said", end="")
leave_rank(eval(sys.argv[1]))
print("never")
"""


@pytest.mark.parametrize(("code", "status"), [("None", 0), ("0", 0), ("2", 2), ("'error: x'", 1)])
def test_a_rank_leaves_with_its_status_after_its_exit_handlers_and_a_flush(
    code: str, status: int
) -> None:
    """`leave_rank` skips Python's finalisation (gloo's threads outlive it) but not what a
    normal exit does first: the status as `sys.exit` reads it, the atexit handlers, the
    buffered output of a piped stream."""
    proc = subprocess.run(
        [sys.executable, "-c", _LEAVE, code], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "saidhandler\n"
    assert proc.stderr.strip() == ("error: x" if status == 1 else "")
