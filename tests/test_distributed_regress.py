"""`regress` under torchrun (2 gloo ranks, FSDP2) on the zoo's healthy run: the single-process
report, rank 0 its only writer.

Each rank steps its 4 of the batch's 8 rows on its FSDP2 shards and compares its own rows of
the pass and its own shards; the comparison rows merge across the ranks. What may differ
from one process, and why (measured on this fixture):
- `regress.config.distributed`: only under torchrun (how it ran);
- each step's loss and grad norm (`steps`, `check`): the ranks' shares are summed in another
  order (relative 1e-7 measured, 1e-5 allowed);
- where B differs from A, the gradient at a tensor every rank holds whole (the position
  embedding's [T, C] output, `backward.out:transformer.wpe`): each rank holds the sum over its
  rows only, so its differences are the ranks' (its verdict the same), and the parameters after
  the step (the summed gradient's last bits, so a few elements' bits and ulps).
Every other figure is equal to the bit: a module's input, output and the gradients at them
are computed row by row, so each rank's rows are one process's rows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptforensics as cf
from fixtures.regress_models import EXPECTED
from fixtures.zoo import build
from tests.conftest import ranks_said, torchrun

MODELS = "fixtures/regress_models.py"
REL = 1e-5  # a figure the ranks sum in another order (measured: 1e-7)
WHOLE = "backward.out:transformer.wpe"  # held whole by every rank: each its rows' sum


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("dregress"), only=["healthy"])["healthy"]


def _args(run: Path, b: str, *more: str) -> list[str]:
    return [
        "-m", "ckptforensics.cli", "-q", "regress", "--run-dir", str(run), "--step", "30",
        "--batch", str(run / "batches.h5"), "--model", "fixtures/tinygpt.py:factory",
        "--against-model", f"{MODELS}:{b}", *more,
    ]  # fmt: skip


def _two(run: Path, b: str, *more: str) -> subprocess.CompletedProcess:
    return torchrun(_args(run, b, *more), {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=200)


def _one(run: Path, b: str, steps: int = 1) -> dict[str, Any]:
    rep = cf.regress(
        30, run_dir=run, batch=run / "batches.h5", model="fixtures/tinygpt.py:factory",
        against_model=f"{MODELS}:{b}", steps=steps,
    )  # fmt: skip
    return rep.doc


def _close(x: float, y: float) -> bool:
    return x == y or abs(x - y) <= REL * max(abs(x), abs(y))


def _summed_in_another_order(one: dict[str, Any], two: dict[str, Any]) -> None:
    """Each step's loss and grad norm, in `steps` and in each side's check against the log:
    within float noise, popped so that the rest compares to the bit."""
    for s1, s2 in zip(one["steps"], two["steps"], strict=True):
        for k in ("loss_a", "loss_b", "loss_a2", "grad_norm_a", "grad_norm_b", "grad_norm_a2"):
            assert _close(s1.pop(k), s2.pop(k)), (s1["step"], k)
    for side in ("a", "b"):
        for s1, s2 in zip(one["check"][side]["steps"], two["check"][side]["steps"], strict=True):
            for k in ("loss", "grad_norm", "logged_loss", "logged_grad_norm"):
                x, y = s1.pop(k, None), s2.pop(k, None)
                assert x == y or (isinstance(x, float) and _close(x, y)), (side, k, x, y)


def _how_it_ran(two: dict[str, Any]) -> None:
    dist = two["regress"]["config"].pop("distributed")
    assert dist["value"]["world_size"] == 2 and dist["source"] == "torchrun"
    assert dist["value"]["backend"] == "gloo"


def test_identical_code_on_two_ranks_is_the_single_process_report(
    run: Path, tmp_path: Path
) -> None:
    """Identical code, two steps: bitwise identical on both ranks' rows and shards, the report
    one process writes but for how it ran and the last bits of each step's loss."""
    proc = _two(run, "factory", "--steps", "2", "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, ranks_said(proc.stderr)
    assert proc.stdout.count("Regress from step_30.pt") == 1  # rank 0 alone speaks
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    one = _one(run, "factory", steps=2)
    _how_it_ran(two)
    assert two["regress"]["status"] == "identical" and two["regress"]["parting"] is None
    _summed_in_another_order(one["regress"], two["regress"])
    for doc in (one, two):
        doc["incident"].pop("command")  # the command line differs by --out, and so
        doc["incident"].pop("report_dir", None)  # does the report's own folder
    assert one == two
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [
        "evidence.h5", "report.html", "report.json", "report.md",
    ]  # fmt: skip


def test_gelu_tanh_on_two_ranks_parts_where_one_process_does(run: Path) -> None:
    """GELU exact against tanh: parted at the MLP, in the forward, with one process's figures
    for every tensor of the pass but the one every rank holds whole."""
    module, direction = EXPECTED[("factory", "gelu_tanh")]
    proc = _two(run, "gelu_tanh", "--json")
    assert proc.returncode == 0, ranks_said(proc.stderr)
    two = json.loads(proc.stdout)  # one document: rank 1 writes nothing
    one = _one(run, "gelu_tanh")
    _how_it_ran(two)
    r1, r2 = one["regress"], two["regress"]
    assert r2["status"] == "parted" and two["verdict"]["first_anomalous_module"] == module
    assert (r2["parting"]["module"], r2["parting"]["direction"]) == (module, direction)
    assert r2["parting"] == r1["parting"]  # its figures to the bit
    assert two["verdict"] == one["verdict"]
    _summed_in_another_order(r1, r2)
    assert r1["steps"] == r2["steps"] and r1["check"] == r2["check"]
    whole = [
        (a, b) for a, b in zip(r1["modules"], r2["modules"], strict=True) if a["tensor"] == WHOLE
    ]
    assert [a for a, _ in whole] != [] and all(
        a["numel"] == b["numel"] and a["shape"] == b["shape"] and a["exceeds"] == b["exceeds"]
        for a, b in whole
    )
    rest = [
        (a, b) for a, b in zip(r1["modules"], r2["modules"], strict=True) if a["tensor"] != WHOLE
    ]
    assert all(a == b for a, b in rest), next(a["tensor"] for a, b in rest if a != b)
    # the parameters after the step: the summed gradient's last bits
    for a, b in zip(r1["params"], r2["params"], strict=True):
        assert a["name"] == b["name"] and a["numel"] == b["numel"] and a["exceeds"] == b["exceeds"]
        assert math.isclose(a["max_abs"], b["max_abs"], rel_tol=0.1, abs_tol=1e-9), a["name"]
        assert abs(a["differing"] - b["differing"]) <= max(2, 0.01 * a["numel"]), a["name"]


def test_against_python_under_torchrun_is_refused_in_one_line(run: Path) -> None:
    """--against-python runs B in one worker process: under torchrun every rank says so."""
    args = _args(run, "factory")
    args = args[: args.index("--against-model")] + ["--against-python", sys.executable]
    proc = torchrun(args, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=200)
    assert proc.returncode != 0
    said = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(said) == 2, ranks_said(proc.stderr)
    assert all("--against-python runs side B in one worker process" in ln for ln in said)
    assert "Traceback" not in ranks_said(proc.stderr)
