"""Drawn incident runs (fixtures/draws.py): a small fixed subset of the tuning split.

Each draw is a fresh training run of its own shape; the tool must name what the draw
planted. The held-out split is only scored (`make zoo-heldout`, bench/RESULTS.md).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptforensics.engine.triage import find_metrics, read_metrics, triage

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fixtures.draws import GROUP0_LR_ONLY, TUNING, draw, log_onset  # noqa: E402
from tests.conftest import SUBSET  # noqa: E402


def test_the_subset_is_of_the_tuning_split_and_covers_every_cause() -> None:
    assert set(SUBSET) <= set(TUNING)
    assert {draw(s).cause for s in SUBSET} == {
        "none",
        "poison_batch",
        "lr_too_high",
        "gradient_explosion",
    }


@pytest.mark.parametrize("seed", SUBSET)
def test_drawn_incident_is_named(draws: dict[int, Path], draw_report: Any, seed: int) -> None:
    run = draws[seed]
    t = json.loads((run / "truth.json").read_text())
    doc = draw_report(run)
    v = doc["verdict"]
    conf = [c["confidence"] for c in v["causes"]]
    assert conf == sorted(conf, reverse=True), v["causes"]  # ranked by the confidence shown
    assert v["causes"][0]["cause"] == t["cause"], v["summary"]
    assert v["first_bad_step"] == t["first_bad_step"]
    log = find_metrics(run)  # HF Trainer draws: the Trainer's own trainer_state.json
    assert log is not None
    onset = triage(log, run).first_bad_step
    at = t["first_bad_step"]
    if t["draw"]["trainer"] in GROUP0_LR_ONLY and t["cause"] == "gradient_explosion":
        # The trainer logs group 0's LR only: the log shows the fault from its first effect.
        rows = read_metrics(log)
        last = log_onset(
            {s: r["loss"] for s, r in rows.items()},
            {s: r["grad_norm"] for s, r in rows.items()},
            at,
        )
        assert onset is not None and at <= onset <= (last or at), (onset, at, last)
    else:
        assert onset == at
    if t["samples"]:
        assert sorted(s["index"] for s in v["anomalous_samples"]) == t["samples"]
    if t["layers"]:
        culprit = v["first_anomalous_module"] or v["exploding_layers"][0]
        assert any(
            culprit == m or culprit.startswith(m + ".") or m.startswith(culprit + ".")
            for m in t["layers"]
        ), culprit
    if t["cause"] == "none":
        assert not [f for f in doc["findings"] if f["severity"] != "info"], doc["findings"]


def test_a_spike_on_a_falling_loss_is_an_onset(draws: dict[int, Path]) -> None:
    """Draw 1002 spikes while its loss is still falling fast: the trend, not the last 128
    steps' median, is the baseline, so the spike step is the onset."""
    run = draws[1002]
    t = json.loads((run / "truth.json").read_text())
    losses = {int(k): v for k, v in t["losses"].items()}
    at = t["first_bad_step"]
    assert losses[at - 1] < 0.8 * losses[max(1, at - 40)]  # still descending
    log = find_metrics(run)
    assert log is not None
    assert triage(log, run).first_bad_step == at


