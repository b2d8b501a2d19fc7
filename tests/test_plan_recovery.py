"""The on-call loop's second half on real runs: `plan` on the zoo's incidents, applied by the
trainer's own resume, makes the run recover; `recovery` names each resume of an incident
(by the zoo's loop, transformers' Trainer and Lightning: with the mitigation, without it, and
with the optimizer state lost) with its step; quiet resumes (a loss with near-zero noise) are
judged to their own band; `triage` on a run already rolled back points at `recovery`. Ground
truth: each resumed run's resume.json (fixtures/resume_runs.py, fixtures/quiet_resumes.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ckptforensics as api
from ckptforensics.cli import cli
from ckptforensics.core.stats import CURVE_FLOOR
from fixtures.quiet_resumes import DRAWS, VARIANTS
from tests.conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore")

MODEL = str(ROOT / "fixtures" / "tinygpt.py") + ":factory"


def _truth(run: Path) -> dict[str, Any]:
    return json.loads((run / "resume.json").read_text())


def _checks(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["recovery"]["checks"]}


def _expect_truth(doc: dict[str, Any], t: dict[str, Any]) -> None:
    """recovery's verdict against what the resume planted."""
    r = doc["recovery"]
    if t["status"] is not None:
        assert (r["status"], r["step"]) == (t["status"], t["step"]), r["summary"]
    opt = _checks(doc)["optimizer_state"]
    if t["optimizer_restarted_at"] is not None:
        assert opt["status"] == "failed" and opt["step"] == t["optimizer_restarted_at"], opt
        assert "optimizer" in r["summary"]
        assert any(
            f["kind"] == "resume_optimizer_state" and f["severity"] == "critical"
            for f in doc["findings"]
        )
    else:
        assert opt["status"] == "ok", opt


# ---------------------------------------------------------------- the zoo's own loop
@pytest.fixture(scope="module")
def loop_resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures.resume_runs import loop_runs

    return loop_runs(tmp_path_factory.mktemp("loop-resume"))


@pytest.mark.parametrize("variant", ["fixed", "none", "lost"])
def test_recovery_names_each_resume_of_the_loop(
    loop_resumes: dict[str, Path], variant: str, tmp_path: Path
) -> None:
    run = loop_resumes[f"loop-{variant}"]
    t = _truth(run)
    plan = {
        "expect": {"skip_sample_ids": [273, 276, 278], "skip_sample_steps": [35], "onset": None}
    }
    rep = api.recovery(run, t["resumed_from"], plan=plan)
    rep.save(tmp_path / "rec")
    _expect_truth(rep.doc, t)
    skip = _checks(rep.doc)["skipped_samples"]
    # The flight recorder ran in the resumed leg: the culprits are gone, or back at step 35.
    assert skip["status"] == ("failed" if variant == "none" else "ok"), skip
    if variant == "none":
        assert skip["step"] == t["onset"] and skip["observed"] == [273, 276, 278]
    html = (tmp_path / "rec" / "report.html").read_text()
    assert "recovery" in html and ("<img" in html or "plots extra" in html)


