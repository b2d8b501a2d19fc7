"""The precision a replay runs in: the fp16 loss scale it follows, bf16 parameters on fp32
masters, and what the run's own record says of both (replay/precision.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptforensics.engine.replay.run import ReplayConfig, replay
from fixtures.zoo import fp16_nanogpt
from tests.conftest import truth

MODEL = "fixtures/tinygpt.py:factory"


def _replay(run: Path, before: int, batch: Path | None = None) -> tuple[object, int, int]:
    cfg = ReplayConfig(
        before=run / f"step_{before}.pt",
        after=run / f"step_{before + 10}.pt",
        model=MODEL,
        batch=str(batch or run / "batches.h5"),
    )
    r = replay(cfg)
    assert r.matches is not None
    return r, sum(m.mismatched for m in r.matches), sum(m.numel for m in r.matches)


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp16")
    return {
        "bare": fp16_nanogpt(root),
        "logged": fp16_nanogpt(root, logged=True),
        "recorded": fp16_nanogpt(root, record=True),
    }


@pytest.mark.parametrize("before", [20, 40])
def test_fp16_run_without_scaler_state_or_logged_scale_lands_on_after(
    fp16_runs: dict[str, Path], before: int
) -> None:
    """karpathy/nanoGPT saves no GradScaler state and logs no scale. The window 20-30 skips
    a step mid-window; in 40-50 the scale grew inside the window and the next step
    overflowed. A fresh GradScaler (65536) skipped other steps: 0.2% and 81% of elements
    missed *after*. The calibrated scale skips the run's steps and lands on it."""
    run = fp16_runs["bare"]
    r, bad, n = _replay(run, before)
    assert (
        r.precision == "fp16"
        and r.config["precision"]["source"] == "checkpoint config dtype='float16'"
    )
    src = r.config["loss_scale"]["source"]
    assert src.startswith("calibrated") and "the run skipped 1 of its 10 steps" in src
    want = [s for s in truth(run)["skipped_steps"] if before < s <= before + 10]
    assert [x.step for x in r.records if x.skipped] == want
    assert bad == 0, f"{bad}/{n} elements miss after ({src})"


def test_fp16_scale_from_the_training_log(fp16_runs: dict[str, Path]) -> None:
    """A log with each step's scale (the one it used) and grad norm: followed step by step;
    which reading of the log holds is read from where its skipped steps (infinite grad
    norms) fall."""
    run = fp16_runs["logged"]
    r, bad, n = _replay(run, 40)
    assert r.config["loss_scale"]["source"].startswith(
        "training log loss_scale per step (the scale each step used"
    )
    t = truth(run)
    assert [x.step for x in r.records if x.skipped] == [44]
    assert all(x.loss_scale == t["loss_scales"][str(x.step)] for x in r.records)
    assert bad == 0, f"{bad}/{n}"


def test_fp16_scale_from_the_flight_recorder(fp16_runs: dict[str, Path]) -> None:
    """The flight recorder's /loss_scale is the scale update() left after each step: the
    replay reads that from the data (the first drop follows no replayed overflow)."""
    run = fp16_runs["recorded"]
    r, bad, n = _replay(run, 40, batch=run / "flight")
    assert r.config["loss_scale"]["source"].startswith("batch log /loss_scale per step")
    t = truth(run)
    assert [x.step for x in r.records if x.skipped] == [44]
    assert all(x.loss_scale == t["loss_scales"][str(x.step)] for x in r.records)
    assert bad == 0, f"{bad}/{n}"


@pytest.fixture(scope="module")
def deepspeed_bf16_draw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A drawn run on DeepSpeed's engine in its bf16 (ZeRO-2, 2 gloo ranks, a healthy window)."""
    pytest.importorskip("deepspeed")
    from fixtures.draws import build_draw, draw

    d = draw(1115)
    assert (d.trainer, d.mp_policy, d.zero_stage, d.cause) == ("deepspeed", "bf16", 2, "none")
    return build_draw(1115, tmp_path_factory.mktemp("ds-bf16"))


def test_deepspeed_bf16_replays_on_its_fp32_masters_and_lands_on_after(
    deepspeed_bf16_draw: Path, tmp_path: Path
) -> None:
    """DeepSpeed's bf16 steps fp32 master weights kept in the optimizer partitions: the replay
    starts from them, computes in bf16 as `ds_config` says, and lands on *after*'s masters
    (an fp32 replay of the bf16 module weights missed them)."""
    import json

    from click.testing import CliRunner

    from ckptforensics.cli import cli
    from tests.conftest import draw_args

    run = deepspeed_bf16_draw
    r = CliRunner().invoke(
        cli, ["-q", *draw_args(run), "--out", str(tmp_path / "rep")], catch_exceptions=False
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    cfg = doc["replay"]["config"]["precision"]
    assert cfg["value"] == "bf16-params" and cfg["source"].startswith("ds_config bf16.enabled")
    rep = doc["replay"]["reproduction"]
    assert rep["mismatched"] <= 0.01 * rep["elements"], rep
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"
