"""Did the resumed run recover? Its log against the pre-incident trajectory, and the plan's checks.

A run rolled back to step R and resumed leaves legs in its log: the pre-incident steps (up
to R), the incident leg's steps after R (where the log still has them) and the resumed
leg's. The pre-incident trajectory is fitted on the steps before the onset; each window of
the resumed leg is judged against it (loss and grad norm), the resumed leg is searched for
new onsets with `triage`'s own detectors, and the verdict is `recovered` at step S,
`recovering` (the gap to the trajectory closing), `not recovered`, or `relapsed` at step S.
Beside it, the checks that the resume was the plan: the LR, clip, precision and loss scale
the new leg runs with, the optimizer state it resumed (Adam's step counter against the
trainer's), and the skipped samples not seen again (docs/signatures.md#recovery).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ForensicsError
from .stats import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    CURVE_SHORT,
    CURVE_WINDOW,
    MAD_TO_SIGMA,
    theil_sen_at,
)

__all__ = [
    "Leg",
    "Trajectory",
    "Window",
    "Check",
    "RecoveryResult",
    "STATUSES",
    "read_legs",
    "fit_trajectory",
    "judge",
    "optimizer_resumed",
    "recovery",
    "Z_BAND",
]

Rows = dict[int, dict[str, float]]
STATUSES = ("recovered", "recovering", "not recovered", "relapsed")

# A window is on the trajectory when its median log10 residual is within three standard
# errors of zero: the median of W steps has standard error sqrt(pi/2) sigma / sqrt(W)
# (1.2533 sigma / sqrt(W); Kenney & Keeping 1962, the median's asymptotic variance), to which
# the fitted line's own prediction error at that step is added (the OLS prediction interval,
# sigma sqrt(1/n + (x - mean x)^2 / Sxx), Theil-Sen's efficiency being near OLS's on normal
# noise). Three standard errors: a 0.1% one-sided false alarm per window.
Z_BAND = 3.0
MEDIAN_SE = math.sqrt(math.pi / 2)


@dataclass(frozen=True, slots=True)
class Leg:
    """What one launch of the trainer logged: step -> metrics, and where it came from."""

    source: str
    rows: Rows

    @property
    def first(self) -> int:
        return min(self.rows)

    @property
    def last(self) -> int:
        return max(self.rows)


# ---------------------------------------------------------------- reading the legs
def read_legs(run_dir: Path, metrics: Path | None = None) -> list[Leg]:
    """The legs of a run's log, in the order they started (the logs package's readers: a file
    a restart appends to splits where its steps go back; Lightning's CSVLogger writes a
    version folder per launch, TensorBoard an events file; an HF Trainer's
    `trainer_state.json` carries the rows it resumed with, so its newest holds the
    pre-incident and the resumed steps as one leg, the incident leg's rows gone with the
    checkpoints the resumed run overwrote). Our column names (`loss`, `grad_norm`, `lr`,
    `loss_scale`) are added as `logs.read_metrics` adds them.

    Raises:
        ForensicsError: no log found, or one no reader reads.
    """
    from .logs import discover_metrics, find_logs
    from .logs.columns import canonical
    from .logs.readers import read_file

    if metrics is not None and not metrics.is_dir():
        files = [metrics]
    else:
        files = find_logs(metrics or run_dir)
        if not files:
            discover_metrics(metrics or run_dir)  # the one-line error naming what was looked for
    read = [leg for f in files for leg in read_file(f)]
    out = []
    for leg in sorted(read, key=lambda x: (x.started, x.source, x.order)):
        if leg.rows:
            canonical(leg.rows)
            out.append(Leg(leg.source, dict(sorted(leg.rows.items()))))
    if not out:
        raise ForensicsError(f"{', '.join(map(str, files))}: no rows with a step")
    return out


@dataclass(frozen=True, slots=True)
class Split:
    """The legs around a resume at step R: the pre-incident rows (steps <= R, as first
    logged), the incident leg's rows after R (empty where the log lost them), the resumed
    leg's rows after R."""

    pre: Rows
    incident: Rows
    resumed: Rows
    resumed_source: str
    incident_source: str | None


