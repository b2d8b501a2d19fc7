"""The pre-incident trajectory (Theil-Sen on log loss against log step), the resumed leg's
windows judged against it, and the verdict they add up to."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptforensics.core.stats import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    CURVE_SHORT,
    CURVE_WINDOW,
    MAD_TO_SIGMA,
    theil_sen_at,
)
from ckptforensics.engine.recovery.legs import Rows

__all__ = [
    "STATUSES",
    "Z_BAND",
    "MEDIAN_SE",
    "Trajectory",
    "fit_trajectory",
    "Window",
    "judge",
    "verdict_of",
]


STATUSES = ("recovered", "recovering", "not recovered", "relapsed")

# A window is on the trajectory when its median log10 residual is within three standard
# errors of zero: the median of W steps has standard error sqrt(pi/2) sigma / sqrt(W)
# (1.2533 sigma / sqrt(W); Kenney & Keeping 1962, the median's asymptotic variance), to which
# the fitted line's own prediction error at that step is added (the OLS prediction interval,
# sigma sqrt(1/n + (x - mean x)^2 / Sxx), Theil-Sen's efficiency being near OLS's on normal
# noise). Three standard errors: a 0.1% one-sided false alarm per window.
Z_BAND = 3.0
MEDIAN_SE = math.sqrt(math.pi / 2)


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
