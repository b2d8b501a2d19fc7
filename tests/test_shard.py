"""Sharing a diff: --workers processes and torchrun ranks give the single-process report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.diff.shard import balanced
from tests.conftest import ROOT, free_port, ranks_said, torchrun
from tests.test_dcp import dcp_run  # noqa: F401 - the session fixture: a real FSDP2 run


def _report(path: Path) -> dict:
    doc = json.loads(path.read_text())
    # the command line and the report's own folder (both name --out) are all that may differ
    doc["incident"].pop("command")
    doc["incident"].pop("report_dir", None)
    return doc


def _single(run: Path, before: str, after: str, out: Path) -> dict:
    r = CliRunner().invoke(
        cli,
        [
            "-q",
            "diff",
            "--run-dir",
            str(run),
            "--before",
            before,
            "--after",
            after,
            "--workers",
            "1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    return _report(out / "report.json")


def _torchrun(run: Path, before: str, after: str, out: Path) -> subprocess.CompletedProcess:
    args = [
        "-m",
        "ckptforensics.cli",
        "-q",
        "diff",
        "--run-dir",
        str(run),
        "--before",
        before,
        "--after",
        after,
        "--out",
        str(out),
    ]
    return torchrun(args, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_balanced_shares() -> None:
    names = [f"t{i}" for i in range(7)]
    sizes = [100, 1, 1, 50, 50, 1, 1]
    parts = balanced(names, sizes, 2)
    assert sorted(n for p in parts for n in p) == sorted(names)
    loads = [sum(sizes[names.index(n)] for n in p) for p in parts]
    assert max(loads) - min(loads) <= max(sizes)
    assert all(p == sorted(p, key=names.index) for p in parts)  # checkpoint order kept


def test_workers_give_the_single_process_report(zoo: dict[str, Path], tmp_path: Path) -> None:
    run = zoo["lr_jump"]
    one = _single(run, "30", "40", tmp_path / "one")
    r = CliRunner().invoke(
        cli,
        [
            "-q",
            "diff",
            "--run-dir",
            str(run),
            "--before",
            "30",
            "--after",
            "40",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "two"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert _report(tmp_path / "two" / "report.json") == one
    assert one["verdict"]["causes"][0]["cause"] == "lr_too_high"


def test_torchrun_two_ranks_give_the_single_process_report(dcp_run: Path, tmp_path: Path) -> None:  # noqa: F811
    one = _single(dcp_run, "2", "3", tmp_path / "one")
    proc = _torchrun(dcp_run, "2", "3", tmp_path / "two")
    assert proc.returncode == 0, ranks_said(proc.stderr)
    assert _report(tmp_path / "two" / "report.json") == one
    assert len(one["diff"]["tensors"]) >= 4


def test_a_rank_that_fails_fails_the_run_with_one_line(dcp_run: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    for s in ("step-2", "step-3"):
        shutil.copytree(dcp_run / s, run / s)
    f = run / "step-3" / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])  # rank 1's share reads from here
    proc = _torchrun(run, "2", "3", tmp_path / "out")
    # Both ranks stop with the one-line error and exit 2 (torchrun then reports its own
    # ChildFailedError, a launcher traceback that names no frame of ours).
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 2 and all("__1_0.distcp: truncated" in e for e in errors), proc.stderr[
        -2000:
    ]
    assert "exitcode  : 2" in proc.stderr
    assert "ckptforensics/" not in proc.stderr.replace(str(run), "")
    assert not (tmp_path / "out" / "report.json").exists()


def _die(name: str) -> None:
    os._exit(9)  # a worker killed mid-diff


def test_a_worker_that_dies_is_one_clear_error(zoo: dict[str, Path], monkeypatch) -> None:  # noqa: ANN001
    import ckptforensics.engine.diff.shard as shard
    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.core.errors import ForensicsError
    from ckptforensics.engine.diff.pair import diff_checkpoints

    monkeypatch.setattr(shard, "_one", _die)
    run = zoo["lr_jump"]
    a, b = open_checkpoint(run / "step_30.pt"), open_checkpoint(run / "step_40.pt")
    try:
        diff_checkpoints(a, b, workers=2)
    except ForensicsError as e:
        assert "worker process died" in str(e) and "--workers 1" in str(e)
    else:
        raise AssertionError("a dead worker went unnoticed")


_RELEASED = """
import gc, sys
from pathlib import Path
import torch.distributed as dist
from ckptforensics.checkpoints import open_pair
from ckptforensics.engine.diff.shard import destroy_process_group, init_process_group

init_process_group("gloo")
pg = dist.distributed_c10d._get_default_group()
a, b = open_pair(Path(sys.argv[1]) / "step-2", Path(sys.argv[1]) / "step-3", None)
destroy_process_group(settled=True)
gc.collect()
print(sys.getrefcount(pg) - 1)  # the name `pg` is the one reference left
"""


def test_the_process_group_is_freed_after_a_dcp_diff(dcp_run: Path) -> None:  # noqa: F811
    """Reading DCP metadata imports torch.distributed.checkpoint, whose torch.distributed.nn
    takes the default group as a default argument: imported after the group exists, it
    kept the group (and its gloo threads) alive past destroy_process_group, and a worker
    thread dropping a collective's tensors while Python finalised aborted a rank (SIGABRT,
    1 torchrun diff in 16 on a loaded 2-core machine)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _RELEASED, str(dcp_run)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1"]


_IN_FLIGHT = """
import sys, time, torch, torch.distributed as dist
from ckptforensics.engine.diff.shard import init_process_group, leave_rank

init_process_group("gloo")
KEEP = dist.group.WORLD  # held past the end, as DTensor's caches hold an FSDP2 model's mesh
t = torch.ones(1 << 20)
t.tag = "a Python attribute: the tensor's Python object outlives its last Python name"
if dist.get_rank() == 0:
    time.sleep(0.2)  # rank 1 waits in the collective: it completes as rank 0 ends
    work = dist.all_reduce(t, async_op=True)
    del work, t  # only gloo's worker thread holds the tensor now
else:
    try:
        dist.all_reduce(t)
    except RuntimeError:  # rank 0 may be gone before its share is sent: not what is tested
        pass
    time.sleep(0.2)
leave_rank(0)
"""


def test_a_rank_leaves_cleanly_while_a_gloo_worker_still_holds_a_tensor(tmp_path: Path) -> None:
    """Rank 0 ends while its gloo worker still holds a collective's tensor, whose Python
    object the worker must drop under the GIL. Through Python's finalisation that is
    `std::terminate` (SIGABRT; most launches with `sys.exit(0)` in place of `leave_rank`);
    through `leave_rank`, a clean exit. Three launches of two ranks (the environment torchrun
    would set, without its launcher's start-up), none retried."""
    script = tmp_path / "in_flight.py"
    script.write_text(_IN_FLIGHT)
    for _ in range(3):
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [sys.executable, str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={
                    **os.environ,
                    "OMP_NUM_THREADS": "1",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                },
            )
            for rank in (0, 1)
        ]
        said = [p.communicate(timeout=120)[1] for p in procs]
        for rank, (p, err) in enumerate(zip(procs, said, strict=True)):
            assert "terminate called" not in err and p.returncode == 0, (
                rank,
                p.returncode,
                err[-2000:],
            )