def test_scaler_backoffs_in_a_log_without_a_loss_scale_column_are_routine(
    draws: dict[int, Path], tmp_path: Path
) -> None:
    """Draw 1015 trains in fp16 with routine backoffs, the last 6 steps before its log ends.
    Written by TensorBoard's writer as the HF Trainer's tags (`draws._tensorboard_log`), the
    log has no loss-scale column: its scaler shows only as non-finite grad norms whose next
    loss is finite, and the last of them, too near the end for the loss to answer, is still
    the scaler's routine, not an onset (held-out draw 12115's false alarm)."""
    import shutil

    from ckptforensics.detectors.log.evidence import SKIPS_FOR_SCALER, skipped_overflows
    from fixtures.draws import _tensorboard_log

    run = tmp_path / "tb"
    shutil.copytree(draws[1015], run)
    rows = read_metrics(run / "metrics.jsonl")
    skips = [s for s, r in rows.items() if not math.isfinite(r.get("grad_norm", 0.0))]
    assert len(skips) >= SKIPS_FOR_SCALER and max(rows) - skips[-1] < 8  # inside LOSS_FOLLOW // 2
    _tensorboard_log(run)
    log = find_metrics(run)
    assert log is not None and "tfevents" in log.name
    tb = read_metrics(log)
    assert not any("loss_scale" in r for r in tb.values())
    assert skipped_overflows(tb) == len(skips)
    assert triage(log, run).first_bad_step is None


def test_lightning_logs_and_checkpoints_are_found_where_lightning_puts_them(
    draws: dict[int, Path],
) -> None:
    """Draw 1002 is Lightning's default layout: checkpoints in
    lightning_logs/version_0/checkpoints, the CSVLogger's metrics.csv, which logs optimizer
    step s under step s - 1; the tool's step s must be the trainer's step s."""
    from ckptforensics.formats.locate import list_checkpoints

    run = draws[1002]
    t = json.loads((run / "truth.json").read_text())
    assert t["draw"]["trainer"] == "lightning"
    found = dict(list_checkpoints(run))
    assert {t["before"], t["after"]} <= set(found) and all(
        p.suffix == ".ckpt" for p in found.values()
    )
    log = find_metrics(run)
    assert log is not None and log.name == "metrics.csv"
    rows = read_metrics(log)
    for s, loss in t["losses"].items():
        assert rows[int(s)]["loss"] == pytest.approx(loss, rel=1e-6)
    assert all("grad_norm" in r for r in rows.values() if "loss" in r)


