"""The state stage's check against the run's own log: whether the replay is the run (and so
evidence), a spike it does not reproduce, and the explanations replayed where it parted from the
log (`engine.replay.variants`): hardware is named only where none is left open (issue #42)."""

from __future__ import annotations

from typing import Any

from ckptforensics.detectors.base import Finding, Thresholds
from ckptforensics.detectors.replay.evidence import ReplayEvidence
from ckptforensics.detectors.replay.onset import log_onset

__all__ = ["WITHHELD", "log_agreement", "replay_variant"]


# Statuses of the replay's check against the run's log whose replay is not evidence.
WITHHELD = ("missed_first", "missed_later", "unexplained")


def log_agreement(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Whether the replay reproduces the run's own log, and so whether it is evidence.

    Every replayed step with a logged figure is compared (`replay.logcheck`). The first miss
    D decides: at or after the replay's own onset, the run diverged after the spike (still
    evidence); where the log spikes at D and the replay, which matched every step before,
    does not, the spike does not reproduce from the same state and batch (a hardware fault
    or nondeterminism); otherwise the replay is not the run: on the first checked step it is
    refused (`--allow-mismatch` writes the diff's report), later its evidence is withheld.
    """
    rep = ev.rep
    check = rep.check
    first, miss = check.first_checked, check.first_miss
    base = {
        "checked": len([c for c in check.checks if c.checked]),
        "first_checked": first,
        "loss_as": check.loss_as,
        "note": check.note,
    }
    src = "docs/signatures.md#replay-vs-log"
    if first is None:
        why = check.note or "no logged figure for the window"
        msg = f"the replay could not be checked against the run's log ({why}): its evidence stands unchecked"
        return [
            Finding(
                "",
                "replay_log_agreement",
                "run",
                1.0,
                "info",
                {**base, "status": "unchecked"},
                msg,
                src,
                (),
            )
        ]
    if miss is None:
        msg = f"every replayed step with a logged figure matches the run's log ({base['checked']} steps; the log's loss read as {check.loss_as})"
        return [
            Finding(
                "",
                "replay_log_agreement",
                "run",
                1.0,
                "info",
                {**base, "status": "matched"},
                msg,
                src,
                (),
            )
        ]
    d = miss.step
    figures = _figures(miss)
    onset = ev.step if ev.bad else None
    metrics = {
        **base,
        "step": d,
        "replayed_loss": miss.loss,
        "logged_loss": miss.logged_loss,
        "replayed_grad_norm": miss.grad_norm,
        "logged_grad_norm": miss.logged_grad_norm,
    }
    if onset is not None and onset <= d:
        msg = f"the replay matches the run's log up to step {d - 1} and diverges from it at step {d} ({figures}), after the spike at step {onset}"
        return [
            Finding(
                "",
                "replay_log_agreement",
                "run",
                1.0,
                "info",
                {**metrics, "status": "diverged_after_onset"},
                msg,
                src,
                (),
            )
        ]
    if log_onset(ev.rep, th, d) == d and len(rep.baseline) >= 5:
        n = sum(c.checked for c in check.checks if c.step < d)
        before = (
            f"matching the log on every step before it ({n} checked)"
            if d != first
            else "from the checkpoint's own state"
        )
        open_questions = _unexcluded(rep)
        if open_questions:
            # Not reproduced, and not explained either: the run's files name explanations the
            # replay could not exclude, so nothing says hardware (issue #42).
            msg = (
                f"step {d}: the run's log spikes ({figures}) where the replay from the same state and batch does not, {before}: "
                f"not reproduced, unexplained ({'; '.join(open_questions)}); not evidence of a hardware fault"
            )
            return [
                Finding(
                    "",
                    "replay_unexplained",
                    f"step {d}",
                    1.0,
                    "warning",
                    {**metrics, "status": "unexplained", "open": open_questions},
                    msg,
                    src,
                    (),
                )
            ]
        msg = (
            f"step {d}: the run's log spikes ({figures}) where the replay from the same state and batch does not, {before}, "
            f"with every step's LR from {rep.config['lr']['source']} and the optimizer's step counters unbroken: "
            "the spike does not reproduce (a hardware fault or nondeterminism)"
        )
        return [
            Finding(
                "",
                "replay_spike_not_reproduced",
                f"step {d}",
                10.0,
                "critical",
                {**metrics, "status": "not_reproduced"},
                msg,
                src,
                ("silent_corruption",),
                primary=True,
            )
        ]
    status = "missed_first" if d == first else "missed_later"
    where = (
        "on its first checked step"
        if d == first
        else f"at step {d}, where neither the log nor the replay spikes"
    )
    msg = f"the replay does not reproduce the run's own log {where} ({figures})"
    if rep.diagnosis:
        msg += f"; likeliest: {rep.diagnosis}"
    return [
        Finding(
            "",
            "replay_withheld",
            f"step {d}",
            1.0,
            "info",
            {**metrics, "status": status},
            msg,
            src,
            (),
        )
    ]


def _unexcluded(rep: Any) -> list[str]:
    """What the run's files name that a spike the replay misses could be, other than a fault:
    explanations replayed without landing (`engine.replay.variants`), and an LR the replay did
    not take from a log for every step (an LR fault shows in the loss a step later, where
    the replay ran on another LR). Empty: only a fault is left."""
    out = [
        f"tried {v.name}: {'missed the log at step ' + str(v.first_miss) if v.first_miss is not None else 'no check'}"
        for v in rep.variants[1:]
        if not v.lands
    ]
    lr_src = str((rep.config.get("lr") or {}).get("source", ""))
    if not lr_src.startswith(("batch log", "training log")):
        out.append(f"the LR of each step is not in the run's log (the replay used {lr_src})")
    drawn = sorted(
        {
            part
            for r in rep.records
            for layer in getattr(getattr(r, "router", None), "drawn", ())
            for part in layer.split(", ")
            if part
        }
    )
    if drawn:
        # DeepSpeed-MoE's gates draw from torch's RNG by default (`trainers/deepspeed/moe_gate`).
        out.append(
            f"the MoE gates drew their routing from torch's RNG ({', '.join(drawn)}), which no replay redraws"
        )
    return out


def replay_variant(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """A replay that parted from the run's log and landed on it under an explanation its files
    name (`engine.replay.variants`): that explanation is the finding, reproduced (a fresh
    optimizer's replay landing on the log is stronger evidence of a lost state than the
    counters alone)."""
    v = ev.rep.explained_by
    if v is None:
        return []
    planned = ev.rep.variants[0] if ev.rep.variants else None
    parted = (
        f"the replay as planned parts from the log at step {planned.first_miss}"
        if planned is not None and planned.first_miss is not None
        else f"the replay as planned stays on the log but not on after ({planned.note.split('; ')[-1]})"
        if planned is not None and planned.note
        else "the replay as planned parts from the log"
    )
    fresh = ev.rep.plan.fresh_from if ev.rep.plan is not None else None
    metrics: dict[str, Any] = {
        "variant": v.name,
        "why": v.why,
        "matched_to": v.matched_to,
        "tried": [x.name for x in ev.rep.variants],
    }
    if v.cause == "optimizer_state_lost" and fresh is not None:
        metrics["resume_step"] = fresh - 1
    return [
        Finding(
            "",
            "replay_variant_lands",
            "run",
            10.0 if v.cause else 1.0,
            "critical" if v.cause else "info",
            metrics,
            f"{parted}; with {v.name} it lands on every checked step ({v.why})",
            "docs/signatures.md#replay-vs-log",
            (v.cause,) if v.cause else (),
            primary=v.cause is not None,
        )
    ]


def _figures(miss: Any) -> str:
    parts = []
    if miss.loss_ok is False:
        parts.append(f"loss {miss.loss:.5g} vs {miss.logged_loss:.5g} logged")
    if miss.grad_ok is False:
        parts.append(f"grad norm {miss.grad_norm:.4g} vs {miss.logged_grad_norm:.4g} logged")
    return ", ".join(parts)
