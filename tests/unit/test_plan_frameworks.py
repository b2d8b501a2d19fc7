"""The plan in each trainer's own terms, on checkpoints the frameworks wrote (committed under
fixtures/data): the run's own settings read, each change a diff of them, the skip list in the
trainer's format, the resume keys. A report document stands in for the replay and what-if."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.planner import mitigations, plan_section
from ckptforensics.trainers import planner_for

DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"


def _doc(
    cause: str, onset: int, whatif: list[tuple[str, bool]] = (), skip_step: int | None = None
) -> dict[str, Any]:
    """A report: the verdict's cause and first bad step, and a what-if's outcomes."""
    base = {
        "mitigation": "baseline",
        "on_track": False,
        "steps": [onset - 1, onset + 4],
        "max_loss": 9.0,
        "max_grad_norm": 50.0,
        "final_loss": 8.0,
        "skipped_rows": {},
    }
    outs = [base] + [
        {
            **base,
            "mitigation": m,
            "on_track": ok,
            "max_loss": 3.0 if ok else 9.0,
            "max_grad_norm": 1.0 if ok else 50.0,
        }
        for m, ok in whatif
    ]
    rec = next((m for m, ok in whatif if ok), None)
    return {
        "verdict": {
            "causes": [{"cause": cause, "confidence": 0.9, "evidence": []}],
            "first_bad_step": onset,
            "anomalous_samples": [],
        },
        "findings": [],
        "whatif": {
            "outcomes": outs,
            "recommended": rec,
            "baseline_on_track": False,
            "level": 3.0,
            "band": 0.3,
        }
        if whatif
        else {},
    }


def test_megatron_flags_from_the_checkpoints_args() -> None:
    with open_checkpoint(DATA / "megatron-core-0.19" / "legacy" / "iter_0000020") as ck:
        assert planner_for(ck).NAME == "megatron"
        clip = ck.config["clip_grad"]
        p = plan_section(_doc("gradient_explosion", 25, [(f"clip={clip / 2:g}", True)]), ck)
    assert p["status"] == "ready" and p["trainer"] == "megatron" and p["rollback"]["step"] == 20
    c = p["changes"][0]
    assert c["knob"] == "clip" and c["status"] == "verified" and c["evidence"]["max_loss"] == 3.0
    assert c["edits"][0] == {"key": "clip_grad", "before": clip, "after": clip / 2, "note": ""}
    assert (
        f"- --clip-grad {clip}" in p["config_diff"]
        and f"+ --clip-grad {clip / 2}" in p["config_diff"]
    )
    keys = {e["key"]: e["after"] for e in p["resume"]}
    assert keys["ckpt_step"] == 20 and keys["load"]
    assert "--ckpt-step 20" in p["config_diff"]


def test_megatrons_skip_is_the_iteration_count_before_the_step() -> None:
    with open_checkpoint(DATA / "megatron-core-0.19" / "legacy" / "iter_0000020") as ck:
        p = plan_section(_doc("poison_batch", 25, [("skip_step=25", True)]), ck)
    assert p["skip"]["format"] == "megatron --iterations-to-skip" and p["skip"]["value"] == [24]
    assert p["skip"]["text"].startswith("--iterations-to-skip 24")


def test_an_lr_change_on_megatron_overrides_the_saved_schedule() -> None:
    with open_checkpoint(DATA / "megatron-core-0.19" / "legacy" / "iter_0000020") as ck:
        lr = ck.config["lr"]
        p = plan_section(_doc("lr_too_high", 25, [("lr_scale=0.5", True)]), ck)
    edits = {e["key"]: e["after"] for c in p["changes"] for e in c["edits"]}
    assert edits["lr"] == pytest.approx(lr * 0.5) and edits["override_opt_param_scheduler"] is True
    assert p["expect"]["lr_scale"] == 0.5


def test_olmo_core_keys_from_its_config_json() -> None:
    with open_checkpoint(DATA / "olmo-core-3.0" / "run" / "step20") as ck:
        assert planner_for(ck).NAME == "olmo_core"
        p = plan_section(_doc("adam_instability", 25, [("eps=1e-06", True)]), ck)
    assert p["settings"].endswith("config.json")
    e = p["changes"][0]["edits"][0]
    assert e["key"] == "train_module.optim.eps" and e["before"] == 1e-08 and e["after"] == 1e-06
    assert '"train_module.optim.eps": 1e-06' in p["config_diff"]
    keys = {e["key"]: e["after"] for e in p["resume"]}
    assert (
        keys["trainer.load_path"].endswith("step20") and keys["trainer.load_strategy"] == "always"
    )


def test_a_change_no_what_if_kept_on_track_is_marked_not_replayed() -> None:
    with open_checkpoint(DATA / "olmo-core-3.0" / "run" / "step20") as ck:
        p = plan_section(_doc("gradient_explosion", 25, [("clip=0.5", False)]), ck)
    c = p["changes"][0]
    assert c["knob"] == "clip" and c["status"] == "not_replayed" and c["evidence"] is None
    assert (
        p["alternatives"][0]["mitigation"] == "clip=0.5"
        and p["alternatives"][0]["on_track"] is False
    )
    assert any("not replayed" in n for n in p["notes"])


def test_a_healthy_report_plans_nothing_and_an_onset_before_every_checkpoint_has_no_rollback() -> (
    None
):
    with open_checkpoint(DATA / "olmo-core-3.0" / "run" / "step20") as ck:
        assert plan_section(_doc("none", 25), ck)["status"] == "no_incident"
        assert plan_section(_doc("gradient_explosion", 0), ck)["status"] == "no_rollback"


def test_what_a_cause_calls_for() -> None:
    assert mitigations(_doc("poison_batch", 35), 1.0) == ["skip_samples=auto", "skip_step=35"]
    assert mitigations(_doc("fp16_overflow", 35), 1.0)[0] == "precision=bf16"
    assert mitigations(_doc("gradient_explosion", 35), 1.0)[0] == "clip=0.5"
    assert (
        mitigations(_doc("gradient_explosion", 35), None)[0] == "clip=1"
    )  # no clip: the usual 1.0
    assert mitigations(_doc("silent_corruption", 35), 1.0) == []
    jump = _doc("lr_too_high", 35)
    jump["findings"] = [
        {
            "kind": "lr_step_jump",
            "metrics": {"step": 35, "groups": [0, 1], "lr_before": 0.002, "lr": 0.2},
        }
    ]
    assert mitigations(jump, 1.0)[0] == "lr_scale=0.01"


# The readers of these formats are tested on files their frameworks wrote (test_deepspeed,
# test_lightning_cli, test_dcp); here the planner reads the view a reader fills.
def _view(path: Path, fmt: str, **scalars: Any) -> Any:
    from ckptforensics.formats.base import Checkpoint

    path.mkdir(parents=True, exist_ok=True)
    return Checkpoint(path=path, format=fmt, scalars=dict(scalars))


def test_deepspeed_ds_config_keys(tmp_path: Path) -> None:
    ck = _view(
        tmp_path / "ckpt" / "global_step20",
        "deepspeed",
        ds_config={
            "gradient_clipping": 1.0,
            "bf16": {"enabled": False},
            "fp16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
        },
    )
    planner = planner_for(ck)
    s = planner.settings(ck)
    assert planner.NAME == "deepspeed" and s.values["optimizer.params.lr"] == 3e-4
    edits = planner.edits("precision", "bf16", s) + planner.edits("clip", 0.5, s)
    text = planner.render(edits, s)
    assert (
        '-  "fp16.enabled": true' in text
        and '+  "bf16.enabled": true' in text
        and '+  "gradient_clipping": 0.5' in text
    )
    assert "tag='global_step20'" in planner.resume(ck.path, 20, s)[0].after


def test_torchtitan_keys_from_the_job_toml(tmp_path: Path) -> None:
    dump = tmp_path / "outputs"
    (dump / "checkpoint").mkdir(parents=True)
    (dump / "llama3_debug.toml").write_text(
        '[training]\nmax_norm = 1.0\n\n[optimizer]\nlr = 8e-4\n\n[checkpoint]\nload_step = -1\nexclude_from_loading = ["optimizer"]\n'
    )
    ck = _view(dump / "checkpoint" / "step-30", "dcp")
    planner = planner_for(ck)
    s = planner.settings(ck)
    assert planner.NAME == "torchtitan" and s.source.endswith("llama3_debug.toml")
    text = planner.render(planner.edits("clip", 0.5, s), s)
    assert (
        "-[training] max_norm = 1.0" in text
        and "+[training] max_norm = 0.5" in text
        and "--training.max_norm 0.5" in text
    )
    resume = {e.key: e for e in planner.resume(ck.path, 30, s)}
    assert resume["checkpoint.load_step"].after == 30
    assert (
        resume["checkpoint.exclude_from_loading"].after == []
        and "loses" in resume["checkpoint.exclude_from_loading"].note
    )


def test_lightning_cli_config_and_the_trainer_arguments(tmp_path: Path) -> None:
    version = tmp_path / "lightning_logs" / "version_0"
    (version / "checkpoints").mkdir(parents=True)
    (version / "config.yaml").write_text(
        "trainer:\n  gradient_clip_val: 1.0\n  precision: 16-mixed\nmodel:\n  lr: 0.003\n"
    )
    ck = _view(version / "checkpoints" / "epoch=0-step=30.ckpt", "lightning")
    ck.config = {"lr": 0.003}
    planner = planner_for(ck)
    s = planner.settings(ck)
    edits = planner.edits("precision", "bf16", s) + planner.edits("lr_scale", 0.5, s)
    text = planner.render(edits, s)
    assert '-trainer.precision: "16-mixed"' in text and '+trainer.precision: "bf16-mixed"' in text
    assert (
        "+model.lr: 0.0015" in text and "on_train_start" in text
    )  # ckpt_path restores the old LR: scaled after
    assert planner.resume(ck.path, 30, s)[0].key == "ckpt_path"


def test_a_plain_loop_gets_its_lines_of_pytorch(tmp_path: Path) -> None:
    ck = _view(tmp_path / "step_30.pt", "torch")
    planner = planner_for(ck)
    s = planner.settings(ck)
    text = planner.render(planner.edits("clip", 0.5, s) + planner.edits("precision", "bf16", s), s)
    assert "clip_grad_norm_(model.parameters(), 0.5)" in text and "torch.bfloat16" in text
    assert "optimizer.load_state_dict" in planner.resume(ck.path, 30, s)[0].after
