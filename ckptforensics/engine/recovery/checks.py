"""The checks that the resume was the plan, each pure: the optimizer state it resumed, the LR,
clip, precision and loss scale the new leg runs with, the skipped samples not seen again."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptforensics.engine.recovery.legs import Rows

__all__ = [
    "Check",
    "optimizer_resumed",
    "lr_check",
    "clip_check",
    "precision_check",
    "scale_check",
    "skip_check",
]


@dataclass(frozen=True, slots=True)
class Check:
    """One check that the resume was the plan: 'ok', 'failed', or 'unknown' (nothing to read)."""

    name: str
    status: str
    expected: Any
    observed: Any
    message: str
    step: int | None = None


def optimizer_resumed(
    adam_steps: Sequence[float],
    trainer_step: int,
    resumed_from: int,
    offset: float = 0.0,
    skipped: int = 0,
) -> Check:
    """Whether the optimizer state came back with the weights: Adam's step counter of a
    checkpoint the resumed leg wrote against the trainer's step.

    A resumed optimizer counts every update since the run began: its step is the trainer's
    plus the run's own offset (`offset`, read off the rollback checkpoint: OLMo-core's runs
    one ahead; fp16 overflow skips before the resume make it negative), less the updates the
    resumed leg skipped for overflow (`skipped`). A fresh optimizer counts from the resume:
    trainer step minus `resumed_from`. A mix of both is a state partly restored (a group or a
    shard lost).

    Args:
        adam_steps: per parameter, the `step` of its Adam state.
        trainer_step: the checkpoint's own step.
        resumed_from: the step the run resumed at.
        offset: Adam's step minus the trainer's in the rollback checkpoint.
        skipped: overflow-skipped updates in the resumed leg (loss-scale backoffs).
    """
    if not adam_steps:
        return Check(
            "optimizer_state",
            "unknown",
            None,
            None,
            "the checkpoint after the resume holds no optimizer state (weights only)",
        )
    expect = trainer_step + offset
    fresh = trainer_step - resumed_from
    vals = np.asarray(adam_steps, dtype=np.float64)
    whole = (vals <= expect + 0.5) & (vals >= expect - skipped - 0.5)
    lost = np.abs(vals - fresh) <= max(skipped, 0) + 0.5
    med = float(np.median(vals))
    if whole.all():
        return Check(
            "optimizer_state",
            "ok",
            expect,
            med,
            f"Adam's step counter is {med:g} at trainer step {trainer_step}: the optimizer state was resumed",
            trainer_step,
        )
    if lost.all():
        return Check(
            "optimizer_state",
            "failed",
            expect,
            med,
            f"Adam's step counter is {med:g} at trainer step {trainer_step}, not {expect:g}: the optimizer restarted at step {resumed_from} "
            "(moments zero, bias correction from t = 1; a weights-only resume)",
            resumed_from,
        )
    if (whole | lost).all():
        return Check(
            "optimizer_state",
            "failed",
            expect,
            med,
            f"{int(lost.sum())} of {vals.size} parameters' Adam state restarted at step {resumed_from}, the rest resumed: the state was partly restored",
            resumed_from,
        )
    return Check(
        "optimizer_state",
        "failed",
        expect,
        med,
        f"Adam's step counter ({med:g}) is neither the trainer's ({expect:g}) nor a restart's ({fresh}): the optimizer state is not this run's",
        trainer_step,
    )


def lr_check(expect: dict[str, Any], resumed: Rows, jumps: Sequence[Any] = ()) -> Check:
    """The resumed leg's logged LR against the plan's, step by step (1%: the float noise of a
    schedule recomputed, far below any change a plan makes); without the plan's figures, an LR
    jump in the resumed leg (triage's rule) is a fault of the resume (a scheduler that did not
    come back with the optimizer, say)."""
    want = {int(k): float(v) for k, v in (expect.get("lr") or {}).items()}
    have = {s: r["lr"] for s, r in resumed.items() if "lr" in r and math.isfinite(r["lr"])}
    both = sorted(set(want) & set(have))
    if not both and jumps:
        j = jumps[0]
        return Check(
            "lr", "failed", j.baseline, j.value, f"in the resumed leg, {j.message}", j.step
        )
    if not both:
        why = (
            "no step where the plan and the resumed log both state the LR"
            if expect
            else "no plan given (--plan), and no LR jump in the resumed leg"
        )
        return Check("lr", "unknown", None, None, why)
    bad = [s for s in both if abs(have[s] - want[s]) > 0.01 * abs(want[s])]
    if not bad:
        return Check(
            "lr",
            "ok",
            want[both[0]],
            have[both[0]],
            f"the LR matches the plan on {len(both)} steps ({both[0]}-{both[-1]})",
        )
    s = bad[0]
    return Check(
        "lr",
        "failed",
        want[s],
        have[s],
        f"the LR at step {s} is {have[s]:.4g}, the plan's is {want[s]:.4g} ({have[s] / want[s]:.3g}x)",
        s,
    )


def clip_check(
    expect: dict[str, Any], after_cfg: dict[str, Any] | None, recorded: float | None
) -> Check:
    want = expect.get("clip")
    have = (after_cfg or {}).get("grad_clip", recorded)
    if want is None:
        return Check("clip", "unknown", None, have, "the plan sets no clip")
    if have is None:
        return Check(
            "clip",
            "unknown",
            want,
            None,
            "neither the checkpoint after the resume nor the flight recorder states the clip",
        )
    ok = math.isclose(float(have), float(want), rel_tol=1e-6)
    return Check(
        "clip",
        "ok" if ok else "failed",
        want,
        have,
        f"the resumed run clips at {have:g}" + ("" if ok else f", the plan at {want:g}"),
    )


def precision_check(
    expect: dict[str, Any], after_cfg: dict[str, Any] | None, resumed: Rows
) -> Check:
    want = expect.get("precision")
    scaled = any("loss_scale" in r for r in resumed.values())
    if want is None:
        return Check(
            "precision",
            "unknown",
            None,
            "fp16 (a loss scale is logged)" if scaled else None,
            "the plan changes no precision",
        )
    cfg = after_cfg or {}
    have = (
        "bf16"
        if cfg.get("bf16")
        else "fp16"
        if cfg.get("fp16") or scaled
        else ("fp32" if cfg else None)
    )
    if have is None:
        return Check(
            "precision",
            "unknown",
            want,
            None,
            "the checkpoint after the resume does not state its precision",
        )
    ok = have == want or (
        want == "bf16" and have != "fp16" and not scaled and cfg.get("bf16") is None
    )
    return Check(
        "precision",
        "ok" if ok else "failed",
        want,
        have,
        f"the resumed run trains in {have}" + ("" if ok else f", the plan in {want}"),
    )


def scale_check(rollback_scale: float | None, resumed: Rows, expect: dict[str, Any]) -> Check:
    """The first logged loss scale of the resumed leg against the rollback's scaler (one
    growth or backoff either way allowed: x2, PyTorch's GradScaler default factors)."""
    first = next((r["loss_scale"] for r in resumed.values() if "loss_scale" in r), None)
    if expect.get("precision") in ("bf16", "fp32"):
        if first is None:
            return Check(
                "loss_scale",
                "ok",
                None,
                None,
                "no loss scale logged: the scaler is off, as the plan's precision needs",
            )
        return Check(
            "loss_scale",
            "failed",
            None,
            first,
            f"the resumed leg logs a loss scale ({first:g}): it still trains in fp16 under a scaler",
        )
    if first is None or rollback_scale is None:
        return Check(
            "loss_scale",
            "unknown",
            rollback_scale,
            first,
            "no loss scale to compare (logged and in the rollback checkpoint)",
        )
    ok = rollback_scale / 2 <= first <= rollback_scale * 2
    msg = f"the loss scale resumed at {first:g} (the rollback checkpoint's scaler: {rollback_scale:g})"
    return Check(
        "loss_scale",
        "ok" if ok else "failed",
        rollback_scale,
        first,
        msg + ("" if ok else ": the scaler state was not restored"),
    )


