"""The pre-incident trajectory (Theil-Sen on log loss against log step), the resumed leg's
windows judged against it, and the verdict they add up to.

The band is the run's own: its noise is the larger of two estimates of the same spread, the
residuals' about the fitted line and the successive differences' (so a curve whose residuals
are near zero, a full-batch or tiny-LR run, is still judged to its own step-to-step
movement, not to a constant), and a curve is off the trajectory only above that band.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptforensics.core.stats import (
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
    "FLOAT_RESOLUTION",
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

# The last resort of the noise estimate, for a curve that does not move at all: the relative
# spacing of float32, the precision a loss or grad norm computed in float32 is logged to
# (log10(1 + 2^-23) = 5.2e-8). Machine precision, not a tolerance: it only keeps z finite.
FLOAT_RESOLUTION = math.log10(1 + float(np.finfo(np.float32).eps))


# ---------------------------------------------------------------- the trajectory
@dataclass(frozen=True, slots=True)
class Trajectory:
    """A curve's pre-incident trend: log10(value) against log10(step), a line (a power law,
    the form loss curves follow in steps: Kaplan et al. 2020, 2001.08361), fitted by
    Theil-Sen as `triage` fits its trend, with the run's own noise as its band.

    Attributes:
        slope, intercept: log10 value = intercept + slope * log10 step.
        sigma: the noise (log10 units): the largest of the estimates below (`fit_trajectory`
            says why), at least `FLOAT_RESOLUTION`.
        fitted_on: (first, last) step of the fit; n: steps fitted.
        x_mean, sxx: the fit's log10 steps' mean and sum of squares (its prediction error).
        held: a level, not a law (the grad norm): `expected` is the highest the trend ran at.
        residual_sigma: robust spread of the residuals about the line (log10 units).
        step_sigma: robust spread of the successive differences (log10 units).
    """

    slope: float
    intercept: float
    sigma: float
    fitted_on: tuple[int, int]
    n: int
    x_mean: float
    sxx: float
    held: bool = False
    residual_sigma: float = 0.0
    step_sigma: float = 0.0

    def at(self, step: float) -> float:
        """The trend's value (the curve's units) at `step`."""
        return float(10 ** (self.intercept + self.slope * math.log10(step)))

    def expected(self, step: float) -> float:
        """What the resumed leg is judged against at `step`: the trend; for a held curve, the
        highest the trend ran at, over the fit or extrapolated to `step`. A grad norm is no
        power law to extrapolate: it falls as warmup ends, flattens, and rises again late in
        training as the LR decays (Defazio 2025, arXiv 2506.02285), so a falling trend
        carried on would call a grad norm that merely flattened off its level, and one back
        at a level it ran at just before the incident is no evidence of anything."""
        if not self.held:
            return self.at(step)
        return max(self.at(step), self.at(self.fitted_on[0]), self.at(self.fitted_on[1]))

    def pred_se(self, step: float) -> float:
        """Standard error of the line at `step` (log10 units)."""
        x = math.log10(step)
        return self.sigma * math.sqrt(1 / self.n + (x - self.x_mean) ** 2 / max(self.sxx, 1e-12))

    def se(self, step: float, width: int) -> float:
        """Standard error of a `width`-step window's median residual centred on `step` (log10
        units): the median's own, sqrt(pi/2) sigma / sqrt(width), and the line's at `step`."""
        return math.sqrt((MEDIAN_SE * self.sigma) ** 2 / width + self.pred_se(step) ** 2)

    def band(self, step: float, width: int) -> float:
        """Half-width of the band above the trajectory at `step` (log10 units): `Z_BAND`
        standard errors of a `width`-step window's median."""
        return Z_BAND * self.se(step, width)


def fit_trajectory(
    steps: Sequence[int], values: Sequence[float], held: bool = False
) -> Trajectory | None:
    """The trend of a curve's last steps (None: fewer than `CURVE_SHORT` finite, positive ones);
    `held`: a level, the grad norm's (`Trajectory.expected`).

    The fit takes the last half of the history, at least `CURVE_MIN_HISTORY` and at most
    `CURVE_WINDOW` steps (triage's history bounds): the recent regime, not warmup's descent.

    Its noise is the run's own, the larger of two estimates of one spread: the residuals'
    about the line (MAD x 1.4826), and the successive differences' (the median |change| of
    log10 value between consecutive logged steps x 1.4826 / sqrt(2): von Neumann, Kent,
    Bellinson & Hart 1941, the mean square successive difference, in its robust form). On a
    noisy curve both measure the same noise (white noise of spread s has successive
    differences of spread s sqrt(2)), so the second is inert. Where the residuals are near
    zero (full-batch data, a tiny LR: a curve the line fits to float precision), the
    differences, taken uncentred on purpose, still measure how far the curve moves in one
    logged step: the finest resolution its own history gives a trajectory, and the floor of
    the band. Not a constant: a constant floor (triage's `CURVE_FLOOR`, 4.7%) would call a run
    several percent behind a noiseless trajectory on it."""
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
    spread = MAD_TO_SIGMA * float(np.median(np.abs(res - np.median(res))))
    step = MAD_TO_SIGMA * float(np.median(np.abs(np.diff(y)))) / math.sqrt(2)
    xa = np.asarray(x)
    return Trajectory(
        slope,
        icpt,
        max(spread, step, FLOAT_RESOLUTION),
        (pts[0][0], pts[-1][0]),
        n,
        float(xa.mean()),
        float(((xa - xa.mean()) ** 2).sum()),
        held,
        spread,
        step,
    )


