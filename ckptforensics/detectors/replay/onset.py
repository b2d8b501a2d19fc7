"""The onset stage: the step where the replay (or the run's own log) goes bad, and the steps
the *before* state pins down."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptforensics.core.tensors import (
    CURVE_SHORT,
    loss_follows,
    lr_growth_limit,
)
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.log.settled import settled_level
from ckptforensics.detectors.replay.evidence import ReplayEvidence, step_z
from ckptforensics.logs import group_lrs

__all__ = ["first_steps_from_state", "log_onset", "lr_steps", "spike"]


def _went_bad(
    r: Any, i: int, zl: np.ndarray, zg: np.ndarray, th: Thresholds, above: np.ndarray
) -> bool:
    """A non-finite loss, a loss off its trend (and off its recent level, unless the grad
    norm rises with it: as triage's `loss_spikes`), or a grad-norm outlier the loss follows
    (a blip the loss ignores is not a spike, as triage judges the log). Under a loss scaler
    an overflowing step (inf grad norm, update skipped) is the scaler's routine backoff: it
    too counts only where the loss follows (docs/signatures.md#skipped-steps)."""
    if not math.isfinite(r.loss) or (zl[i] > th.z and (above[i] > th.z or zg[i] >= th.z / 2)):
        return True
    scaled = bool(r.loss_scale and r.loss_scale > 1)
    # A step SkipStepAdamW skipped by its outlier rule is judged by its loss and grad norm.
    if (r.skipped and getattr(r, "skipped_by", "") != "optimizer rule") or not math.isfinite(zg[i]):
        return loss_follows(zl, i, th.z, z_grad=zg, benefit=False, routine=True) if scaled else True
    return bool(zg[i] > th.z and loss_follows(zl, i, th.z, z_grad=zg, z_level=above, settles=True))


def _z_on(
    values: list[float], later: list[float], history: list[float], above_level: bool = False
) -> np.ndarray:
    """`step_z` of the window's values, then of the logged values after it (judged with the
    window before them), which only answer whether the loss followed a late signal."""
    z = step_z(values, history, above_level=above_level)
    if not later:
        return z
    return np.concatenate(
        [z, step_z([*values, *later], history, above_level=above_level)[len(values) :]]
    )


def _onset(
    recs: Sequence[Any],
    base: Sequence[dict[str, float]],
    th: Thresholds,
    grads: bool = True,
    following: Sequence[dict[str, float]] = (),
) -> tuple[int | None, np.ndarray, np.ndarray]:
    """Index of the first step of `recs` (anything with .loss, .grad_norm, .skipped,
    .loss_scale) that goes bad against the history `base` (logged rows), and the loss and
    grad-norm z of every step (`grads` False: a log without grad norms, judged on the loss).

    `following`: the run's logged rows right after the window, while they have a loss and a
    grad norm. A grad-norm blip on the window's last steps is a spike only where the loss
    follows it (`loss_follows`); where the replay ends before the loss could answer, the log
    answers, and only where the log has nothing is the blip given the benefit (a healthy
    HF Llama's 1.6x blip on a window's last step, the loss falling on after it, was named a
    poisoned row: tests/test_hf_families.py)."""
    n = len(recs)
    later = [r for r in following if "loss" in r and "grad_norm" in r] if grads else []
    values = [r.grad_norm for r in recs]
    zg = (
        _z_on(
            values,
            [r["grad_norm"] for r in later],
            [b["grad_norm"] for b in base if "grad_norm" in b],
        )
        if grads
        else np.zeros(n)
    )
    losses, history = [r.loss for r in recs], [b["loss"] for b in base if "loss" in b]
    tail = [r["loss"] for r in later]
    zl = _z_on(losses, tail, history)
    above = _z_on(losses, tail, history, above_level=True)
    bad = [i for i, r in enumerate(recs) if _went_bad(r, i, zl, zg, th, above)]
    g_history = [b["grad_norm"] for b in base if "grad_norm" in b]
    bad = [i for i in bad if not _settled(recs, i, history, g_history, later, th, grads)]
    zl, zg = zl[:n], zg[:n]
    if not bad or (n <= 1 and len(base) < 5):
        return None, zl, zg
    return bad[0], zl, zg


def _settled(
    recs: Sequence[Any],
    i: int,
    history: list[float],
    g_history: list[float],
    later: Sequence[dict[str, float]],
    th: Thresholds,
    grads: bool,
) -> str | None:
    """Why step i, gone bad with its loss and grad norm finite, is the first step of a settled
    level shift rather than a spike (`detectors.log.settled.settled_level`, as triage judges
    the log): its loss steps up and stays there over the window's steps after it and the
    run's logged steps after the window, it is no outlier of that level, and nothing after it
    spikes. A data-mixture switch lifts the loss ~1.1x and keeps it there, the new source's
    rows the highest of every batch from then on; a poisoned batch's loss falls back. None
    where it is not one, or where the steps after it are too few to tell."""
    r = recs[i]
    if r.skipped or not math.isfinite(r.loss) or (grads and not math.isfinite(r.grad_norm)):
        return None
    losses = [*history, *(x.loss for x in recs)]
    grads_before = [*g_history, *(x.grad_norm for x in recs)]
    at = len(history) + i
    after = [*(x.loss for x in recs[i + 1 :]), *(x["loss"] for x in later)]
    g_after = [*(x.grad_norm for x in recs[i + 1 :]), *(x["grad_norm"] for x in later)]
    return settled_level(
        losses[max(0, at - 2 * CURVE_SHORT) : at],
        [r.loss, *after[:1]],
        after,
        th.z,
        [r.grad_norm, *g_after[:1]] if grads else [],
        g_after if grads else [],
        grads_before[max(0, len(g_history) + i - 2 * CURVE_SHORT) : len(g_history) + i],
    )


def spike(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The first replayed step whose loss, or grad norm with the loss following, leaves the run's trend."""
    rep = ev.rep
    recs = rep.records
    following = getattr(rep, "following", {})
    i, zl, zg = _onset(
        recs, list(rep.baseline.values()), th, following=[following[s] for s in sorted(following)]
    )
    if i is None:
        return []
    r = recs[i]
    return [
        Finding(
            "",
            "replay_spike",
            f"step {r.step}",
            cap(max(zg[i], zl[i]) / th.z) if math.isfinite(max(zg[i], zl[i])) else 10.0,
            "warning",
            {
                "step": r.step,
                "loss": r.loss,
                "grad_norm": r.grad_norm,
                "grad_z": float(zg[i]),
                "loss_z": float(zl[i]),
                "skipped": r.skipped,
            },
            f"replayed step {r.step} spikes: loss {r.loss:.3g}, grad norm {r.grad_norm:.3g} (robust z {float(max(zg[i], zl[i])):.1f} over the window)"
            + (", optimizer step skipped" if r.skipped else ""),
            "docs/signatures.md#spike-onset",
            ("gradient_explosion", "poison_batch", "lr_too_high"),
        )
    ]


def lr_steps(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """A step whose LR (as replayed) jumps past what any warmup allows: the first bad step."""

    rep = ev.rep
    plan = dict((rep.config.get("lr") or {}).get("value") or {})
    steps = sorted(plan)
    # The window's first step against the last logged step before it (a jump on the very
    # first replayed step has no replayed predecessor).
    if steps and rep.baseline:
        last = max(rep.baseline)
        n = len(plan[steps[0]])
        prev_lr = group_lrs(rep.baseline[last], n) or (
            [rep.baseline[last]["lr"]] * n if "lr" in rep.baseline[last] else None
        )
        if prev_lr is not None and last < steps[0]:
            plan[last] = list(prev_lr)
            steps = [last, *steps]
    for prev, s in zip(steps, steps[1:], strict=False):
        allowed = lr_growth_limit(prev, s, th.lr_growth_margin)
        jumped = [
            g
            for g, (la, lb) in enumerate(zip(plan[prev], plan[s], strict=False))
            if la > 0 and lb / la > allowed
        ]
        if not jumped:
            continue
        g = jumped[0]
        la, lb = plan[prev][g], plan[s][g]
        # Only some groups jumping is a per-module LR fault: those modules explode.
        confined = len(jumped) < len(plan[s])
        return [
            Finding(
                "",
                "lr_step_jump",
                f"step {s}",
                cap(lb / la / allowed),
                "critical",
                {
                    "step": s,
                    "group": g,
                    "groups": jumped,
                    "lr_before": la,
                    "lr": lb,
                    "source": rep.config["lr"]["source"],
                },
                f"step {s} runs param group {g} at LR {lb:.3g}, {lb / la:.0f}x step {prev}'s"
                + (f" ({len(jumped)} of {len(plan[s])} groups)" if confined else ""),
                "docs/signatures.md#update-weight-ratio",
                ("gradient_explosion", "lr_too_high") if confined else ("lr_too_high",),
                primary=True,
            )
        ]
    return []


@dataclass(frozen=True, slots=True)
class _LoggedStep:
    """A logged row in the shape the onset rule reads (grad norm NaN where not logged)."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None


def log_onset(rep: Any, th: Thresholds, until: int) -> int | None:
    """The first step of the window, up to `until`, where the run's own log goes bad (the
    replay's onset rule on the logged figures against the logged history)."""
    rows = [
        (s, rep.logged[s]) for s in sorted(rep.logged) if s <= until and "loss" in rep.logged[s]
    ]
    if not rows:
        return None
    recs = [
        _LoggedStep(s, r["loss"], r.get("grad_norm", math.nan), False, r.get("loss_scale"))
        for s, r in rows
    ]
    i, _, _ = _onset(
        recs, list(rep.baseline.values()), th, grads=all("grad_norm" in r for _, r in rows)
    )
    return recs[i].step if i is not None else None


def first_steps_from_state(dfind: list[Finding], rep: Any) -> list[int]:
    """First bad steps that the *before* state plus the replay pin down.

    An LR already above the schedule in *before* makes the window's first step bad; a
    tensor whose exp_avg_sq had collapsed goes bad at the first replayed step whose
    gradient RMS clears the collapse level (100 eps, ten times the 10 eps floor).
    """
    out = []
    first = rep.records[0].step if rep.records else None
    for f in dfind:
        if f.kind == "lr_above_schedule" and f.metrics.get("first_step") is not None:
            out.append(int(f.metrics["first_step"]))
        if f.kind == "vanished_v_burst" and first is not None:
            level = 100 * float(f.metrics.get("eps") or 1e-8)
            hit = next(
                (r.step for r in rep.records if r.param_grad_rms.get(f.subject, 0.0) > level), None
            )
            if hit is not None:
                out.append(hit)
    return out