def skip_check(
    expect: dict[str, Any], seen: dict[int, list[int]] | None, source: str | None
) -> Check:
    ids = set(int(x) for x in expect.get("skip_sample_ids") or [])
    if not ids:
        return Check("skipped_samples", "unknown", None, None, "the plan skips no sample ids")
    if seen is None:
        return Check(
            "skipped_samples",
            "unknown",
            sorted(ids),
            None,
            "no sample ids recorded after the resume (the flight recorder keeps them)",
        )
    hits = {s: sorted(ids & set(v)) for s, v in seen.items() if ids & set(v)}
    if not hits:
        steps = sorted(seen)
        missing = [int(s) for s in expect.get("skip_sample_steps") or [] if int(s) not in seen]
        if missing:
            # The recorder's ring no longer holds the steps where they came: nothing is known.
            return Check(
                "skipped_samples",
                "unknown",
                sorted(ids),
                None,
                f"the recorder kept steps {steps[0]}-{steps[-1]} after the resume, not step {missing[0]} where the skipped samples came ({source})",
            )
        return Check(
            "skipped_samples",
            "ok",
            sorted(ids),
            [],
            f"none of the {len(ids)} skipped samples in {len(steps)} recorded steps after the resume ({source})",
        )
    s = min(hits)
    return Check(
        "skipped_samples",
        "failed",
        sorted(ids),
        hits[s],
        f"skipped samples {hits[s]} seen again at step {s} ({source})",
        s,
    )