def split_legs(legs: Sequence[Leg], resumed_from: int) -> Split:
    """Which rows are which, around the resume at `resumed_from`.

    Raises:
        ForensicsError: no leg logged a step after `resumed_from`.
    """
    after = [leg for leg in legs if leg.last > resumed_from]
    if not after:
        raise ForensicsError(
            f"no step after {resumed_from} in the log ({', '.join(sorted({leg.source for leg in legs}))}): has the resumed run logged yet?"
        )
    resumed = after[-1]
    pre: Rows = {}
    for leg in legs:
        for s, r in leg.rows.items():
            if s <= resumed_from and s not in pre:
                pre[s] = r
    earlier = [leg for leg in after[:-1] if any(s > resumed_from for s in leg.rows)]
    inc = earlier[0] if earlier else None
    return Split(
        dict(sorted(pre.items())),
        {s: r for s, r in sorted(inc.rows.items()) if s > resumed_from} if inc is not None else {},
        {s: r for s, r in sorted(resumed.rows.items()) if s > resumed_from},
        resumed.source,
        inc.source if inc is not None else None,
    )


# ---------------------------------------------------------------- the trajectory
@dataclass(frozen=True, slots=True)
class Trajectory:
    """A curve's pre-incident trend: log10(value) against log10(step), a line (a power law,
    the form loss curves follow in steps: Kaplan et al. 2020, 2001.08361), fitted by
    Theil-Sen as `triage` fits its trend, with the residuals' robust spread as its noise.

    Attributes:
        slope, intercept: log10 value = intercept + slope * log10 step.
        sigma: robust spread of the residuals (log10 units; floored at `CURVE_FLOOR`).
        fitted_on: (first, last) step of the fit; n: steps fitted.
        x_mean, sxx: the fit's log10 steps' mean and sum of squares (its prediction error).
    """

    slope: float
    intercept: float
    sigma: float
    fitted_on: tuple[int, int]
    n: int
    x_mean: float
    sxx: float

    def at(self, step: float) -> float:
        """The trajectory's value (the curve's units) at `step`."""
        return float(10 ** (self.intercept + self.slope * math.log10(step)))

    def pred_se(self, step: float) -> float:
        """Standard error of the line at `step` (log10 units)."""
        x = math.log10(step)
        return self.sigma * math.sqrt(1 / self.n + (x - self.x_mean) ** 2 / max(self.sxx, 1e-12))


