"""A replay that misses the run's log is a question (issue #42): the explanations the run's
files name are replayed from the same state, the one that lands is the finding, and hardware
is named only where none is left open. Each run here is written by real training code: the HF
Trainer's own resume path with the optimizer's state left out (fixtures/hf_resume_run.py), and
drawn own-loop incidents (fixtures/draws.py) whose log lost some of its LR column."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from fixtures import hf_resume_run
from fixtures.draws import build_draw
from tests.conftest import draw_args, truth

pytest.importorskip("transformers")


def _replay(args: list[str]) -> dict:
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    return json.loads(r.output[r.output.index("{") :])


def _causes(doc: dict) -> list[str]:
    return [c["cause"] for c in doc["verdict"]["causes"]]


def _drop_lr(run: Path, steps: set[int] | None) -> None:
    """The run's log without its LR columns at `steps` (every step where None), as a log that
    lost them (a restarted leg's first line, a logger that does not log the LR)."""
    log = run / "metrics.jsonl"
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    for r in rows:
        if steps is None or r["step"] in steps:
            for k in [k for k in r if k == "lr" or k.startswith("optim/LR")]:
                del r[k]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def hf_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_resume_run.build(tmp_path_factory.mktemp("hf-resume"))


def test_an_hf_trainer_weights_only_resume_is_reproduced_by_a_fresh_optimizer(
    hf_resumed: Path,
) -> None:
    """The replay as planned steps before's saved AdamW and parts from the log; the fresh
    optimizer the step counters name lands on every logged step: optimizer_state_lost,
    reproduced, never a hardware fault."""
    t = truth(hf_resumed)
    doc = _replay(
        ["replay", "--run-dir", str(hf_resumed), "--before", "60", "--after", "70"]
        + ["--batch", str(hf_resumed / "batches.h5")]
    )
    v = doc["verdict"]
    assert _causes(doc)[0] == t["cause"] == "optimizer_state_lost"
    assert "silent_corruption" not in _causes(doc)
    assert v["first_bad_step"] == t["first_bad_step"] == 61
    assert Path(v["rollback_checkpoint"]).name == t["rollback"]
    assert v["replay_check"]["status"] == "matched"
    planned, *tried = doc["replay"]["variants"]
    assert planned["name"] == "as planned" and not planned["lands"] and planned["first_miss"] > 61
    landed = [x for x in tried if x["lands"]]
    assert [x["cause"] for x in landed] == ["optimizer_state_lost"]
    assert "step 61" in landed[0]["name"] and landed[0]["matched_to"] == 70
    assert "fresh from step 61" in doc["replay"]["config"]["optimizer"]["value"]


@pytest.fixture(scope="module")
def lr_jump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Draw 1010: an own loop whose LR jumps at step 46 (the log states it)."""
    return build_draw(1010, tmp_path_factory.mktemp("lr-jump"))


def test_an_lr_the_log_states_on_all_but_one_step_is_replayed_as_the_log_states_it(
    lr_jump: Path, tmp_path: Path
) -> None:
    """One window step's LR missing from the log (Megatron's restarted legs left such a gap):
    the plan falls back to before's stored LR, does not spike and misses the log; the LR as
    the log states it, carried over the gap, lands: lr_too_high at its step, not hardware."""
    run = tmp_path / "run"
    shutil.copytree(lr_jump, run)
    t = truth(run)
    _drop_lr(run, {t["before"] + 1})
    doc = _replay(draw_args(run))
    v = doc["verdict"]
    assert _causes(doc)[0] == t["cause"] == "lr_too_high"
    assert "silent_corruption" not in _causes(doc)
    assert v["first_bad_step"] == t["first_bad_step"]
    tried = doc["replay"]["variants"]
    assert [x["name"] for x in tried if x["lands"]] == ["the LR as the run's log states it"]
    assert doc["replay"]["config"]["lr"]["source"].startswith("training log lr as logged")


@pytest.fixture(scope="module")
def fault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Draw 1106: one step's forward computes garbage in one MLP, once (a hardware fault)."""
    return build_draw(1106, tmp_path_factory.mktemp("fault"))


