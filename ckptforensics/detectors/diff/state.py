"""The optimizer's and trainer's state across the pair: skipped steps, a resume that lost the
optimizer state, a restarted scheduler, a reset loss scaler."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.engine.diff.pair import DiffResult
from ckptforensics.engine.replay.precision import DEFAULT_INIT_SCALE

__all__ = [
    "detect_skipped_steps",
    "RESTART_SHARE",
    "moments_restarted",
    "detect_optimizer_state_lost",
    "detect_scheduler_restart",
    "detect_scaler_reset",
]


def detect_skipped_steps(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Optimizer steps vs trainer steps, and the loss scaler's backoff.

    Dynamic loss scaling backs off (and skips that step) by design whenever the scale has
    grown into an overflow, once per growth_interval (torch GradScaler, DeepSpeed, Megatron):
    up to `th.routine_backoffs` halvings, each with its one skipped step, is normal
    operation (info, no cause). More, or a scale driven to 1 / by 8 halvings, is evidence.
    """
    p = diff.pair
    out = []
    drops = 0.0
    collapse = False
    if p.loss_scale_a and p.loss_scale_b is not None and p.loss_scale_b < p.loss_scale_a:
        drops = math.log2(p.loss_scale_a / max(p.loss_scale_b, 1e-30))
        collapse = p.loss_scale_b <= 1.0 or drops >= 8
    routine = not collapse and drops <= th.routine_backoffs
    if None not in (p.step_a, p.step_b, p.adam_step_a, p.adam_step_b):
        g = p.step_b - p.step_a  # type: ignore[operator]
        k = p.adam_step_b - p.adam_step_a  # type: ignore[operator]
        if 0 <= k < g and p.skip_optimizer and not p.loss_scale_a:
            # OLMo-core's SkipStep optimizers skip a step whose loss or grad norm is an
            # outlier of the last steps (trainers/olmo_core/skipstep.py): the optimizer's own guard,
            # not an overflow; the replay finds the steps and judges their spikes.
            out.append(
                Finding(
                    "",
                    "skipped_steps",
                    "run",
                    cap((g - k) / max(1, g) * 10),
                    "info",
                    {"trainer_steps": g, "optimizer_steps": k, "optimizer": p.skip_optimizer},
                    f"{g - k} of {g} steps skipped the optimizer update: {p.skip_optimizer} skips a step whose loss or grad norm is an outlier of the last steps",
                    "docs/signatures.md#skipped-steps",
                    (),
                )
            )
        elif 0 <= k < g:
            # One skipped step per backoff (a single one even where the scaler state was not
            # saved, as nanoGPT does not) is the scaler's routine.
            # Each backoff skips one step and the scale regrows in between, so skips, not
            # the net halvings, are what is counted against the routine allowance.
            normal = routine and g - k <= max(1, th.routine_backoffs)
            out.append(
                Finding(
                    "",
                    "skipped_steps",
                    "run",
                    cap((g - k) / max(1, g) * 10),
                    "info" if normal else "warning",
                    {"trainer_steps": g, "optimizer_steps": k},
                    f"{g - k} of {g} steps skipped the optimizer update ("
                    + (
                        "overflowing gradients under a loss scaler"
                        if p.loss_scale_a or p.loss_scale_b
                        # nanoGPT saves no scaler state: an fp16 run's backoffs, or a loop's
                        # skip of non-finite gradients; neither checkpoint says which
                        else "overflowing gradients under a loss scaler, or a skip of non-finite gradients: neither checkpoint records a scaler"
                    )
                    + ")"
                    + (
                        ": one per loss-scale backoff, dynamic loss scaling's normal operation"
                        if normal
                        else ""
                    ),
                    "docs/signatures.md#skipped-steps",
                    () if normal else ("fp16_overflow", "loss_scale_collapse"),
                    primary=not normal,
                )
            )
    if drops > 0 and routine:
        out.append(
            Finding(
                "",
                "loss_scale_backoff",
                "run",
                cap(drops),
                "info",
                {"scale_before": p.loss_scale_a, "scale_after": p.loss_scale_b, "halvings": drops},
                f"loss scale fell from {p.loss_scale_a:g} to {p.loss_scale_b:g} ({drops:.0f} halvings): routine under dynamic loss scaling",
                "docs/signatures.md#skipped-steps; torch.amp.GradScaler backoff_factor 0.5 per overflow",
                (),
            )
        )
    elif drops > 0:
        out.append(
            Finding(
                "",
                "loss_scale_collapse" if collapse else "loss_scale_backoff",
                "run",
                cap(drops),
                "critical" if collapse else "warning",
                {"scale_before": p.loss_scale_a, "scale_after": p.loss_scale_b, "halvings": drops},
                f"loss scale fell from {p.loss_scale_a:g} to {p.loss_scale_b:g} ({drops:.0f} halvings)",
                "docs/signatures.md#skipped-steps",
                ("loss_scale_collapse", "fp16_overflow") if collapse else ("fp16_overflow",),
                primary=True,
            )
        )
    return out


