"""The log's own tail (docs/signatures.md#log-blip): its loss excursions that recover
(`blips`), how long they last (`recovery_horizon`), and why a trend onset is one of them,
the log's routine rather than an incident (`routine_reason`): unconfirmed by the grad norm,
within the log's tail of peers, or recurring at the log's period."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import (
    CURVE_SHORT,
    RECUR_WEAK_Z,
    expected_exceedances,
    family_alpha,
    recurrence_period,
)
from ckptforensics.detectors.log.evidence import LogEvidence, Onset, TriageConfig, grad_up

# A loss excursion that is back under z/2 within RECOVER steps is a blip; the log's own blips
# (those over z/2) are its tail. A blip is an onset only where all of these hold (issue 32: an
# onset is an excursion that persists, or that the grad norm and the following steps confirm,
# judged against the log's own tail):
# - the grad norm confirms it (z/2 or more on its trend, on that step or the next), or the
#   log has no other blip at least half its size (UNCONFIRMED_PEERS): a loss blip the
#   gradient does not see, on a log that blips, is a batch the model found hard, not a bad
#   update; a log without a grad norm cannot confirm one;
# - the log has too few other blips reaching half its size: TAIL_PEERS, plus the count normal
#   noise of the log's spread and length could give at that height (the Poisson 99% bound on
#   stats.expected_exceedances: a 20,000-step quiet log has ~5 steps over z 3.5 by chance). A
#   run whose logged loss is one micro-batch of one rank has hundreds of them;
# - it does not recur at a period of the log's own blips (stats.recurrence_period) at which
#   the batch is met as hard at least once more (`_met_as_hard`): a fixed data order blips
#   at the same step of every epoch, however few epochs the log holds.
# A poisoned batch in an averaged, quiet log is alone, and its gradient is large.
RECOVER, HOLD, TAIL_PEERS = 2, 3, 2
# How long this log's blips last: its excursions over z/2 shorter than CURVE_SHORT (a longer one
# is a held excursion, not a blip) fitted by a geometric distribution of durations (each step
# of an excursion continues it with one probability: the maximum-likelihood fit is 1/mean);
# a blip recovers within the longest of the log's n excursions the fit allows at 1% for all n
# together (scipy.stats.geom.isf at stats.family_alpha(n, 1%), Sidak), at least RECOVER and at
# most half CURVE_SHORT. Fewer than BLIP_FIT excursions fit nothing: RECOVER. A log whose
# blips last one step keeps 2; one rank's micro-batch, or junk batches in a row, last 2-3.
BLIP_ALPHA, BLIP_FIT = 0.01, 3


def _run_of(ev: LogEvidence, cfg: TriageConfig, i: int) -> tuple[int, int]:
    """[a, b): the indexes of the loss's run over z/2 on its trend that holds index i (i alone
    where it is not over)."""
    over = np.isfinite(ev.loss.z) & (ev.loss.z > cfg.z / 2)
    if not over[i]:
        return i, i + 1
    a, b = i, i + 1
    while a > 0 and over[a - 1]:
        a -= 1
    while b < over.size and over[b]:
        b += 1
    return a, b


def recovery_horizon(ev: LogEvidence, cfg: TriageConfig, judged: int | None = None) -> int:
    """Steps within which a blip of this log comes back under z/2 (docs/signatures.md#log-blip),
    from its excursions other than the one holding index `judged`: an excursion is measured
    against the log's other blips, never against itself (a fault whose loss decays back over
    five lines of a log printed every 5 iterations would otherwise stretch the horizon it is
    then excused by: tuning log draw 581)."""
    from scipy import stats

    over = np.isfinite(ev.loss.z) & (ev.loss.z > cfg.z / 2)
    runs, n = [], 0
    for i, o in enumerate([*over.tolist(), False]):
        if o:
            n += 1
        elif n:
            if judged is None or not (i - n <= judged < i):
                runs.append(n)
            n = 0
    runs = [r for r in runs if r < CURVE_SHORT]
    if len(runs) < BLIP_FIT or max(runs) == 1:
        return RECOVER  # too few to fit, or every blip lasts one step
    q = int(stats.geom.isf(family_alpha(len(runs), BLIP_ALPHA), 1.0 / float(np.mean(runs))))
    return min(max(RECOVER, q), CURVE_SHORT // 2)


# A blip the grad norm does not confirm is routine only on a log that blips so at all: one
# other blip at least half its size (a quiet log's lone poisoned batch, whose junk rows move
# the gradient less than z/2, stays an onset).
UNCONFIRMED_PEERS = 1


def blips(
    ev: LogEvidence, cfg: TriageConfig, floor: float | None = None
) -> dict[int, tuple[float, float]]:
    """step -> (robust z, log10 excess over the level before it) of every loss excursion
    (z > `floor`, default cfg.z; finite, under the 10x rule) that recovers: back under z/2
    within the log's own blip duration (`recovery_horizon`), and either under half its excess
    there too (the excursion has ended: a rise after that is another excursion, which the
    blip's level does not continue into) or held down the HOLD steps after its return (their
    median under half its excess: a spike that dips to the band once and climbs back is the
    start of a held rise, not a blip; docs/signatures.md#log-blip)."""
    z, steps, vals, base = ev.loss.z, ev.loss.steps, ev.loss.values, ev.loss.level
    floor = cfg.z if floor is None else floor
    lv = np.log10(np.maximum(np.asarray(vals, dtype=np.float64), 1e-30))
    out = {}
    for i, zi in enumerate(z):
        if (
            not (zi > floor and math.isfinite(vals[i]) and math.isfinite(base[i]))
            or vals[i] >= cfg.loss_factor * base[i]
        ):
            continue
        # An excursion the grad norm confirms (an update the gradient saw) is measured against
        # the log's other excursions, never against itself; one it does not see is the log's
        # routine kind and is measured with them (a single rank's three-step blip among its
        # one-step ones: tuning log draw 544).
        own = None if not _grad_confirms(steps[i], ev, cfg)[0] else i
        horizon = recovery_horizon(ev, cfg, own)
        usual = _usual_excess(ev, cfg, own)
        # Recovery is judged against the level before the excursion, in the noise units it
        # was measured in (the trend itself moves up under a rise it accepts: steps under z 6
        # enter it, so the next steps' own z would call a held rise recovered), or within
        # where this log's steps usually are, if that is wider (a heavy tail's MAD is narrow).
        lb = math.log10(base[i])
        excess = lv[i] - lb
        band = lb + max((cfg.z / 2) * excess / zi, usual)
        after = lv[i + 1 : i + 1 + horizon + HOLD]
        first = after[:horizon]
        if (
            len(first) < min(horizon, RECOVER)
            or not np.isfinite(first).all()
            or not (first <= band).any()
        ):
            continue
        # Back under the band and under half its excess within the horizon: the excursion has
        # ended (contiguity: a rise after it is another excursion, which does not continue from
        # this level). Back under the band only: the HOLD steps after the return stay down
        # (their median under half its excess).
        back = int(np.argmax(first <= band))
        hold = after[back + 1 : back + 1 + HOLD]
        ended = bool((first <= min(band, lb + excess / 2)).any())
        if (
            not ended
            and hold.size
            and not float(np.median(np.where(np.isfinite(hold), hold, np.inf))) < lb + excess / 2
        ):
            continue
        out[steps[i]] = (float(zi), float(excess))
    return out


# "Where the log's steps usually are": the 90th percentile of their log10 excess over the
# level before them. On a normal noise that is 1.3 noise units (inside the z/2 band); on a
# loss logged from one rank's micro-batch, whose MAD is narrow and whose tail is wide, it is
# the step-to-step range the log lives in.
USUAL_Q = 90


def _usual_excess(ev: LogEvidence, cfg: TriageConfig, judged: int | None = None) -> float:
    """The USUAL_Q percentile of the log's steps' log10 excess over their level, leaving out
    the excursion holding index `judged` (`_run_of`): a fault's own steps are not where the
    log usually is (tuning log draw 581: five lines of sixty, on a log printed every 5)."""
    lv = np.log10(np.maximum(np.asarray(ev.loss.values, dtype=np.float64), 1e-30))
    with np.errstate(invalid="ignore", divide="ignore"):
        e = lv - np.log10(np.asarray(ev.loss.level, dtype=np.float64))
    keep = np.isfinite(e) & (ev.loss.z != 0)
    if judged is not None:
        a, b = _run_of(ev, cfg, judged)
        keep[a:b] = False
    e = e[keep]
    return float(np.percentile(e, USUAL_Q)) if e.size >= CURVE_SHORT else 0.0


def _grad_confirms(step: int, ev: LogEvidence, cfg: TriageConfig) -> tuple[bool, str]:
    """Whether the grad norm confirms a loss excursion at `step`: z/2 or more on its trend on
    that step or the next (a Megatron line's grad norm is its interval's last iteration's)."""
    if not ev.grad_norm.steps:
        return False, "the log has no grad norm to confirm it"
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    nxt = [s for s in ev.grad_norm.steps if s > step][:1]
    zs = [float(g[s]) for s in [step, *nxt] if s in g]
    if not zs:
        return False, "no grad norm was logged there"
    top = max(zs)
    return grad_up(ev, cfg, [step, *nxt]), (
        f"the grad norm stays at robust z {top:.1f} (under {cfg.z / 2:g})"
    )


def _peers(
    tail: dict[int, tuple[float, float]],
    step: int,
    excess: float,
    zs: float,
    share: float,
    ev: LogEvidence,
    cfg: TriageConfig,
) -> tuple[bool, int]:
    """Whether the log has enough other blips at least `share` of this one's size (its log10
    excess over the level before it: the noise, and so a blip's z, shrinks as training goes on
    while a hard batch stays as hard)."""
    from scipy import stats

    chance = expected_exceedances(int(np.count_nonzero(ev.loss.z)), max(share * zs, cfg.z / 2))
    peers = sum(1 for s, (_, eb) in tail.items() if s != step and eb >= share * excess)
    return peers >= TAIL_PEERS + float(stats.poisson.isf(0.01, chance)), peers


def _excursions(ev: LogEvidence, cfg: TriageConfig) -> tuple[set[int], list[int]]:
    """(steps where the loss is out of line, steps judged) for the recurrence test: a loss at
    z/2 or more on its trend (recovering or not: a hard batch met again during a fault still
    stands above it), a non-finite loss, or an overflow (a Megatron line counting skipped
    iterations, whose loss average leaves the overflowed iteration out: a hard batch under
    fp16 overflows as often as it blips)."""
    hard = {s for s, zz in zip(ev.loss.steps, ev.loss.z, strict=True) if not zz < cfg.z / 2}
    over = {s for s, r in ev.rows.items() if r.get("skipped", 0) > 0}
    logged = {s for s, zz in zip(ev.loss.steps, ev.loss.z, strict=True) if zz != 0} | over
    return hard | over, sorted(logged)


def _weak_meetings(ev: LogEvidence) -> set[int]:
    """Steps whose loss stands at RECUR_WEAK_Z or more on its trend and above both logged
    neighbours: a hard batch met again where the curve's noise is wider, which counts at a
    step a period predicts (`stats.recurrence_period`'s `weak`)."""
    v = np.asarray(ev.loss.values, dtype=np.float64)
    z = np.asarray(ev.loss.z, dtype=np.float64)
    if v.size < 3:
        return set()
    peak = np.zeros(v.size, dtype=bool)
    peak[1:-1] = (v[1:-1] > v[:-2]) & (v[1:-1] > v[2:])
    ok = peak & np.isfinite(z) & (z >= RECUR_WEAK_Z)
    return {ev.loss.steps[i] for i in np.flatnonzero(ok)}


def _met_as_hard(step: int, period: int, excess: float, spacing: int, ev: LogEvidence) -> bool:
    """Whether a batch recurring every `period` steps is met as hard as at `step` at least
    once more: a line within spacing - 1 of step + k period whose loss stands at least half
    `excess` (log10) over its level, is not finite, or counts an overflowed iteration. A
    hard batch stays as hard (`_peers`); a period whose other meetings are all weak (robust
    z 2-3 on a quiet log: 4-5% of its steps) is the noise lining up with one excursion
    (held-out draw 9637: a poisoned batch 1.53x at 267, met at 61 and 164, 103 apart, at a
    third and a quarter of its excess)."""
    steps, vals, level = ev.loss.steps, ev.loss.values, ev.loss.level
    at = {s: k for k, s in enumerate(steps)}
    lo, hi, tol = steps[0], steps[-1], spacing - 1
    for k in range(-((step - lo) // period), (hi - step) // period + 1):
        if k == 0:
            continue
        for t in range(step + k * period - tol, step + k * period + tol + 1):
            if ev.rows.get(t, {}).get("skipped", 0) > 0:
                return True  # an overflowed line may log no loss at all
            i = at.get(t)
            if i is None:
                continue
            if not math.isfinite(vals[i]):
                return True
            if (
                math.isfinite(level[i])
                and level[i] > 0
                and vals[i] > 0
                and math.log10(vals[i] / level[i]) >= excess / 2
            ):
                return True
    return False


def routine_reason(
    o: Onset, tail: dict[int, tuple[float, float]], ev: LogEvidence, cfg: TriageConfig
) -> str | None:
    """Why a loss or grad-norm onset of the trend rule is the log's routine (a message), or
    None when it stands. A blip that recovers: unconfirmed by the grad norm, within the log's
    tail, or recurring at the log's period; in the log's last CURVE_SHORT steps, where
    recovery cannot be seen yet, only peers two thirds its size excuse it."""
    steps = ev.loss.steps
    if o.signal == "loss_scale" and o.rule in ("loss-scale-backoff", "skipped-iterations"):
        # An overflow counts where the loss spikes on that line or the next (`_followed`):
        # where that spike is one of the log's routine blips, so is the overflow.
        i = next((k for k, s in enumerate(steps) if s >= o.step), len(steps))
        answer = next((k for k in range(i, min(i + 2, len(steps))) if ev.loss.z[k] > cfg.z), None)
        if answer is None:
            return None
        k = answer
        why = routine_reason(
            Onset(
                steps[k],
                "loss",
                ev.loss.values[k],
                float(ev.loss.level[k]),
                float(ev.loss.z[k]),
                "",
                "trend",
            ),
            tail,
            ev,
            cfg,
        )
        return (
            f"the loss answers at step {steps[k]} with a blip of its routine: {why}"
            if why
            else None
        )
    if o.signal not in ("loss", "grad_norm") or o.rule != "trend":
        return None
    at = next((k for k, s in enumerate(steps) if s >= o.step), None)
    horizon = recovery_horizon(ev, cfg, at if _grad_confirms(o.step, ev, cfg)[0] else None)
    if o.step in tail:
        zs, es = tail[o.step]
        ok, why = _grad_confirms(o.step, ev, cfg) if o.signal == "loss" else (True, "")
        enough, n = _peers(tail, o.step, es, zs, 0.5, ev, cfg)
        if not ok and n >= UNCONFIRMED_PEERS:
            return f"the loss recovers within {horizon} steps (this log's blips), {why}, and the log has {n} other blip(s) at least half its size"
        if enough:
            return f"the loss recovers within {horizon} steps (this log's blips), as {n} other blips of this log at least half its size do"
        hard, logged = _excursions(ev, cfg)
        spacing = int(np.median(np.diff(steps))) if len(steps) > 2 else 1
        p = recurrence_period(o.step, hard, logged, spacing, weak=_weak_meetings(ev))
        if p is not None and _met_as_hard(o.step, p, es, spacing, ev):
            return f"the loss recovers within {horizon} steps (this log's blips), and blips every {p} steps of this log (a batch that comes back each epoch)"
        return None
    i = next((k for k, s in enumerate(steps) if s >= o.step), len(steps))
    if i >= len(steps) or len(steps) - 1 - i >= horizon:
        return None
    base = ev.loss.level[i]
    if (
        not (math.isfinite(ev.loss.values[i]) and math.isfinite(base))
        or not float(ev.loss.z[i]) > cfg.z
    ):
        return None  # a grad-norm seed the loss followed at half z: judged by the loss's own size
    excess, zs = math.log10(ev.loss.values[i] / base), float(ev.loss.z[i])
    # The grad norm logged on every step from the excursion's to the log's end staying under
    # z/2 (a log that has one: one without cannot tell), on a log with other blips at least
    # half its size that the grad norm let pass (UNCONFIRMED_PEERS): the excursion is as old
    # as this log's blips last, and the one signal that would make it an update's is quiet, as
    # it is for the routine blips mid-log (a single rank's junk micro-batches on the last two
    # lines: fresh tuning log draw 355).
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    gz = [float(g[s]) for s in steps[i:] if s in g]
    if o.signal == "loss" and gz and max(gz) < cfg.z / 2:
        _, n = _peers(tail, o.step, excess, zs, 0.5, ev, cfg)
        if n >= UNCONFIRMED_PEERS:
            return (f"in the log's last steps (within {horizon}, this log's blip duration), the grad norm stays under robust z "
                    f"{cfg.z / 2:g} (at most {max(gz):.1f}) to the end, and the log has {n} other blip(s) at least half its size")  # fmt: skip
    enough, n = _peers(tail, o.step, excess, zs, 2 / 3, ev, cfg)
    return (
        f"in the log's last steps, where recovery cannot be seen yet, {n} other blips of this log reach two thirds its size"
        if enough
        else None
    )