def test_a_spike_the_replay_misses_is_hardware_only_where_nothing_else_is_open(
    fault: Path, tmp_path: Path
) -> None:
    """With every step's LR in the log, the spike the replay from the same state does not
    reproduce is a fault (silent_corruption at its step). The same run whose log keeps no LR:
    an LR fault is not excluded, so the report says not reproduced, unexplained, and names
    what it could not exclude; it does not blame the hardware."""
    t = truth(fault)
    doc = _replay(draw_args(fault))
    assert _causes(doc)[0] == t["cause"] == "silent_corruption"
    assert doc["verdict"]["first_bad_step"] == t["first_bad_step"]
    assert doc["verdict"]["replay_check"]["status"] == "not_reproduced"
    run = tmp_path / "run"
    shutil.copytree(fault, run)
    _drop_lr(run, None)
    doc = _replay(draw_args(run))
    v = doc["verdict"]
    assert "silent_corruption" not in _causes(doc)
    assert v["replay_check"]["status"] == "unexplained"
    assert "not in the run's log" in v["replay_check"]["reason"]
    assert "hardware" not in " ".join(v["recommended_actions"]).lower()


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's poisoned batch: rows 1, 4 and 6 of step 35 are junk."""
    from fixtures.zoo import poison_batch

    return poison_batch(tmp_path_factory.mktemp("poison"))


def test_culprit_rows_are_the_rows_the_spike_needs(poisoned: Path) -> None:
    """Each flagged row removed alone from the spiking batch, from the replayed state before
    it: the planted rows each take their share of the spike and are culprits; a clean row
    added to the flagged ones takes next to nothing and is listed apart as unusual. The
    replay's finding becomes replayed evidence that the rows carry the spike (poison_batch)."""
    from ckptforensics.commands.common import replay_config
    from ckptforensics.core.options import replay_options
    from ckptforensics.detectors import replay_findings
    from ckptforensics.detectors.replay.rows import confirmed
    from ckptforensics.engine.bisect import confirm_rows
    from ckptforensics.engine.replay.run import replay
    from ckptforensics.verdict_evidence import replay_fields

    t = truth(poisoned)
    planted = sorted(t["samples"])
    cfg = replay_config(
        t["before"], t["after"], str(poisoned / "batches.h5"), poisoned,
        replay_options(None, model="fixtures/tinygpt.py:factory"), None,
    )  # fmt: skip
    rep = replay(cfg)
    f = next(x for x in replay_findings(rep) if x.kind == "anomalous_samples")
    assert sorted(f.metrics["rows"]) == planted
    clean = next(i for i in range(8) if i not in planted)
    check = confirm_rows(rep, f.metrics["step"], [*planted, clean])
    assert check is not None and check.removes_spike
    assert check.culprits == planted and check.unusual == [clean]
    g = confirmed(f, confirm_rows(rep, f.metrics["step"], planted))
    assert g.primary and g.severity == "critical" and g.supports == ("poison_batch",)
    assert sorted(g.metrics["rows"]) == planted and "removes the spike" in g.message
    # Had the clean row been flagged too, the verdict names it apart from the culprits: unusual,
    # not needed by the spike (the report's "Also unusual" table, what a scorer counts as found).
    flagged = {**f.metrics["samples"][0], "index": clean, "why": "its loss stands out"}
    h = confirmed(
        dataclasses.replace(
            f, metrics={**f.metrics, "samples": [*f.metrics["samples"], flagged], "rows": [*planted, clean]}
        ),
        check,
    )  # fmt: skip
    fields = replay_fields([h])
    assert sorted(x["index"] for x in fields["anomalous_samples"]) == planted
    assert [x["index"] for x in fields["unusual_samples"]] == [clean]


@pytest.fixture(scope="module")
def group_lr_fp16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures import group_lr_fp16

    return group_lr_fp16.build(tmp_path_factory.mktemp("group-lr-fp16"))


def test_a_group_lr_that_ends_in_an_fp16_overflow_is_the_root_and_the_overflow_its_symptom(
    group_lr_fp16: Path,
) -> None:
    """The group's LR is the cause (lr_too_high, its modules, dated since the window's start
    or before); the fp16 overflow of its c_proj is named as its consequence, and the first
    bad step is where the run left its track, not the window's first step."""
    t = truth(group_lr_fp16)
    doc = _replay(draw_args(group_lr_fp16))
    v = doc["verdict"]
    assert _causes(doc)[0] == t["cause"] == "lr_too_high"
    assert "fp16_overflow" in _causes(doc)[:3]
    assert v["first_bad_step"] == t["first_bad_step"] > t["before"] + 1
    assert v["first_anomalous_module"] == t["overflow_module"]
    lead = next(f for f in doc["findings"] if f["kind"] == "lr_above_schedule")
    assert lead["supports"] == ["lr_too_high"]
    assert lead["metrics"]["consequence"]["step"] == t["first_bad_step"]
    assert f"the root of the fp16 overflow of {t['overflow_module']}" in v["summary"]


