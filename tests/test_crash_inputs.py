"""The four inputs issue 26 found escaping as tracebacks (exit 1), as real runs
(fixtures/crash_inputs.py, the zoo): each now ends in one line and exit 2 (bad input) or 3 (a
fault of the tool), or is read; never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli


@pytest.fixture(scope="session")
def crash_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures.crash_inputs import adafactor_run, hf_collator_run

    root = tmp_path_factory.mktemp("crash-inputs")
    return {
        "adafactor": adafactor_run(root / "adafactor"),
        "hf-collator": hf_collator_run(root / "hf-collator"),
    }


def _no_traceback(r: Any, codes: tuple[int, ...]) -> list[str]:
    """The result's exit code is one of `codes`; a failure is one `error:` line (library
    notices such as DeepSpeed's accelerator line may precede it), never a traceback."""
    assert r.exit_code in codes, (r.exit_code, r.output)
    assert (
        "Traceback" not in r.output
        and not isinstance(r.exception, Exception)
        or isinstance(r.exception, SystemExit)
    ), r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == (1 if r.exit_code else 0), r.stderr
    return errors


def test_a_symlink_loop_in_a_checkpoint_directory(zoo: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(zoo["hf-trainer"], run)
    (run / "checkpoint-40" / "model-00002-of-00002.safetensors").symlink_to("loop")
    (run / "checkpoint-40" / "loop").symlink_to("model-00002-of-00002.safetensors")
    for args in (
        ["inspect", "--run-dir", str(run), "40"],
        ["diff", "--run-dir", str(run), "--before", "30", "--after", "40"],
    ):
        (line,) = _no_traceback(CliRunner().invoke(cli, args), (2,))
        assert (
            "incomplete hf-trainer checkpoint" in line
            and "loop: a symlink loop" in line
            and "model-00002-of-00002.safetensors: a symlink loop" in line
        )


def test_an_optimizer_whose_hyper_parameters_are_not_floats(crash_inputs: dict[str, Path]) -> None:
    """transformers' Adafactor saves `eps` as a pair: read (as unknown), never a TypeError."""
    run = crash_inputs["adafactor"]
    r = CliRunner().invoke(cli, ["inspect", str(run / "step_2.pt")])
    _no_traceback(r, (0,))
    assert "optimizer:" in r.output
    _no_traceback(
        CliRunner().invoke(
            cli, ["diff", "--before", str(run / "step_1.pt"), "--after", str(run / "step_2.pt")]
        ),
        (0, 2),
    )


@pytest.mark.parametrize("data,codes", [("data", (0, 2, 3)), ("data-shuffled", (2, 3))])
def test_an_hf_data_run_whose_collator_pads(
    crash_inputs: dict[str, Path], data: str, codes: tuple[int, ...]
) -> None:
    """Rows of varying length padded per batch by the run's collator, and a shuffled copy of
    that dataset (whose rebuilt batches cannot match the run's): one line, never a traceback.
    Exit 3 until the replay rebuilds padding collators' batches (replay/hfdata.py)."""
    run = crash_inputs["hf-collator"]
    args = [
        "-q",
        "replay",
        "--run-dir",
        str(run / "run"),
        "--before",
        "5",
        "--after",
        "10",
        "--data",
        str(run / data),
    ]
    r = CliRunner().invoke(cli, args)
    errors = _no_traceback(r, codes)
    if r.exit_code == 3:
        assert errors[0].startswith("error: internal error while replaying ") and errors[
            0
        ].endswith("run with --debug and report it")


def test_under_torchrun_every_rank_prints_the_same_line(tmp_path: Path) -> None:
    """Two ranks of `diff` on LitGPT's own checkpoints, *after* holding a symlink loop:
    each rank refuses it with the same line and exit 2 (torchrun then adds its own report)."""
    import os

    from tests.conftest import ROOT, torchrun

    run = tmp_path / "run"
    for step in ("step-00000010", "step-00000020"):
        shutil.copytree(ROOT / "fixtures" / "data" / "litgpt-0.5" / step, run / step)
    (run / "step-00000020" / "lit_model.pth").unlink()
    (run / "step-00000020" / "lit_model.pth").symlink_to("lit_model.pth")
    args = [
        "-m",
        "ckptforensics.cli",
        "-q",
        "diff",
        "--run-dir",
        str(run),
        "--before",
        "10",
        "--after",
        "20",
        "--out",
        str(tmp_path / "out"),
    ]
    proc = torchrun(args, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    assert (
        len(errors) == 2 and errors[0] == errors[1] and "lit_model.pth: a symlink loop" in errors[0]
    ), proc.stderr[-2000:]
    assert "ckptforensics/" not in proc.stderr.replace(
        str(tmp_path), ""
    )  # no traceback through our code
    assert not (tmp_path / "out").exists()