def fit_trajectory(steps: Sequence[int], values: Sequence[float]) -> Trajectory | None:
    """The trend of a curve's last steps (None: fewer than `CURVE_SHORT` finite, positive ones).

    The fit takes the last half of the history, at least `CURVE_MIN_HISTORY` and at most
    `CURVE_WINDOW` steps (triage's history bounds): the recent regime, not warmup's descent."""
    pts = [
        (s, v) for s, v in zip(steps, values, strict=True) if s > 0 and math.isfinite(v) and v > 0
    ]
    if len(pts) < CURVE_SHORT:
        return None
    n = min(len(pts), max(CURVE_MIN_HISTORY, min(CURVE_WINDOW, len(pts) // 2)))
    pts = pts[-n:]
    x = [math.log10(s) for s, _ in pts]
    y = [math.log10(v) for _, v in pts]
    a, b = theil_sen_at(x, y, 0.0), theil_sen_at(x, y, 1.0)
    slope, icpt = b - a, a
    res = np.asarray(y) - (icpt + slope * np.asarray(x))
    sigma = max(MAD_TO_SIGMA * float(np.median(np.abs(res - np.median(res)))), CURVE_FLOOR)
    xa = np.asarray(x)
    return Trajectory(
        slope,
        icpt,
        sigma,
        (pts[0][0], pts[-1][0]),
        n,
        float(xa.mean()),
        float(((xa - xa.mean()) ** 2).sum()),
    )


@dataclass(frozen=True, slots=True)
class Window:
    """One window of the resumed leg against the trajectory.

    Attributes:
        loss, expected_loss: medians of the logged loss and of the trajectory over the window.
        ratio: 10^(median log10 residual): the loss over the trajectory.
        z: that median residual in standard errors (`Z_BAND`); one-sided, below is on track.
        grad_norm, grad_level, grad_ratio, grad_z: the same for the grad norm.
        onsets: steps of the window where `triage`'s detectors find an onset.
    """

    first: int
    last: int
    loss: float
    expected_loss: float
    ratio: float
    z: float
    grad_norm: float | None
    grad_level: float | None
    grad_ratio: float | None
    grad_z: float | None
    onsets: list[int]
    in_band: bool


def _window(
    steps: list[int], vals: list[float], t: Trajectory
) -> tuple[float, float, float, float]:
    """(median value, median expected, ratio, z) of one window."""
    fin = [(s, v) for s, v in zip(steps, vals, strict=True) if v > 0]
    if len(fin) < len(vals):  # a non-finite or non-positive step: off the trajectory outright
        return float("nan"), float(np.median([t.at(s) for s in steps])), math.inf, math.inf
    res = [math.log10(v) - math.log10(t.at(s)) for s, v in fin]
    mid = steps[len(steps) // 2]
    se = math.sqrt((MEDIAN_SE * t.sigma) ** 2 / len(fin) + t.pred_se(mid) ** 2)
    r = float(np.median(res))
    return float(np.median(vals)), float(np.median([t.at(s) for s in steps])), float(10**r), r / se


def judge(
    resumed: Rows,
    loss_t: Trajectory,
    grad_t: Trajectory | None,
    onsets: Sequence[int],
    width: int = CURVE_SHORT,
) -> list[Window]:
    """The resumed leg in windows of `width` steps (a last window under half a width joins
    the one before), each against the trajectories."""
    steps = [s for s in resumed if "loss" in resumed[s]]
    chunks = [steps[i : i + width] for i in range(0, len(steps), width)]
    if len(chunks) > 1 and len(chunks[-1]) < width / 2:
        tail = chunks.pop()
        chunks[-1] = chunks[-1] + tail
    out = []
    for ch in chunks:
        vals = [resumed[s].get("loss", math.nan) for s in ch]
        vals = [v if math.isfinite(v) else -1.0 for v in vals]
        loss, exp, ratio, z = _window(ch, vals, loss_t)
        g = gl = gr = gz = None
        gsteps = [s for s in ch if "grad_norm" in resumed[s]]
        if grad_t is not None and gsteps:
            gv = [
                resumed[s]["grad_norm"] if math.isfinite(resumed[s]["grad_norm"]) else -1.0
                for s in gsteps
            ]
            g, gl, gr, gz = _window(gsteps, gv, grad_t)
        hits = [s for s in onsets if ch[0] <= s <= ch[-1]]
        ok = z <= Z_BAND and (gz is None or gz <= Z_BAND) and not hits
        out.append(Window(ch[0], ch[-1], loss, exp, ratio, z, g, gl, gr, gz, hits, ok))
    return out


# ---------------------------------------------------------------- the verdict
def verdict_of(
    windows: Sequence[Window],
    onsets: Sequence[int],
    resumed: Rows,
    loss_t: Trajectory,
    width: int = CURVE_SHORT,
) -> tuple[str, int | None, dict[str, Any] | None]:
    """(status, step, gap trend) from the windows and the new onsets.

    relapsed at S: an onset after the resume (S its step). recovered at S: every window from
    the one starting at S to the end is on the trajectory, over at least two windows (or the
    whole leg where it is shorter): `triage`'s minimum history, enough for an onset to be
    judged. recovering: off the trajectory, the gap (log10 residual) falling over the last
    two windows by more than its own noise; the trend and the step it would close at.
    not recovered: off, and not closing."""
    if onsets:
        return "relapsed", int(min(onsets)), None
    if not windows:
        return "not recovered", None, None
    k = len(windows)
    while k > 0 and windows[k - 1].in_band:
        k -= 1
    held = sum(w.last - w.first + 1 for w in windows[k:])
    if k < len(windows):
        if held >= 2 * width:
            return "recovered", windows[k].first, None
        # On the trajectory, but for fewer steps than an onset needs to be judged: not yet.
        return (
            "recovering",
            windows[k].first,
            {
                "on_trajectory_since": windows[k].first,
                "held": held,
                "needed": 2 * width,
                "closing": True,
            },
        )
    trend = _gap_trend(resumed, loss_t, width)
    if trend is not None and trend["closing"]:
        return "recovering", None, trend
    return "not recovered", None, trend


def _gap_trend(resumed: Rows, t: Trajectory, width: int) -> dict[str, Any] | None:
    """The gap's Theil-Sen slope over the last two windows (log10 per step), whether it
    closes by more than its noise across them, and the step where it would reach the band."""
    pts = [
        (s, r["loss"])
        for s, r in resumed.items()
        if "loss" in r and math.isfinite(r["loss"]) and r["loss"] > 0
    ][-2 * width :]
    if len(pts) < width:
        return None
    xs = [float(s) for s, _ in pts]
    gap = [math.log10(v) - math.log10(t.at(s)) for s, v in pts]
    a, b = theil_sen_at(xs, gap, xs[0]), theil_sen_at(xs, gap, xs[-1])
    slope = (b - a) / max(xs[-1] - xs[0], 1.0)
    noise = max(MAD_TO_SIGMA * float(np.median(np.abs(np.asarray(gap) - np.median(gap)))), t.sigma)
    closing = slope < 0 and (a - b) > noise * MEDIAN_SE / math.sqrt(len(pts) / 2)
    band = Z_BAND * MEDIAN_SE * t.sigma / math.sqrt(width)
    at = None
    if closing and b > band:
        at = int(round(xs[-1] + (b - band) / -slope))
    return {
        "slope_per_100_steps": slope * 100,
        "gap_now": float(10**b),
        "closing": bool(closing),
        "projected_step": at,
    }


# ---------------------------------------------------------------- the checks
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


def _lr_check(expect: dict[str, Any], resumed: Rows, jumps: Sequence[Any] = ()) -> Check:
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


def _train_config(ck: Any) -> dict[str, Any]:
    tc = dict(ck.scalars.get("train_config") or {})
    ta = ck.scalars.get("training_args") or {}
    if isinstance(ta, dict):
        tc.setdefault("bf16", ta.get("bf16"))
        tc.setdefault("fp16", ta.get("fp16"))
    return tc


def _clip_check(
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


def _precision_check(
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


def _scale_check(rollback_scale: float | None, resumed: Rows, expect: dict[str, Any]) -> Check:
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


def _skip_check(
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


# ---------------------------------------------------------------- the whole
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
    from .detectors.log import TriageConfig, log_evidence, log_onsets

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
    from .logs import lr_columns
    from .stats import LOSS_FOLLOW
    from .tensors import lr_growth_limit

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


def _incident_onset(pre: Rows, incident: Rows, resumed_from: int) -> int | None:
    if not incident:
        return None
    from .detectors.log import TriageConfig, log_evidence, log_onsets

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
    grad_t = fit_trajectory(gsteps, [sp.pre[s]["grad_norm"] for s in gsteps])
    found = _onsets(sp.pre, sp.resumed, resumed_from)
    relapses = relapse_steps(found, sp.pre, sp.resumed)
    windows = judge(sp.resumed, loss_t, grad_t, relapses, width)
    status, step, trend = verdict_of(windows, relapses, sp.resumed, loss_t, width)
    # The LR check reads triage's LR onsets: a scheduler restarted at the resume first.
    lr_onsets = sorted(
        (o for o in found if o.signal in _LR_SIGNALS),
        key=lambda o: (o.signal != "lr_restart", o.step),
    )
    checks, after = _checks(run_dir, resumed_from, sp, expect, flight, checkpoint, lr_onsets)
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
        "loss": {
            "slope": loss_t.slope,
            "intercept": loss_t.intercept,
            "sigma": loss_t.sigma,
            "fitted_on": list(loss_t.fitted_on),
            "n": loss_t.n,
        },
        "grad_norm": None
        if grad_t is None
        else {
            "slope": grad_t.slope,
            "intercept": grad_t.intercept,
            "sigma": grad_t.sigma,
            "fitted_on": list(grad_t.fitted_on),
            "n": grad_t.n,
        },
        "band_z": Z_BAND,
        "window": width,
    }
    res.legs = [
        {"source": leg.source, "first": leg.first, "last": leg.last, "steps": len(leg.rows)}
        for leg in legs
    ]
    res.series = _series(sp, loss_t, grad_t)
    res.plan, res.log, res.checkpoint_after, res.run_dir = (
        plan_source,
        sp.resumed_source,
        after,
        str(run_dir),
    )
    return res


def _series(sp: Split, loss_t: Trajectory, grad_t: Trajectory | None) -> dict[str, Any]:
    def cols(rows: Rows) -> dict[str, list[float]]:
        return {
            "step": list(rows),
            "loss": [r.get("loss", math.nan) for r in rows.values()],
            "grad_norm": [r.get("grad_norm", math.nan) for r in rows.values()],
        }

    steps = list(sp.resumed)
    band = [
        Z_BAND * math.sqrt((MEDIAN_SE * loss_t.sigma) ** 2 / CURVE_SHORT + loss_t.pred_se(s) ** 2)
        for s in steps
    ]
    return {
        "pre": cols(sp.pre),
        "incident": cols(sp.incident),
        "resumed": cols(sp.resumed),
        "expected_loss": [loss_t.at(s) for s in steps],
        "loss_band_upper": [loss_t.at(s) * 10**b for s, b in zip(steps, band, strict=True)],
        "expected_grad_norm": [grad_t.at(s) for s in steps] if grad_t is not None else [],
    }


def _checks(
    run_dir: Path,
    resumed_from: int,
    sp: Split,
    expect: dict[str, Any],
    flight: Path | None,
    checkpoint: Path | None,
    lr_jumps: Sequence[Any] = (),
) -> tuple[list[Check], str | None]:
    """The plan's checks, and the checkpoint after the resume they read."""
    from .formats import open_checkpoint
    from .locate import first_complete, list_checkpoints

    ckpts = list_checkpoints(run_dir) if run_dir.is_dir() else []
    rollback = next((p for s, p in ckpts if s == resumed_from), None)
    after_path = checkpoint
    if after_path is None:
        # Two checkpoints of one step (Lightning's `-v1` beside the incident leg's): the newer
        # is the resumed leg's.
        later = sorted(
            ((s, p) for s, p in ckpts if s > resumed_from),
            key=lambda sp_: (sp_[0], -sp_[1].stat().st_mtime),
        )
        got, _ = first_complete(later)
        after_path = got[1] if got else None
    r_scale = offset = None
    if rollback is not None:
        # The rollback checkpoint may be incomplete by its format's rule (a weights-only copy
        # resumed from, say): what it holds is read all the same, or nothing where it is unreadable.
        try:
            with open_checkpoint(rollback, check=False) as ck:
                r_scale = ck.scalars.get("loss_scale")
                st = _adam_steps(ck)
                if st and ck.step is not None:
                    offset = float(np.median(st)) - ck.step
        except ForensicsError:
            pass
    after_cfg = None
    checks: list[Check] = []
    if after_path is not None:
        with open_checkpoint(after_path) as ck:
            after_cfg = _train_config(ck)
            skipped = sum(
                1
                for a, b in zip(
                    list(sp.resumed.values()), list(sp.resumed.values())[1:], strict=False
                )
                if "loss_scale" in a and "loss_scale" in b and b["loss_scale"] < a["loss_scale"]
            )
            if ck.step is None:
                checks.append(
                    Check(
                        "optimizer_state",
                        "unknown",
                        None,
                        None,
                        f"{after_path} does not record its step",
                    )
                )
            else:
                checks.append(
                    optimizer_resumed(
                        _adam_steps(ck), ck.step, resumed_from, offset or 0.0, skipped
                    )
                )
    else:
        checks.append(
            Check(
                "optimizer_state",
                "unknown",
                None,
                None,
                f"no checkpoint after step {resumed_from} yet: the optimizer state is checked on the first one the resumed run writes",
            )
        )
    seen, src, recorded_clip = _recorded(run_dir, flight, resumed_from)
    checks += [
        _lr_check(expect, sp.resumed, lr_jumps),
        _clip_check(expect, after_cfg, recorded_clip),
        _precision_check(expect, after_cfg, sp.resumed),
        _scale_check(r_scale, sp.resumed, expect),
        _skip_check(expect, seen, src),
    ]
    return checks, str(after_path) if after_path is not None else None


def _adam_steps(ck: Any) -> list[float]:
    """Adam's `step` of every parameter with optimizer state (weights only: none)."""
    if ck.optimizer is None:
        return []
    out = []
    for st in ck.optimizer.state.values():
        v = st.get("step")
        if v is None:
            continue
        try:
            out.append(float(v.item() if hasattr(v, "item") else v))
        except (TypeError, ValueError):
            continue
    return out


def _recorded(
    run_dir: Path, flight: Path | None, resumed_from: int
) -> tuple[dict[int, list[int]] | None, str | None, float | None]:
    """The sample ids the flight recorder kept for each step after the resume, its source,
    and the clip it recorded (None where no recorder ran, or it kept no sample ids)."""
    root = (
        flight
        if flight is not None
        else (run_dir / "flight" if (run_dir / "flight").is_dir() else None)
    )
    if root is None:
        return None, None, None
    from .replay.batches import BatchError, open_batches

    try:
        src = open_batches(str(root))
    except (BatchError, ForensicsError, OSError):
        return None, None, None
    seen = {
        int(s): [int(x) for x in ids]
        for s, ids in (src.sample_ids or {}).items()
        if int(s) > resumed_from
    }
    return (seen or None), str(root), src.grad_clip


# ---------------------------------------------------------------- the report
_CRITICAL_CHECKS = ("optimizer_state", "skipped_samples")


def recovery_findings(res: RecoveryResult) -> list[Any]:
    """The verdict as a finding (info when recovered, warning while recovering, critical when
    not recovered or relapsed), and one per failed check (critical for a lost optimizer state
    and for skipped samples seen again, warning for a setting the plan changed that the
    resumed run does not run with)."""
    from .detectors import Finding

    sev = {
        "recovered": "info",
        "recovering": "warning",
        "not recovered": "critical",
        "relapsed": "critical",
    }[res.status]
    out = [
        Finding(
            "F1", "recovery", "run", 1.0, sev,
            {"status": res.status, "step": res.step, "resumed_from": res.resumed_from, "windows": len(res.windows), "band_z": Z_BAND},
            res.summary, "docs/signatures.md#recovery", (),
        )
    ]  # fmt: skip
    for c in res.checks:
        if c.status == "failed":
            out.append(
                Finding(
                    f"F{len(out) + 1}", f"resume_{c.name}", "run", 1.0, "critical" if c.name in _CRITICAL_CHECKS else "warning",
                    {"expected": c.expected, "observed": c.observed, "step": c.step}, c.message, "docs/signatures.md#recovery-checks", (),
                )
            )  # fmt: skip
    return out


def recovery_report(res: RecoveryResult, command: str) -> tuple[dict[str, Any], list[Any]]:
    """The `recovery` report document (schema `ckptforensics.report/1`, section `recovery`):
    *before* is the checkpoint the run resumed from, *after* the first the resumed leg wrote."""
    from .formats import open_checkpoint
    from .locate import list_checkpoints
    from .report import build_report
    from .verdict import Verdict

    findings = recovery_findings(res)
    causes = (
        [{"cause": "none", "confidence": 1.0, "evidence": []}]
        if res.status == "recovered"
        else [{"cause": "undiagnosed", "confidence": 0.0, "evidence": [f.id for f in findings]}]
    )
    v = Verdict(
        summary=res.summary,
        causes=causes,
        first_bad_step=res.step if res.status == "relapsed" else None,
    )
    v.recommended_actions = _actions(res)
    run = Path(res.run_dir or ".")
    back = next(
        (p for s, p in (list_checkpoints(run) if run.is_dir() else []) if s == res.resumed_from),
        None,
    )
    paths = [
        p
        for p in (back, Path(res.checkpoint_after) if res.checkpoint_after else None)
        if p is not None
    ]
    opened = [open_checkpoint(p, check=False) for p in paths]
    try:
        a = opened[0] if opened else _Nowhere(res.resumed_from)
        b = opened[-1] if opened else a
        doc = build_report(
            command=command,
            before=a,
            after=b,
            verdict=v,
            findings=findings,
            sections={"recovery": res.as_dict()},
            plan=False,
        )
    finally:
        for c in opened:
            c.close()
    return doc, findings


@dataclass
class _Nowhere:
    """The report's *before* where the rollback checkpoint is not in the run directory."""

    step: int
    path: str = "(not in the run directory)"
    format: str = "unknown"


def _actions(res: RecoveryResult) -> list[str]:
    out = []
    failed = {c.name: c for c in res.checks if c.status == "failed"}
    if "optimizer_state" in failed:
        out.append(
            f"Resume again from step {res.resumed_from} with the optimizer state loaded (see the plan's resume keys)."
        )
    if "skipped_samples" in failed:
        out.append(
            "The skip list did not reach the data loader: apply it as the plan's skip section says, then resume again."
        )
    for name in ("lr", "clip", "precision", "loss_scale"):
        if name in failed:
            out.append(f"Set {name.replace('_', ' ')} as the plan says: {failed[name].message}.")
    if res.status == "relapsed":
        out.append(
            f"The mitigation did not hold: run `ckptforensics replay` on the window around step {res.step} of the resumed leg."
        )
    elif res.status == "not recovered":
        out.append("Roll back further, or try a stronger mitigation (`ckptforensics whatif`).")
    elif res.status == "recovering":
        out.append("Run `ckptforensics recovery` again after more steps.")
    return out