def test_blips_the_loss_ignores_are_not_onsets_on_a_long_quiet_run(tmp_path: Path) -> None:
    """1010 quiet steps, grad-norm blips (x4) at 578 and 640 that the loss ignores, junk rows
    at 1001: the onset is 1001 and the rollback the checkpoint just before it, not 500."""
    from fixtures.tinygpt import GPTConfig
    from fixtures.zoo import SEEN, Run, train

    def junk(ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clone()
        ids[:6] = torch.randint(0, SEEN, ids[:6].shape, generator=torch.Generator().manual_seed(0))
        return ids

    run = Run(
        name="quiet",
        out=tmp_path / "quiet",
        steps=1010,
        save_every=100,
        lr=lambda s: 3e-3 * min(1.0, s / 20),
        cfg=GPTConfig(n_layer=1, n_embd=16, n_head=2),
        grad_scale={"": lambda s: 4.0 if s in (578, 640) else 1.0},
        poison={1001: junk},
    )
    train(run)
    assert (
        run.grad_norms[578] > 2.5 * run.grad_norms[577]
        and run.losses[1001] > 1.5 * run.losses[1000]
    )
    res = triage(run.out / "metrics.jsonl", run.out)
    assert res.first_bad_step == 1001, [o.message for o in res.onsets]
    assert res.rollback_step == 1000
    assert {o.step for o in res.ignored} >= {578, 640}
    assert all(math.isfinite(o.value) for o in res.ignored)


@pytest.mark.parametrize("seed", [1002, 1052])
def test_the_flight_recorder_replays_as_the_batch_log_does(
    draws: dict[int, Path], draw_report: Any, seed: int
) -> None:
    """Draw 1002 carries the recorder's Lightning callback, 1052 the plain-loop calls on
    each of its two FSDP2 ranks: the recorder's segments (two ranks' rows merged into the
    global batch) give the verdict the run's own batch log gives."""
    run = draws[seed]
    ref, got = draw_report(run), draw_report(run, batch="flight")
    for k in ("first_bad_step", "reproducible", "first_anomalous_module"):
        assert got["verdict"][k] == ref["verdict"][k], k
    assert got["verdict"]["causes"][0]["cause"] == ref["verdict"]["causes"][0]["cause"]
    assert [s["index"] for s in got["verdict"]["anomalous_samples"]] == [
        s["index"] for s in ref["verdict"]["anomalous_samples"]
    ]
    assert got["replay"]["config"]["lr"]["source"] == "batch log /lr"
    assert "flight recorder" in got["replay"]["config"]["batches"]["value"]
    # triage on the recorder's log puts the onset on the planted step: where the run's own
    # log shows group 0's LR only (1052, FSDP2), the recorder's every group's, so its onset
    # is the fault's own step, never later than the run's log puts it.
    log = find_metrics(run)
    assert log is not None
    t = json.loads((run / "truth.json").read_text())
    got = triage(run / "flight" / "metrics.jsonl", run).first_bad_step
    assert got == t["first_bad_step"]
    assert got <= triage(log, run).first_bad_step


def test_megatron_draws_keep_their_window_restart_and_poison_in_shape() -> None:
    """The Megatron axis (fixtures/draws_megatron.py) draws what its runs can be: the incident
    inside a saved window, a restart that crashes inside it and relaunches from its first
    checkpoint, poison a minority of the global batch, read from the indexed dataset."""
    from fixtures.draws import HELDOUT_RESUMES_3, MEGATRON_TUNING
    from fixtures.draws_megatron import GLOBAL_BATCH, _crash

    drawn = [d for d in map(draw, MEGATRON_TUNING + HELDOUT_RESUMES_3) if d.trainer == "megatron"]
    assert {d.cause for d in drawn} == {"none", "poison_batch", "lr_too_high"}
    assert all(d.seed in MEGATRON_TUNING for d in drawn[: len(MEGATRON_TUNING)])
    for d in drawn:
        saves = range(d.save_every, d.steps + 1, d.save_every)
        before = max(s for s in saves if s < d.at)
        assert any(before < s for s in saves) and d.at <= d.steps, d.seed
        crash = _crash(d)
        assert crash is None or before < crash < before + d.save_every, d.seed
        if d.cause == "poison_batch":
            assert d.megatron_data and 0 < len(d.rows) <= GLOBAL_BATCH // 2, d.seed


def test_own_loop_layouts_are_drawn_with_their_optimizers() -> None:
    """Issue #44's own-loop layouts (`_draw_layout`) on the third families splits: a Muon run
    saved as modded-nanogpt saves, a Lion run as lion-pytorch's loop, others as `ckpt_N.pt` /
    `model_N.pt`; never on an fp16 or resumed run; and a poisoned batch there escalates to half
    the batch at most."""
    from fixtures.draws import FAMILY_TUNING_2, HELDOUT_FAMILIES_3, Draw, _stronger

    drawn = [d for d in map(draw, FAMILY_TUNING_2 + HELDOUT_FAMILIES_3) if d.layout]
    assert {d.layout for d in drawn} == {"modded", "lion", "ckpt", "model"}
    for d in drawn:
        assert d.trainer == "own" and d.precision != "fp16" and d.resume == "none", d.seed
        assert d.optimizer == {"modded": "muon", "lion": "lion"}.get(d.layout, d.optimizer)
        assert not (d.optimizer == "muon" and d.cause == "gradient_explosion"), d.seed
    d = Draw(seed=HELDOUT_FAMILIES_3[0], cause="poison_batch", n_layer=1, n_embd=16, n_head=2,
             tied=True, seq=32, batch=8, schedule="constant", warmup=5, peak=1e-3,
             position="mid_descent", steps=40, at=30, save_every=10, fmt="torch",
             precision="fp32", natural_runs=0.0, trap="none", rows=[2])  # fmt: skip
    for _ in range(4):
        _stronger(d)
    assert len(d.rows) == d.batch // 2
