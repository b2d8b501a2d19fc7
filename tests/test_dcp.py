"""torch.distributed.checkpoint read without a process group: FSDP2-written (2 ranks), vs the gathered state."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from tests.conftest import ROOT, ranks_said, torchrun
from tests.test_cli import assert_bad_input


@pytest.fixture(scope="session")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dcp")
    proc = torchrun(
        [str(ROOT / "fixtures" / "fsdp_dcp.py"), str(out)],
        {**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, ranks_said(proc.stderr)
    return out


def test_dcp_matches_the_gathered_state(dcp_run: Path) -> None:
    ck = open_checkpoint(dcp_run / "step-3")
    full = torch.load(dcp_run / "gathered_3.pt", weights_only=True)
    assert ck.format == "dcp" and ck.step == 3
    # The tied lm_head is saved under both names; it is read once, as an alias.
    assert ck.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert set(ck.names()) | set(ck.aliases) == set(full["model"])
    for n in ck.names():
        assert torch.equal(ck.tensor(n), full["model"][n]), n
    assert ck.optimizer is not None and ck.optimizer.kind == "adam"
    for fqn, st in full["optim"]["state"].items():
        mine = ck.optim_state(fqn)
        assert torch.equal(mine["exp_avg"], st["exp_avg"]), fqn
        assert torch.equal(mine["exp_avg_sq"], st["exp_avg_sq"]), fqn
        assert float(mine["step"]) == float(st["step"]) == 3.0
    assert ck.hyper("transformer.h.0.mlp.c_fc.weight").betas == (0.9, 0.95)


def test_accelerate_fsdp_layout_matches_the_gathered_state(dcp_run: Path, tmp_path: Path) -> None:
    """checkpoint-N/pytorch_model_fsdp_0 + optimizer_0 (accelerate's sharded FSDP save)."""
    run = dcp_run / "accelerate"
    ck = open_checkpoint(run / "checkpoint-3")
    full = torch.load(dcp_run / "gathered_3.pt", weights_only=True)
    assert ck.format == "dcp" and ck.step == 3
    assert set(ck.names()) | set(ck.aliases) == set(full["model"])
    assert ck.optimizer is not None
    for n in ck.names():
        assert torch.equal(ck.tensor(n), full["model"][n]), n
        assert torch.equal(
            ck.optim_state(n)["exp_avg_sq"], full["optim"]["state"][n]["exp_avg_sq"]
        ), n
    r = CliRunner().invoke(
        cli,
        ["diff", "--run-dir", str(run), "--before", "2", "--after", "3", "--out", str(tmp_path)],
    )
    assert r.exit_code == 0, r.output
    assert "No anomaly" in r.output


def test_dcp_inspect_and_diff(dcp_run: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(
        cli,
        [
            "diff",
            "--run-dir",
            str(dcp_run),
            "--before",
            "2",
            "--after",
            "3",
            "--out",
            str(tmp_path),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "No anomaly" in r.output
    r = CliRunner().invoke(cli, ["inspect", "--run-dir", str(dcp_run), "3"])
    assert r.exit_code == 0 and "dcp, step 3" in r.output


def test_hostile_dcp_metadata_is_refused(dcp_run: Path, tmp_path: Path) -> None:
    canary = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):  # noqa: ANN204 - a hostile pickle
            return (os.system, (f"touch {canary}",))

    d = tmp_path / "step-3"
    shutil.copytree(dcp_run / "step-3", d)
    (d / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Exploit()}))
    assert_bad_input(
        CliRunner().invoke(cli, ["inspect", str(d)]), "refused to unpickle posix.system"
    )
    assert not canary.exists()


def test_truncated_dcp_chunk(dcp_run: Path, tmp_path: Path) -> None:
    d = tmp_path / "step-3"
    shutil.copytree(dcp_run / "step-3", d)
    f = d / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    assert_bad_input(CliRunner().invoke(cli, ["inspect", str(d)]), "truncated")


def test_mangled_dcp_metadata(dcp_run: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Truncated and bit-mangled `.metadata`: one-line error or a clean read, never a traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    data = (dcp_run / "step-3" / ".metadata").read_bytes()

    @settings(
        max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        cut=st.integers(0, len(data)),
        flips=st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), max_size=4),
    )
    def check(cut: int, flips: list[tuple[int, int]]) -> None:
        d = tmp_path_factory.mktemp("md") / "step-3"
        shutil.copytree(dcp_run / "step-3", d)
        b = bytearray(data)
        for pos, val in flips:
            b[pos] = val
        (d / ".metadata").write_bytes(bytes(b[: len(b) - cut]))
        r = CliRunner().invoke(cli, ["inspect", str(d)])
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.exit_code in (0, 2)
        if r.exit_code == 2:
            assert len(r.stderr.strip().splitlines()) == 1

    check()


def test_diff_holds_one_tensors_moments_at_a_time(dcp_run: Path) -> None:
    """Lazily read moments are dropped once their tensor is diffed (bounded memory)."""
    from ckptforensics.engine.diff.pair import diff_checkpoints

    a, b = open_checkpoint(dcp_run / "step-2"), open_checkpoint(dcp_run / "step-3")
    res = diff_checkpoints(a, b)
    assert res is not None and all(t.has_moments for t in res.tensors)
    assert a.optimizer is not None and b.optimizer is not None
    assert not any(st._cache for o in (a.optimizer, b.optimizer) for st in o.state.values())
