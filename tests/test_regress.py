"""`regress`: one state and batch under two versions of the model code, on the zoo's healthy
run (fixtures/zoo.py, step_30.pt and its batch log). The pairs are real model code that
differs in one module (fixtures/regress_models.py); each must be named at its module and
direction, identical code bitwise identical, nondeterminism alone equivalent."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

import ckptforensics as cf
from ckptforensics.cli import cli
from ckptforensics.engine.regress.compare import deltas
from fixtures.regress_models import EXPECTED
from fixtures.zoo import build

MODELS = "fixtures/regress_models.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("regress"), only=["healthy"])["healthy"]


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _regress(run: Path, a: str, b: str, **kw: object) -> cf.Report:
    return cf.regress(
        30,
        run_dir=run,
        batch=run / "batches.h5",
        model=f"{MODELS}:{a}",
        against_model=f"{MODELS}:{b}",
        **kw,
    )


@pytest.mark.parametrize(("a", "b"), list(EXPECTED))
def test_a_change_in_one_module_is_named_at_that_module_and_direction(
    run: Path, a: str, b: str
) -> None:
    module, direction = EXPECTED[(a, b)]
    rep = _regress(run, a, b)
    reg = rep.doc["regress"]
    assert reg["status"] == "parted"
    assert rep.verdict["first_anomalous_module"] == module
    assert reg["parting"]["module"] == module and reg["parting"]["direction"] == direction
    assert rep.cause == "code_change"
    assert reg["noise"]["floor"] == 0.0  # a CPU repeats itself bit for bit
    # every tensor before the parting one is bitwise equal
    first = next(i for i, m in enumerate(reg["modules"]) if m["exceeds"])
    assert all(m["bitwise_equal"] for m in reg["modules"][:first])


def test_identical_code_is_bitwise_identical_and_strict_passes(run: Path, tmp_path: Path) -> None:
    r = invoke(
        "regress", "--run-dir", str(run), "--step", "30", "--batch", str(run / "batches.h5"),
        "--model", "fixtures/tinygpt.py:factory", "--against-model", f"{MODELS}:factory",
        "--steps", "2", "--strict", "--out", str(tmp_path / "rep"),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    reg = doc["regress"]
    assert reg["status"] == "identical" and reg["parting"] is None
    assert [s["step"] for s in reg["steps"]] == [31, 32]
    assert all(s["loss_a"] == s["loss_b"] for s in reg["steps"])
    assert all(m["bitwise_equal"] for m in reg["modules"]) and reg["unmatched"] == []
    assert all(p["bitwise_equal"] for p in reg["params"])
    # the pass: forward and backward, inputs and outputs of every module
    assert {(m["phase"], m["side"]) for m in reg["modules"]} == {
        ("forward", "in"), ("forward", "out"), ("backward", "in"), ("backward", "out"),
    }  # fmt: skip
    assert doc["verdict"]["causes"][0]["cause"] == "none"
    assert doc["verdict"]["first_anomalous_module"] is None
    assert (tmp_path / "rep" / "evidence.h5").is_file()
    assert "bitwise identical" in (tmp_path / "rep" / "report.md").read_text()


def test_nondeterminism_alone_is_equivalent_not_parted(run: Path) -> None:
    """Both sides run the same head whose reductions take a new order on every call (no seed
    reaches it): A's two runs differ as B does; B stays within that noise."""
    rep = _regress(run, "nondet", "nondet", steps=2)
    reg = rep.doc["regress"]
    assert reg["status"] == "equivalent", reg["parting"]
    assert reg["noise"]["floor"] > 0
    assert not all(m["bitwise_equal"] for m in reg["modules"])
    assert rep.cause == "none" and rep.verdict["first_anomalous_module"] is None


def test_b_off_the_runs_logged_track_is_said(run: Path) -> None:
    """The head's logits scaled by 1.05: B's loss leaves the run's log on the first step,
    where A (the run's own model) lands on it."""
    rep = _regress(run, "factory", "logit_scale", steps=2)
    kinds = [f["kind"] for f in rep.doc["findings"]]
    assert kinds == ["regress_parted", "regress_off_track"]
    assert rep.doc["regress"]["check"]["a"]["first_miss"] is None
    assert rep.doc["regress"]["check"]["b"]["first_miss"] == 31
    assert all(s["exceeds"] for s in rep.doc["regress"]["steps"])
    assert "leaves the run's logged track at step 31" in rep.verdict["summary"]