@pytest.mark.parametrize(
    "seed", [1401, 1428], ids=["weights-only-resume-tensorboard", "poison-tensorboard"]
)
def test_drawn_resumes_and_tensorboard_logs(seed: int, tmp_path: Path) -> None:
    """Issue #42's draw axes (fixtures/draws.py `_draw_misses`): an own loop restarted at the
    window's first checkpoint with its weights only, its log written by TensorBoard's
    SummaryWriter in two legs (1401), and a poisoned run whose LR and loss are only in
    TensorBoard (1428): the cause, the first bad step and the rows as planted."""
    from fixtures.draws import draw

    d = draw(seed)
    assert d.log == "tensorboard" and d.resume == ("weights_only" if seed == 1401 else "none")
    run = build_draw(seed, tmp_path)
    t = truth(run)
    assert not (run / "metrics.jsonl").exists() and len(list((run / "runs").iterdir())) >= 1
    doc = _replay(draw_args(run))
    v = doc["verdict"]
    assert _causes(doc)[0] == t["cause"]
    assert v["first_bad_step"] == t["first_bad_step"]
    assert "silent_corruption" not in _causes(doc)
    if t["samples"]:
        assert sorted(x["index"] for x in v["anomalous_samples"]) == sorted(t["samples"])
    assert doc["replay"]["config"]["metrics"]["value"] is not None  # the TensorBoard log, found


@pytest.mark.parametrize(
    ("seed", "resume", "log"),
    [
        (1557, "scheduler_lost", "jsonl"),
        (1543, "scaler_lost", "jsonl"),
        (1540, "none", "wandb"),
    ],
    ids=["lightning-scheduler-lost", "fp16-scaler-lost", "wandb-only-log"],
)
def test_drawn_resumes_that_lost_a_scheduler_or_a_scaler_and_wandb_logs(
    seed: int, resume: str, log: str, tmp_path: Path
) -> None:
    """Issue #42's second set of draw axes (fixtures/draws.py `_draw_resumes`): Lightning
    restarted at the window's first checkpoint by `fit(ckpt_path=...)` with its schedulers'
    state cleared, logging into a version of its own (its log is both versions' metrics.csv);
    an fp16 loop that rebuilt its GradScaler at the resume; a healthy run whose log is only
    W&B's offline run. The cause and first bad step as planted, the replay on the merged log,
    never hardware."""
    from fixtures.draws import draw

    d = draw(seed)
    assert (d.resume, d.log) == (resume, log)
    run = build_draw(seed, tmp_path)
    t = truth(run)
    doc = _replay(draw_args(run))
    v = doc["verdict"]
    assert _causes(doc)[0] == t["cause"]
    assert v["first_bad_step"] == t["first_bad_step"]
    assert "silent_corruption" not in _causes(doc)
    assert v["reproducible"] is True  # the replay lands on the run's own log
    if log == "wandb":
        assert not (run / "metrics.jsonl").exists() and (run / "wandb").is_dir()
    if resume == "scheduler_lost":
        # The resumed leg's LR (its warm-up run again) is only in version_1's metrics.csv: a
        # replay that read version_0 alone misses the log from the window's second step.
        assert (run / "lightning_logs" / "version_1" / "metrics.csv").is_file()
        assert doc["replay"]["check"]["first_miss"] is None


def test_a_replay_on_the_log_but_not_on_after_tries_the_resume_the_counters_name(
    tmp_path: Path,
) -> None:
    """An HF Trainer run resumed with its weights only at a low LR (tuning draw 1541, shortened:
    its peak 3e-4): the saved optimizer's replay stays inside the log's tolerance for every
    step, yet misses *after*; the fresh optimizer the step counters name lands on both, and is
    the finding (held-out draw 9970 left `reproducible` open this way)."""
    from fixtures.draws import draw

    d = draw(1541)
    assert (d.trainer, d.resume) == ("hf", "weights_only")
    d.at, d.steps, d.save_every, d.peak = 31, 40, 5, 3e-4
    d.family, d.accum, d.schedule, d.warmup = "llama", 1, "wsd", 20
    d.n_head = 4 if d.n_embd % 4 == 0 else 2
    run = build_draw(1541, tmp_path, d)
    doc = _replay(draw_args(run))
    planned, fresh = doc["replay"]["variants"][:2]
    assert planned["first_miss"] is None and "of after's elements missed" in planned["note"]
    assert fresh["lands"] and fresh["cause"] == "optimizer_state_lost"
    assert _causes(doc)[0] == "optimizer_state_lost"
    assert doc["verdict"]["reproducible"] is True
    assert any(f["kind"] == "replay_variant_lands" for f in doc["findings"])
