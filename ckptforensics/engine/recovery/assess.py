"""The whole: the resumed leg judged against the trajectory, new onsets and relapses, the plan's
checks, and the paragraph a ticket starts with (`recovery`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.stats import (
    CURVE_SHORT,
    LOSS_FOLLOW,
)
from ckptforensics.core.tensors import lr_growth_limit
from ckptforensics.detectors.log import TriageConfig, log_evidence, log_onsets
from ckptforensics.engine.recovery.checks import Check
from ckptforensics.engine.recovery.gather import plan_checks
from ckptforensics.engine.recovery.legs import Rows, Split, read_legs, split_legs
from ckptforensics.engine.recovery.trajectory import (
    Z_BAND,
    Trajectory,
    Window,
    fit_trajectory,
    judge,
    verdict_of,
)
from ckptforensics.logs import lr_columns

__all__ = ["RecoveryResult", "relapse_steps", "summarize", "recovery"]


@dataclass(slots=True)
class RecoveryResult:
    """`recovery`'s answer: the verdict, the windows and checks behind it, the series to plot."""

    status: str
    step: int | None
    resumed_from: int
    onset: int | None
    summary: str
    windows: list[Window] = field(default_factory=list)
    onsets: list[dict[str, Any]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    trajectory: dict[str, Any] = field(default_factory=dict)
    gap_trend: dict[str, Any] | None = None
    legs: list[dict[str, Any]] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    plan: str | None = None
    log: str = ""
    checkpoint_after: str | None = None
    run_dir: str = ""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        d["windows"] = [asdict(w) for w in self.windows]
        return d


def _onsets(pre: Rows, resumed: Rows, resumed_from: int) -> list[Any]:
    """triage's onsets (detectors.log) on the pre-incident steps and the resumed leg together,
    after the resume."""

    rows = {**pre, **resumed}
    cfg = TriageConfig()
    found, _ = log_onsets(log_evidence(rows, cfg), cfg)
    return [o for o in found if o.step > resumed_from]


_LR_SIGNALS = ("lr", "lr_restart")


def relapse_steps(
    onsets: Sequence[Any], pre: Rows | None = None, resumed: Rows | None = None
) -> list[int]:
    """The steps where the incident comes back: each loss or grad-norm onset (triage's, so a
    grad-norm one the loss followed), dated to an LR jump at most `LOSS_FOLLOW` steps before it
    where there is one (the jump is the cause; the loss answers a step later); and an LR jump
    to above anything the pre-incident leg ran at (its last LR of that column times what a
    warmup allows, `lr_growth_limit`): the fault back, whatever the loss does yet. An LR jump
    back to the pre-incident level (from a first step a fresh optimizer ran at the schedule's
    start) is no relapse: the LR check reports it."""

    lr = sorted(o.step for o in onsets if o.signal == "lr")
    out = set()
    for o in onsets:
        if (
            o.signal in _LR_SIGNALS
        ):  # an LR restart (triage's `lr_restart`) is the resume's fault, not the incident's
            continue
        cause = [s for s in lr if o.step - LOSS_FOLLOW <= s <= o.step]
        out.add(cause[0] if cause else o.step)
    last_pre = max(pre) if pre else None
    for s in lr:
        row = (resumed or {}).get(s, {})
        for col in lr_columns(row) if last_pre is not None else []:
            before = (pre or {}).get(last_pre, {}).get(col)
            if before and row[col] > before * lr_growth_limit(last_pre, s):
                out.add(s)
                break
    return sorted(out)


def _grad_in_range(
    found: Sequence[Any], pre: Rows, resumed: Rows, loss_t: Trajectory, grad_t: Trajectory | None
) -> list[Any]:
    """triage's onsets, a grad-norm one inside the range its pre-incident history ran in (at
    most the highest grad norm logged over its fit) dated to the loss's own departure: the
    first step from it, within `LOSS_FOLLOW`, whose loss stands more than `Z_BAND` standard
    errors above the trajectory (dropped where there is none). A grad norm that oscillates
    (full-batch training: a near-zero-noise loss, a grad norm rising and falling by half)
    meets its own trend's narrow band at a height it has already run at; when a poisoned
    batch spikes the loss on the next step, triage reads a bad update followed by its effect
    and dates it a step early (drawn run 0 of fixtures/recovery_draws.py, at 39 for 40).
    docs/signatures.md#recovery."""
    if grad_t is None:
        return list(found)
    first, last = grad_t.fitted_on
    level = max(
        (r["grad_norm"] for s, r in pre.items() if first <= s <= last and "grad_norm" in r),
        default=math.inf,
    )
    out = []
    for o in found:
        if o.signal != "grad_norm" or not o.value <= level:
            out.append(o)
            continue
        for s in (s for s in resumed if o.step <= s <= o.step + LOSS_FOLLOW):
            if "loss" not in resumed[s]:
                continue
            v = resumed[s]["loss"]
            ok = math.isfinite(v) and v > 0  # a loss not finite has left its band outright
            x = math.log10(v) - math.log10(loss_t.expected(s)) if ok else math.inf
            z = x / math.hypot(loss_t.sigma, loss_t.pred_se(s))
            if z > Z_BAND:
                msg = (
                    f"loss {v:.4g} at step {s}, {10**x:.3g}x its trajectory (z {z:.1f}); the "
                    f"grad norm's rise at step {o.step} ({o.value:.4g}) stays within its "
                    f"pre-incident range (up to {level:.4g})"
                )
                out.append(replace(o, step=s, signal="loss", value=v, message=msg))
                break
    return out


def _incident_onset(pre: Rows, incident: Rows, resumed_from: int) -> int | None:
    if not incident:
        return None

    cfg = TriageConfig()
    found, _ = log_onsets(log_evidence({**pre, **incident}, cfg), cfg)
    return next((o.step for o in found if o.step > resumed_from), None)


def summarize(
    status: str,
    step: int | None,
    resumed_from: int,
    windows: Sequence[Window],
    trend: dict[str, Any] | None,
    checks: Sequence[Check],
    onsets: Sequence[Any],
) -> str:
    """The one paragraph a ticket starts with: the verdict, then the failed checks."""
    last = windows[-1] if windows else None
    if status == "relapsed":
        o = next((x for x in onsets if x.step == step), None)
        head = (
            f"Relapsed at step {step}, {step - resumed_from} steps after the resume from step {resumed_from}"
            + (f": {o.message}" if o else "")
            + "."
        )
    elif status == "recovered":
        head = (
            f"Recovered at step {step}: from there to step {last.last if last else step} the loss stays on the pre-incident trajectory "
            f"(last window {last.ratio:.3g}x of it)"
            + (
                f" and the grad norm at {last.grad_ratio:.3g}x its pre-incident level"
                + (
                    " (above its band; the loss does not follow it)"
                    if last.grad_z is not None and last.grad_z > Z_BAND
                    else ""
                )
                if last and last.grad_ratio is not None
                else ""
            )
            + "."
        )
    elif status == "recovering" and trend and "held" in trend:
        head = (
            f"Recovering: on the pre-incident trajectory since step {step}, held {trend['held']} steps of the {trend['needed']} "
            "that call it recovered."
        )
    elif status == "recovering":
        t = trend or {}
        head = (
            f"Recovering: the loss is {last.ratio:.3g}x the pre-incident trajectory at step {last.last}"
            if last
            else "Recovering"
        )
        if t.get("closing"):
            head += (
                f", the gap closing ({t['slope_per_100_steps']:+.3g} log10 per 100 steps"
                + (f", back around step {t['projected_step']}" if t.get("projected_step") else "")
                + ")"
            )
        head += "."
    else:
        head = (
            f"Not recovered: the loss is {last.ratio:.3g}x the pre-incident trajectory at step {last.last} and the gap is not closing."
            if last
            else "Not recovered: no step logged after the resume."
        )
    failed = [c for c in checks if c.status == "failed"]
    if failed:
        head += " The resume went wrong: " + "; ".join(c.message for c in failed) + "."
    return head


def recovery(
    run_dir: Path,
    resumed_from: int,
    *,
    metrics: Path | None = None,
    plan: dict[str, Any] | None = None,
    plan_source: str | None = None,
    flight: Path | None = None,
    checkpoint: Path | None = None,
    width: int = CURVE_SHORT,
) -> RecoveryResult:
    """Judge the run resumed at `resumed_from` (see the module docstring).

    Args:
        run_dir: the run's directory (its log and checkpoints).
        resumed_from: the step of the checkpoint the run resumed from.
        metrics: the log, when it is not found in `run_dir`.
        plan: the `plan` section the resume followed (its `expect` block is checked).
        flight: the flight recorder of the resumed leg (default: `run_dir/flight` if there).
        checkpoint: the first checkpoint the resumed leg wrote (default: the first complete
            one after `resumed_from`).
        width: steps per window.

    Raises:
        ForensicsError: no log, no step after the resume, too little history to fit.
    """
    legs = read_legs(run_dir, metrics)
    sp = split_legs(legs, resumed_from)
    expect = (plan or {}).get("expect") or {}
    onset = expect.get("onset") or _incident_onset(sp.pre, sp.incident, resumed_from)
    fit_until = min(resumed_from, onset - 1) if onset is not None else resumed_from
    pre_steps = [s for s in sp.pre if s <= fit_until and "loss" in sp.pre[s]]
    loss_t = fit_trajectory(pre_steps, [sp.pre[s]["loss"] for s in pre_steps])
    if loss_t is None:
        raise ForensicsError(
            f"{legs[0].source}: {len(pre_steps)} logged losses before step {fit_until + 1}; the pre-incident trajectory needs {CURVE_SHORT}"
        )
    gsteps = [s for s in sp.pre if s <= fit_until and "grad_norm" in sp.pre[s]]
    grad_t = fit_trajectory(gsteps, [sp.pre[s]["grad_norm"] for s in gsteps], held=True)
    found = _onsets(sp.pre, sp.resumed, resumed_from)
    found = _grad_in_range(found, sp.pre, sp.resumed, loss_t, grad_t)
    relapses = relapse_steps(found, sp.pre, sp.resumed)
    windows = judge(sp.resumed, loss_t, grad_t, relapses, width)
    status, step, trend = verdict_of(windows, relapses, sp.resumed, loss_t, width)
    # The LR check reads triage's LR onsets: a scheduler restarted at the resume first.
    lr_onsets = sorted(
        (o for o in found if o.signal in _LR_SIGNALS),
        key=lambda o: (o.signal != "lr_restart", o.step),
    )
    checks, after = plan_checks(run_dir, resumed_from, sp, expect, flight, checkpoint, lr_onsets)
    res = RecoveryResult(
        status,
        step,
        resumed_from,
        onset,
        "",
        windows,
        [{"step": o.step, "signal": o.signal, "message": o.message} for o in found],
        checks,
    )
    res.summary = summarize(status, step, resumed_from, windows, trend, checks, found)
    res.gap_trend = trend
    res.trajectory = {
        "model": "log10 value = a + b log10 step, Theil-Sen (docs/signatures.md#recovery)",
        "loss": _fit(loss_t),
        "grad_norm": None if grad_t is None else _fit(grad_t),
        "grad_norm_level": "the highest the trend ran at: over the fit, or extrapolated",
        "band_z": Z_BAND,
        "window": width,
    }
    res.legs = [
        {"source": leg.source, "first": leg.first, "last": leg.last, "steps": len(leg.rows)}
        for leg in legs
    ]
    res.series = _series(sp, loss_t, grad_t, width)
    res.plan, res.log, res.checkpoint_after, res.run_dir = (
        plan_source,
        sp.resumed_source,
        after,
        str(run_dir),
    )
    return res


def _fit(t: Trajectory) -> dict[str, Any]:
    """A trajectory for the report: its line, its noise and the two estimates behind it."""
    return {
        "slope": t.slope,
        "intercept": t.intercept,
        "sigma": t.sigma,
        "residual_sigma": t.residual_sigma,
        "step_sigma": t.step_sigma,
        "held": t.held,
        "fitted_on": list(t.fitted_on),
        "n": t.n,
    }


def _series(sp: Split, loss_t: Trajectory, grad_t: Trajectory | None, width: int) -> dict[str, Any]:
    def cols(rows: Rows) -> dict[str, list[float]]:
        return {
            "step": list(rows),
            "loss": [r.get("loss", math.nan) for r in rows.values()],
            "grad_norm": [r.get("grad_norm", math.nan) for r in rows.values()],
        }

    steps = list(sp.resumed)
    return {
        "pre": cols(sp.pre),
        "incident": cols(sp.incident),
        "resumed": cols(sp.resumed),
        "expected_loss": [loss_t.expected(s) for s in steps],
        "loss_band_upper": [loss_t.at(s) * 10 ** loss_t.band(s, width) for s in steps],
        "expected_grad_norm": [grad_t.expected(s) for s in steps] if grad_t is not None else [],
    }
