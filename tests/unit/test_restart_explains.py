"""An LR scheduler rebuilt at a resume re-runs its warm-up: the LR rise it makes between the
pair is its consequence, not an LR fault (`verdict_evidence.reattribute`)."""

from __future__ import annotations

from ckptforensics.detectors.base import Finding
from ckptforensics.verdict_evidence import reattribute


def _f(kind: str, subject: str, supports: tuple[str, ...], **metrics: object) -> Finding:
    return Finding(
        "", kind, subject, 5.0, "critical", dict(metrics), kind, "", supports, primary=True
    )


RESTART = _f("lr_scheduler_restarted", "run", ("lr_scheduler_restarted",), resume_step=350)
JUMP = _f("lr_jump", "param_group[0]", ("lr_too_high",), lr_before=4.1e-4, lr_after=3e-3)


def test_a_warm_up_run_again_explains_the_lr_jump() -> None:
    out = {f.kind: f for f in reattribute([JUMP, RESTART])}
    assert out["lr_jump"].severity == "info"
    assert out["lr_jump"].supports == ("lr_scheduler_restarted",)
    assert "restarted at step 350" in out["lr_jump"].message
    assert out["lr_scheduler_restarted"].severity == "critical"


def test_an_lr_above_its_schedule_stays_a_fault_beside_a_restart() -> None:
    above = _f("lr_above_schedule", "param_group[0]", ("lr_too_high",), factor=30.0)
    out = reattribute([JUMP, above, RESTART])
    assert next(f for f in out if f.kind == "lr_jump").supports == ("lr_too_high",)


def test_without_a_restart_the_jump_is_a_fault() -> None:
    assert reattribute([JUMP])[0].supports == ("lr_too_high",)