# The optimizer's state restarts at a resume (docs/signatures.md#optimizer-state-lost): a step
# counter never runs backwards, and a second moment never falls under its decay floor; a
# share of elements under it beyond RESTART_SHARE in most tensors is a restart, not a flip.
RESTART_SHARE = 0.5


def _restart_shares(diff: DiffResult) -> np.ndarray:
    return np.array([t.restart_share for t in diff.tensors if math.isfinite(t.restart_share)])


def moments_restarted(diff: DiffResult) -> bool:
    """Over half the tensors (3 at least) hold most second-moment elements under the floor."""
    shares = _restart_shares(diff)
    return shares.size >= 3 and float(np.mean(shares > RESTART_SHARE)) > 0.5


def detect_optimizer_state_lost(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The optimizer's state restarted between the pair: its step counter behind where
    *before* left it, or its second moments under their decay floor almost everywhere.

    The counter of a fresh optimizer counts from the resume, so the trainer step it
    restarted at is step_B - counter_B (at or before it, if steps were skipped since).
    """
    p = diff.pair
    shares = _restart_shares(diff)
    restarted = float(np.mean(shares > RESTART_SHARE)) if shares.size else 0.0
    med = float(np.median(shares)) if shares.size else math.nan
    counter_back = (
        p.adam_step_a is not None and p.adam_step_b is not None and p.adam_step_b < p.adam_step_a
    )
    moments_restart = moments_restarted(diff)
    if not (counter_back or moments_restart):
        return []
    resume = None
    if (
        p.step_b is not None
        and p.adam_step_b is not None
        and (p.step_a is None or p.step_b - p.adam_step_b >= p.step_a)
    ):
        resume = p.step_b - p.adam_step_b
        # Skipped steps since the resume (loss-scale backoffs) make the counter trail by
        # them: a resume starts from a checkpoint, and *before* is the one within them.
        if p.step_a is not None and resume - p.step_a <= max(th.routine_backoffs, 1):
            resume = p.step_a
    why = []
    if counter_back:
        why.append(
            f"the optimizer's step counter went back from {p.adam_step_a} to {p.adam_step_b} while the trainer went from step {p.step_a} to {p.step_b}"
        )
    if shares.size:
        why.append(
            f"{restarted:.0%} of tensors hold second moments under their decay floor on over half their elements (median share {med:.0%})"
        )
    at = f"; the fresh optimizer started at step {resume}" if resume is not None else ""
    return [
        Finding(
            "",
            "optimizer_state_lost",
            "run",
            cap(10.0 * (1.0 + restarted)),
            "critical",
            {
                "resume_step": resume,
                "optimizer_step_before": p.adam_step_a,
                "optimizer_step_after": p.adam_step_b,
                "trainer_step_before": p.step_a,
                "trainer_step_after": p.step_b,
                "tensors_restarted": restarted,
                "median_restart_share": med,
                "restart_share_threshold": RESTART_SHARE,
            },
            f"the optimizer state was lost at a resume{at}: " + "; ".join(why),
            "docs/signatures.md#optimizer-state-lost",
            ("optimizer_state_lost",),
            primary=True,
        )
    ]


def _applied(p: Any) -> int | None:
    """Optimizer updates applied between the pair (its step counter's advance), None unknown."""
    if p.adam_step_a is None or p.adam_step_b is None:
        return None
    return int(p.adam_step_b - p.adam_step_a)


def _int(d: dict | None, key: str) -> int | None:
    v = (d or {}).get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def detect_scheduler_restart(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The LR scheduler's `last_epoch` (the number of its `step()` calls) ran backwards
    between the pair, or, for a scheduler stepped once per step (its `last_epoch` at A is the
    trainer's step), fell behind the optimizer steps applied since: it was rebuilt at a resume
    without its state, and re-runs its warm-up. An epoch scheduler's `last_epoch` counts
    epochs, so it is held to running backwards only (held-out draws 9860, 9886, read after
    scoring: a Lightning scheduler rebuilt 25 steps before *after* stood at 25 at both ends)."""
    p = diff.pair
    ea, eb = _int(p.scheduler_a, "last_epoch"), _int(p.scheduler_b, "last_epoch")
    if ea is None or eb is None:
        return []
    k = _applied(p)
    # Stepped per step: behind by more than its applied steps allow (a loss scaler's skipped
    # steps skip the scheduler too in the HF Trainer, so only the applied ones count).
    lags = (
        k is not None
        and p.step_a is not None
        and p.step_b is not None
        and 0 < k <= p.step_b - p.step_a
        and ea == p.step_a
        and ea <= eb < ea + k
    )
    if eb >= ea and not lags:
        return []
    resume = (
        p.step_b - eb
        if p.step_b is not None and (p.step_a is None or p.step_b - eb >= p.step_a)
        else None
    )
    lrs = f" (LR {p.lr_a[0]:.3g} -> {p.lr_b[0]:.3g})" if p.lr_a and p.lr_b else ""
    return [
        Finding(
            "",
            "lr_scheduler_restarted",
            "run",
            cap(ea / max(eb, 1)),
            "critical",
            {
                "last_epoch_before": ea,
                "last_epoch_after": eb,
                "resume_step": resume,
                "trainer_step_before": p.step_a,
                "trainer_step_after": p.step_b,
            },
            f"the LR scheduler restarted{f' at step {resume}' if resume is not None else ''}: "
            + (
                f"its last_epoch is {eb} at step {p.step_b}, where {ea} at step {p.step_a} (one a step) plus {k} optimizer steps would make {ea + (k or 0)}"
                if lags
                else f"its last_epoch went back from {ea} to {eb}"
            )
            + f"{lrs}, so the LR re-runs its schedule from the start",
            "docs/signatures.md#lr-scheduler-restarted",
            ("lr_scheduler_restarted",),
            primary=True,
        )
    ]


def scaler_after_clean_steps(
    scale: float, tracker: int, clean: int, factor: float, interval: int
) -> tuple[float, int]:
    """GradScaler.update over `clean` steps without an overflow (torch's `_amp_update_scale_`):
    the growth tracker counts them and, at growth_interval, the scale grows and it restarts."""
    total = tracker + clean
    return scale * factor ** (total // interval), total % interval


def _scaler_resume(
    step_a: int, step_b: int, lb: float, tb: int | None, factor: float, interval: int, clean: bool
) -> int | None:
    """The step a rebuilt scaler started at: with no step skipped, one built at GradScaler's
    default init_scale (2^16) reaches `lb` and tracker `tb` after growth_interval steps per
    growth plus `tb`; otherwise it counted `tb` clean steps since its last change at least."""
    if tb is None:
        return None
    n = tb
    growths = math.log(lb / DEFAULT_INIT_SCALE, factor) if lb >= DEFAULT_INIT_SCALE else -1.0
    if clean and growths >= 0 and abs(growths - round(growths)) < 1e-9:
        n += round(growths) * interval
    return step_b - n if step_b - n >= step_a else None


def detect_scaler_reset(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The loss scaler's state does not follow from *before*'s by any run of its own rule
    (torch.amp.GradScaler.update: x growth_factor after growth_interval clean steps, x
    backoff_factor and a skipped step on an overflow, the tracker back to 0): it was rebuilt
    at a resume.

    Impossible: a scale grown more than the clean steps allow; a scale fallen further than
    the skipped steps halve it; with no step skipped, any scale or tracker other than the
    one the clean steps leave (held-out draws 9948, 9972: a scaler rebuilt at 2^16 that grew
    back to *before*'s scale, its tracker not *before*'s plus the steps).
    """
    p = diff.pair
    sa, sb = p.scaler_a or {}, p.scaler_b or {}
    la, lb = p.loss_scale_a, p.loss_scale_b
    if not la or not lb or p.step_a is None or p.step_b is None or p.step_b <= p.step_a:
        return []
    g = p.step_b - p.step_a
    interval = _int(sa, "growth_interval") or 2000
    factor = float(sa.get("growth_factor") or 2.0)
    backoff = float(sa.get("backoff_factor") or 0.5)
    ta, tb = _int(sa, "_growth_tracker"), _int(sb, "_growth_tracker")
    k = _applied(p)
    counter_ok = k is not None and 0 <= k <= g
    why = None
    # At most one growth per growth_interval clean steps, counted from before's tracker.
    max_growth = factor ** (((ta if ta is not None else interval - 1) + g) // interval)
    if lb > la * max_growth * (1 + 1e-6):
        why = f"the scale grew from {la:g} to {lb:g} in {g} steps, more than growth_interval {interval} allows (x{max_growth:g})"
    elif counter_ok and lb < la * backoff ** (g - k) * (1 - 1e-6):
        why = f"the scale fell from {la:g} to {lb:g} though {g - k} step(s) were skipped (each backoff skips one, x{backoff:g})"
    elif counter_ok and k == g and ta is not None:
        want = scaler_after_clean_steps(la, ta, g, factor, interval)
        if abs(lb - want[0]) > 1e-6 * want[0] or (tb is not None and tb != want[1]):
            why = (
                f"{g} clean steps (no optimizer step skipped) take the scale from {la:g} (tracker {ta}) "
                f"to {want[0]:g} (tracker {want[1]}); the checkpoint holds {lb:g} (tracker {tb})"
            )
    if why is None:
        return []
    resume = _scaler_resume(p.step_a, p.step_b, lb, tb, factor, interval, k == g)
    # No step skipped since: the tracker counts the steps since the resume exactly.
    when = "" if resume is None else f" (at step {resume}{'' if k == g else ' or before'})"
    return [
        Finding(
            "",
            "loss_scaler_reset",
            "run",
            5.0,
            "critical",
            {
                "scale_before": la,
                "scale_after": lb,
                "tracker_before": ta,
                "tracker_after": tb,
                "growth_interval": interval,
                "resume_step": resume,
            },
            f"the loss scaler was rebuilt at a resume{when}: {why}",
            "docs/signatures.md#loss-scaler-reset",
            ("loss_scaler_reset",),
            primary=True,
        )
    ]