@dataclass(frozen=True, slots=True)
class Window:
    """One window of the resumed leg against the trajectory.

    Attributes:
        loss, expected_loss: medians of the logged loss and of the trajectory over the window.
        ratio: 10^(median log10 residual): the loss over the trajectory.
        z: that median residual in standard errors (`Z_BAND`); one-sided, below is on track.
        grad_norm, grad_level, grad_ratio, grad_z: the same for the grad norm, against its
            pre-incident level (`Trajectory.expected`): reported, deciding nothing (`judge`).
        onsets: steps of the window where `triage`'s detectors find an onset.
        in_band: on the trajectory: the loss not above its band, and no onset.
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
        return float("nan"), float(np.median([t.expected(s) for s in steps])), math.inf, math.inf
    res = [math.log10(v) - math.log10(t.expected(s)) for s, v in fin]
    r = float(np.median(res))
    z = r / t.se(steps[len(steps) // 2], len(fin))
    return float(np.median(vals)), float(np.median([t.expected(s) for s in steps])), 10**r, z


def judge(
    resumed: Rows,
    loss_t: Trajectory,
    grad_t: Trajectory | None,
    onsets: Sequence[int],
    width: int = CURVE_SHORT,
) -> list[Window]:
    """The resumed leg in windows of `width` steps (a last window under half a width joins
    the one before), each against the trajectories: the loss against its trend, the grad
    norm against its level (`Trajectory.expected`).

    A window is on the trajectory when its loss is not above the band (below it is on track)
    and no onset falls in it. The grad norm's window is reported and decides nothing by
    itself, as in `triage`, where a grad-norm excursion starts an incident only where the
    loss follows (`stats.loss_follows`): a grad norm has no law to hold it to (Defazio 2025),
    and one that drifts while the loss keeps its trajectory is the run's own dynamics; a
    grad-norm spike the loss follows is an onset, so a relapse, all the same."""
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
        ok = z <= Z_BAND and not hits
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
    judged. Off the trajectory at the end, with no onset, is a loss above its band: a gap. A
    loss within its band has none, so it is never "not closing". recovering: the gap falling
    over the last two windows by more than its own noise (the trend, and the step it would
    close at); not recovered: a gap, not closing."""
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
    # The last window is off: an onset (relapsed, above) or the loss above its band (or not
    # finite). Only a gap can be closing or not.
    trend = _gap_trend(resumed, loss_t, width) if not windows[-1].z <= Z_BAND else None
    if trend is not None and trend["closing"]:
        return "recovering", None, trend
    return "not recovered", None, trend


def _gap_trend(resumed: Rows, t: Trajectory, width: int) -> dict[str, Any] | None:
    """The loss's gap to the trajectory: its Theil-Sen slope over the last two windows
    (log10 per step), whether it closes by more than its noise across them, and the step
    where it would reach the band."""
    pts = [
        (s, r["loss"])
        for s, r in resumed.items()
        if "loss" in r and math.isfinite(r["loss"]) and r["loss"] > 0
    ][-2 * width :]
    if len(pts) < width:
        return None
    xs = [float(s) for s, _ in pts]
    gap = [math.log10(v) - math.log10(t.expected(s)) for s, v in pts]
    a, b = theil_sen_at(xs, gap, xs[0]), theil_sen_at(xs, gap, xs[-1])
    slope = (b - a) / max(xs[-1] - xs[0], 1.0)
    noise = max(MAD_TO_SIGMA * float(np.median(np.abs(np.asarray(gap) - np.median(gap)))), t.sigma)
    closing = slope < 0 and (a - b) > noise * MEDIAN_SE / math.sqrt(len(pts) / 2)
    band = t.band(xs[-1], width)
    at = None
    if closing and b > band:
        at = int(round(xs[-1] + (b - band) / -slope))
    return {
        "slope_per_100_steps": slope * 100,
        "gap_now": float(10**b),
        "closing": bool(closing),
        "projected_step": at,
    }