def test_strict_exits_1_when_they_part_and_json_says_where(run: Path) -> None:
    r = invoke(
        "regress", "--run-dir", str(run), "--step", "30", "--batch", str(run / "batches.h5"),
        "--model", "fixtures/tinygpt.py:factory", "--against-model", f"{MODELS}:attn_scale",
        "--json", "--strict",
    )  # fmt: skip
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["regress"]["status"] == "parted"
    assert doc["verdict"]["first_anomalous_module"] == "transformer.h.0.attn"


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "NO AVX"),
    reason="ATEN_CPU_CAPABILITY=default changes nothing where torch already runs its default kernels",
)
def test_against_python_a_second_interpreter_with_a_numerics_knob(run: Path) -> None:
    """--against-python: a second interpreter of this same venv (no second venv in CI's
    budget). Unchanged, it is bitwise identical (the exchange through files loses nothing);
    with ATEN_CPU_CAPABILITY=default (PyTorch's documented knob for the CPU kernel set:
    plain C++ loops instead of AVX2/AVX-512, other summation orders) it parts at the first
    normalisation, in the forward: LayerNorm's reduction is the first op whose kernel
    changes (the embeddings are gathers and an add)."""
    same = cf.regress(
        30, run_dir=run, batch=run / "batches.h5", model="fixtures/tinygpt.py:factory",
        against_python=sys.executable,
    )  # fmt: skip
    assert same.doc["regress"]["status"] == "identical"
    knob = cf.regress(
        30, run_dir=run, batch=run / "batches.h5", model="fixtures/tinygpt.py:factory",
        against_python=sys.executable, against_env={"ATEN_CPU_CAPABILITY": "default"},
    )  # fmt: skip
    reg = knob.doc["regress"]
    assert reg["status"] == "parted"
    assert reg["parting"]["module"] == "transformer.h.0.ln_1"
    assert reg["parting"]["direction"] == "forward"
    assert reg["sides"]["b"]["environment"]["cpu_capability"] == "DEFAULT"
    assert reg["sides"]["b"]["env"] == {"ATEN_CPU_CAPABILITY": "default"}


def _bad(r: click.testing.Result, message: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0], lines[0]


def test_bad_input_is_one_line_and_exit_2(run: Path, tmp_path: Path) -> None:
    base = ["regress", "--run-dir", str(run), "--step", "30", "--batch", str(run / "batches.h5"),
            "--model", "fixtures/tinygpt.py:factory"]  # fmt: skip
    _bad(invoke(*base), "regress needs a side B: pass --against-model")
    _bad(
        invoke(*base, "--against-model", "fixtures/tinygpt.py:factory", "--against-env", "X=1"),
        "--against-env sets the worker's environment: pass --against-python too",
    )
    _bad(
        invoke(*base, "--against-python", sys.executable, "--against-env", "NOEQUALS"), "KEY=VALUE"
    )
    _bad(invoke(*base, "--against-model", f"{MODELS}:no_such_factory"), "no_such_factory")
    _bad(invoke(*base, "--against-python", str(tmp_path / "nope")), "nope")
    _bad(invoke(*base, "--against-model", f"{MODELS}:factory", "--steps", "0"), "--steps")
    # an interpreter that is not one: the worker's failure, in one line
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no module named torch' >&2\nexit 1\n")
    fake.chmod(0o755)
    _bad(invoke(*base, "--against-python", str(fake)), "the worker failed: no module named torch")


def test_help_teaches_with_an_example() -> None:
    r = invoke("regress", "--help")
    assert r.exit_code == 0
    assert (
        "Example" in r.output and "--against-model" in r.output and "--against-python" in r.output
    )


def test_compare_counts_ulps_and_bits() -> None:
    a = torch.tensor([1.0, -2.0, 0.0, float("nan"), 3.0])
    b = a.clone()
    b[0] = torch.nextafter(a[0], torch.tensor(2.0))
    b[1] = torch.nextafter(torch.nextafter(a[1], torch.tensor(0.0)), torch.tensor(0.0))
    b[2] = -0.0
    [d] = deltas([(a, b)])
    assert d.max_ulps == 2 and d.differing == 3 and d.nonfinite == 0
    assert d.max_abs == pytest.approx(2 * 2**-23)  # below 2.0 an ulp is 2^-23
    [same] = deltas([(a, a.clone())])
    assert same.identical
    [inf] = deltas([(a, torch.where(a.isnan(), 0.0, a))])  # NaN where the other is finite
    assert inf.nonfinite == 1 and inf.max_abs == float("inf")
    [half] = deltas([(a.to(torch.bfloat16), b.to(torch.bfloat16))])
    assert half.max_ulps == 0 and half.differing == 1  # -0 against +0: bits, not value