def test_recovery_cli_json_out_and_strict(loop_resumes: dict[str, Path], tmp_path: Path) -> None:
    run = loop_resumes["loop-none"]
    r = CliRunner().invoke(
        cli,
        [
            "recovery",
            "--run-dir",
            str(run),
            "--resumed-from",
            "30",
            "--json",
            "--out",
            str(tmp_path / "rec"),
            "--strict",
        ],
    )
    assert r.exit_code == 1, r.output  # relapsed: --strict is an alarm
    doc = json.loads(r.stdout)
    assert doc["recovery"]["status"] == "relapsed" and doc["recovery"]["step"] == 35
    assert (tmp_path / "rec" / "report.json").is_file() and (
        tmp_path / "rec" / "report.md"
    ).read_text().startswith("# ckptforensics: recovery — relapsed at step 35")
    r = CliRunner().invoke(
        cli,
        [
            "recovery",
            "--run-dir",
            str(loop_resumes["loop-fixed"]),
            "--resumed-from",
            "30",
            "--strict",
        ],
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Recovered at step 31")
    r = CliRunner().invoke(cli, ["recovery", "--run-dir", str(run), "--resumed-from", "60"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "no step after 60" in r.output


def test_triage_on_a_rolled_back_run_shows_both_legs_and_points_at_recovery(
    loop_resumes: dict[str, Path],
) -> None:
    run = loop_resumes["loop-fixed"]
    rep = api.triage(run_dir=run)
    assert rep.kind == "triage" and rep.first_bad_step == rep.doc["first_bad_step"]
    res = rep.result
    assert res.resumed is not None and res.resumed["from"] == 30
    assert [(leg["first"], leg["last"]) for leg in res.resumed["legs"]] == [(1, 60), (31, 60)]
    assert any(
        c.startswith(f"ckptforensics recovery --run-dir {run} --resumed-from 30")
        for c in res.commands
    )
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(run)])
    assert (
        r.exit_code == 0 and "rolled back already" in r.output and "--resumed-from 30" in r.output
    )


# ---------------------------------------------------------------- quiet resumes
@pytest.fixture(scope="module")
def quiet_resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures.quiet_resumes import quiet_runs

    return quiet_runs(tmp_path_factory.mktemp("quiet-resume"))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("draw", [d.name for d in DRAWS])
def test_recovery_judges_a_quiet_resume_to_its_own_band(
    quiet_resumes: dict[str, Path], draw: str, variant: str
) -> None:
    """Full-batch runs at a small LR: `fixed` is the incident-free run step for step
    (recovered at 31), `stalled` falls further behind it every window (not recovered)."""
    run = quiet_resumes[f"{draw}-{variant}"]
    t = _truth(run)
    rep = api.recovery(run, t["resumed_from"])
    _expect_truth(rep.doc, t)
    r = rep.doc["recovery"]
    loss = r["trajectory"]["loss"]
    # the regime these runs are for: residuals near zero, the band the curve's own movement
    assert loss["residual_sigma"] < loss["step_sigma"] == loss["sigma"] < CURVE_FLOOR / 4
    if variant == "fixed":  # on its trajectory: no gap, so nothing to call "not closing"
        assert r["gap_trend"] is None and "not closing" not in r["summary"], r["summary"]
    else:
        assert r["summary"].startswith("Not recovered: the loss is"), r["summary"]
        assert r["gap_trend"] is not None and not r["gap_trend"]["closing"]


# ---------------------------------------------------------------- plan, applied by the loop
def _zoo_incident(root: Path, name: str) -> Path:
    from fixtures.zoo import build

    return build(root, [name])[name]


# The plan for an LR incident fixes the jumped groups (`lr_fix`); the what-if's `lr_scale` that
# replayed that fix is not applied on top of it (which left the resumed run ~100x under its
# schedule, stalled: the recovery band of the run's own says so, docs/signatures.md#recovery).
@pytest.mark.parametrize(
    "incident,after,knob",
    [
        ("poison_batch", 35, "skip_samples"),
        ("lr_jump", 40, "lr_fix"),
        ("gradient_explosion", 40, "lr_fix"),
    ],
)
def test_plan_applied_by_the_loop_makes_the_run_recover(
    tmp_path_factory: pytest.TempPathFactory, incident: str, after: int, knob: str
) -> None:
    from fixtures import zoo
    from fixtures.resume_runs import loop_changes, resume_loop

    root = tmp_path_factory.mktemp(f"plan-{incident}")
    run = _zoo_incident(root / "zoo", incident)
    out = root / "plan"
    r = CliRunner().invoke(
        cli,
        [
            "plan",
            "--run-dir",
            str(run),
            "--before",
            "30",
            "--after",
            str(after),
            "--batch",
            str(run / "batches.h5"),
            "--model",
            MODEL,
            "--json",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    p = doc["plan"]
    assert (
        p["status"] == "ready"
        and p["rollback"]["step"] == 30
        and p["trainer"] in ("loop", "nanogpt")
    )
    first = p["changes"][0]
    assert first["knob"] == knob, p["changes"]
    assert doc["whatif"]["outcomes"], "the plan replays its mitigations"
    if knob == "skip_samples":
        assert first["status"] == "verified" and first["evidence"]["source"] == "whatif"
        assert p["skip"]["sample_ids"] == [273, 276, 278] and json.loads(
            (out / "skip.json").read_text()
        )["sample_ids"] == [273, 276, 278]
    make = {
        "poison_batch": zoo.poison_run,
        "lr_jump": zoo.lr_jump_run,
        "gradient_explosion": zoo.gradient_explosion_run,
    }[incident]
    resumed = resume_loop(
        run, root / "resumed", rollback=p["rollback"]["step"], make=make, **loop_changes(p)
    )
    rec = api.recovery(resumed.out, 30, plan=out)
    assert rec.doc["recovery"]["status"] == "recovered", rec.doc["recovery"]["summary"]
    checks = _checks(rec.doc)
    assert checks["optimizer_state"]["status"] == "ok"
    assert checks["lr"]["status"] == "ok", checks["lr"]  # the LR the plan expects, step by step
    # and the same incident resumed as it was relapses
    again = resume_loop(run, root / "again", rollback=30, make=make)
    assert api.recovery(again.out, 30, plan=out).doc["recovery"]["status"] == "relapsed"


# ---------------------------------------------------------------- transformers' Trainer
@pytest.fixture(scope="module")
def hf_resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from fixtures.resume_runs import hf_runs

    return hf_runs(tmp_path_factory.mktemp("hf-resume"))


@pytest.mark.parametrize("variant", ["fixed", "none", "lost"])
def test_recovery_names_each_resume_of_the_hf_trainer(
    hf_resumes: dict[str, Path], variant: str
) -> None:
    run = hf_resumes[f"hf-{variant}"]
    t = _truth(run)
    rep = api.recovery(run, t["resumed_from"])
    _expect_truth(rep.doc, t)
    assert Path(rep.doc["recovery"]["log"]).name == "trainer_state.json"


def test_plan_applied_by_the_hf_trainer_makes_the_run_recover(
    hf_resumes: dict[str, Path], tmp_path: Path
) -> None:
    from fixtures.resume_runs import hf_changes, resume_hf

    src = hf_resumes["hf-none"].parent / "hf" / "run"
    t = json.loads((src / "truth.json").read_text())
    data = src.parent / t["data"]
    rep = api.plan(t["before"], t["after"], data=data, run_dir=src)
    p = rep.plan
    assert p["status"] == "ready" and p["trainer"] == "hf" and p["rollback"]["step"] == t["before"]
    assert p["skip"]["format"] == "HF dataset indices" and p["skip"]["value"] == t["sample_ids"]
    assert "training_args.bin" in (p["settings"] or "")
    assert any(e["key"] == "resume_from_checkpoint" for e in p["resume"])
    args, skip = hf_changes(p)
    run = resume_hf(src, data, tmp_path / "resumed", p["rollback"]["step"], skip=skip, **args)
    rec = api.recovery(run, t["before"], plan=p)
    assert rec.doc["recovery"]["status"] == "recovered", rec.doc["recovery"]["summary"]
    assert _checks(rec.doc)["optimizer_state"]["status"] == "ok"


# ---------------------------------------------------------------- Lightning
@pytest.fixture(scope="module")
def lightning_resumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("lightning")
    from fixtures.resume_runs import lightning_runs

    return lightning_runs(tmp_path_factory.mktemp("lightning-resume"))


@pytest.mark.parametrize("variant", ["fixed", "none", "lost"])
def test_recovery_names_each_resume_of_lightning(
    lightning_resumes: dict[str, Path], variant: str
) -> None:
    run = lightning_resumes[f"lightning-{variant}"]
    t = _truth(run)
    rep = api.recovery(run, t["resumed_from"])
    _expect_truth(rep.doc, t)
    legs = rep.doc["recovery"]["legs"]
    assert [Path(leg["source"]).parent.name for leg in legs] == [
        "version_0",
        "version_1",
    ]  # a CSVLogger version a launch


def test_plan_refuses_conflicting_inputs_before_any_work(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["plan"])
    assert r.exit_code == 2 and "pass --before and --after" in r.output
    (tmp_path / "rep").mkdir()
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "rep"), "--before", "30", "--after", "35"])
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(cli, ["plan", str(tmp_path / "rep")])  # a directory without a report
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "report.json" in r.output


# ---------------------------------------------------------------- drawn resumes
def test_recovery_right_on_drawn_resumes(tmp_path: Path) -> None:
    """Three tuning draws of fixtures/recovery_draws.py (bench/recovery_draws.py scores them
    all), each built and its truth checked by the generator: 1647 a full-batch run (near-zero
    noise) resumed with the poisoned rows repaired, its leg the incident-free run's
    (recovered at 36); 1641 sampled batches resumed as it was, the poisoned batch back at
    step 40 (relapsed); 1629 a full-batch run resumed 100x under its LR schedule, further
    behind the incident-free run every window (not recovered)."""
    from fixtures.recovery_draws import build_recovery, draw_recovery

    seeds = {1647: ("quiet", "fixed"), 1641: ("noisy", "none"), 1629: ("quiet", "stalled")}
    for seed, kind in seeds.items():
        assert (draw_recovery(seed).noise, draw_recovery(seed).variant) == kind
        run = build_recovery(seed, tmp_path)
        t = _truth(run)
        rep = api.recovery(run, t["resumed_from"])
        _expect_truth(rep.doc, t)
