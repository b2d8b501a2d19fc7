"""The logit causes from a run's history: a layer's attention logits that grew past the cap
(`attention_logit_growth`), the head's log Z drifting away from 0 (`output_logit_divergence`);
each dated at the checkpoint where its module left its own trend (`trend`) on its climb to the
cap (`onset_of`), or, for a log Z that grew from the run's first checkpoints (no trend of its
own to leave: the growth is the trend), at the climb's first checkpoint (`early_growth`)."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import MAD_TO_SIGMA, theil_sen
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.history.evidence import HistoryEvidence, Trajectory
from ckptforensics.detectors.history.trend import Departure, departure

__all__ = ["EARLY_MIN", "EARLY_Z", "attention_growth", "early_growth", "onset_of", "output_drift"]


def _first_past(t: Trajectory, limit: float) -> int | None:
    """The first step from which |value| stays past `limit` to the last checkpoint."""
    pts = t.finite()
    for i, (s, _) in enumerate(pts):
        if all(abs(v) > limit for _, v in pts[i:]):
            return s
    return None


# The climb to the cap starts where the figure was last at most this share of it: a growth
# of 4x or more, as Adam's steps' climb (`adam.CREEP`).
CLIMB_FROM = 0.25
# A log Z seen climbing from a quarter of the cap (`early_growth`): its drift is read from the
# checkpoint where it reached this share of the cap (past the climb's steep start, which
# Theil-Sen's median of pairwise slopes outvotes), ...
CLIMB_HALF = 0.5
# ... over at least this many checkpoints, its slope past this many standard errors: with the
# 4x climb to the cap already seen, the slope only tells a drift from a level that settled.
# Measured on a settled level (Gaussian noise, 20,000 series each), this z passes 4.5 by chance
# in 1.4% of series of 10 points, 0.95% of 12, 0.4% of 16, 0.15% of 24 (its MAD-of-residuals
# noise runs low on few points: Student's t would say 0.7% at 10); tuning draws 1660, 1669,
# 1681, 1693 stand at 5.2-9.6 over 12-25 points.
EARLY_MIN = 10
EARLY_Z = 4.5


def _climb_departure(t: Trajectory, limit: float, th: Thresholds) -> Departure | None:
    """The trajectory's departure from its own trend (`trend.departure`) where it lies on the
    climb to `limit`: from the last checkpoint at or under `CLIMB_FROM` of it to the first past
    it for good; None if none does."""
    past = _first_past(t, limit)
    d = departure(t, th.attn_growth)
    if d is None or past is None:
        return None
    low = _last_low(t, limit)
    start = t.finite()[0 if low is None else low][0]
    return d if start <= d.step <= past else None


def _last_low(t: Trajectory, limit: float) -> int | None:
    """The index (in `t.finite()`) of the last checkpoint at or under `CLIMB_FROM` of `limit`
    before the first past it for good, where the climb starts; None where the range did not
    see it that low (or it never passed the limit for good)."""
    past = _first_past(t, limit)
    low = [
        i
        for i, (s, v) in enumerate(t.finite())
        if past is not None and s < past and abs(v) <= CLIMB_FROM * limit
    ]
    return low[-1] if low else None


def _climb_start(t: Trajectory, limit: float) -> int | None:
    """The climb's first checkpoint: the one after its start (`_last_low`)."""
    low = _last_low(t, limit)
    return None if low is None else t.finite()[low + 1][0]


def onset_of(t: Trajectory, limit: float, th: Thresholds) -> tuple[int | None, str]:
    """Since when a trajectory that ends past `limit` has been going wrong: the checkpoint
    where it left its own trend on its climb to the limit, else the first from which it
    stayed past the limit.

    The climb runs from the last checkpoint at or under `CLIMB_FROM` of the limit to the
    first past it for good. A departure before it is early learning (every layer's logits
    rise from ~0 over the first checkpoints); one after it is a later turn of a growth that
    had already passed the cap, not its onset."""
    past = _first_past(t, limit)
    d = _climb_departure(t, limit, th)
    if d is not None:
        return d.step, (
            f"left its trend at step {d.step} (x{d.ratio:.2g} the {d.expected:.3g} its trend predicted) "
            f"on its climb to {limit:g}"
        )
    return (
        past,
        f"passed {limit:g} for good at step {past} (no departure from its own trend on its climb there)",
    )


def attention_growth(ev: HistoryEvidence, th: Thresholds) -> list[Finding]:
    """Each attention layer whose largest pre-softmax logit is past `attn_logit` at the run's
    last checkpoint (Gemma 2's attention soft-cap) and grew to it by `attn_growth` over its
    own first judged level, dated at its onset (`onset_of`). The layer that passed the cap
    for good first leads (the layer that grew first is the one to fix: a layer that left its
    trend earlier but reached the cap later grew slower), then the earliest onset, forward
    order breaking ties."""
    out: list[tuple[int, int, int, Finding]] = []
    for order, mod in enumerate(ev.attn_modules):
        t = ev.of("attn_max_logit", mod)
        pts = t.finite() if t is not None else []
        if t is None or len(pts) < 2 or pts[-1][1] <= th.attn_logit:
            continue
        base = min(v for _, v in pts[: max(1, len(pts) // 2)])
        growth = pts[-1][1] / max(base, 1e-12)
        if growth < th.attn_growth:
            continue
        onset, how = onset_of(t, th.attn_logit, th)
        ent = ev.of("attn_entropy", mod)
        ent_d = departure(ent, th.attn_growth) if ent is not None else None
        ent_v = [v for _, v in ent.finite()] if ent is not None else []
        f = Finding(
            "",
            "attention_logit_growth",
            mod,
            cap(pts[-1][1] / th.attn_logit),
            "warning",
            {
                "onset_step": onset,
                "onset_rule": how,
                "steps": [s for s, _ in pts],
                "max_logit": [v for _, v in pts],
                "entropy": ent_v,
                "entropy_departure_step": ent_d.step if ent_d is not None else None,
                "growth": growth,
                "limit": th.attn_logit,
            },
            f"attention layer {mod}: its largest pre-softmax logit grew x{growth:.3g} to {pts[-1][1]:.3g} by step "
            f"{pts[-1][0]}, past the {th.attn_logit:g} at which Gemma 2 caps attention logits; it {how}"
            + (
                f"; its most collapsed head's entropy {ent_v[0]:.2f} -> {ent_v[-1]:.2f} of uniform"
                if ent_v
                else ""
            ),
            "docs/signatures.md#history-departure (Dehghani 2302.05442; Wortsman 2309.14322; Zhai 2303.06296)",
            ("attention_logit_growth",),
            primary=True,
        )
        past = _first_past(t, th.attn_logit)
        last = pts[-1][0]
        out.append(
            (past if past is not None else last, onset if onset is not None else last, order, f)
        )
    return [f for *_, f in sorted(out, key=lambda x: (x[0], x[1], x[2]))]


def _slope_z(recs: list[tuple[int, float]]) -> tuple[float, float]:
    """(z, slope): the Theil-Sen slope of `recs` in standard errors, the residuals' robust
    spread / (std(steps) * sqrt(n)) (at least 0.1% of their level), and the slope itself."""
    steps = np.array([s for s, _ in recs], dtype=np.float64)
    ys = np.array([v for _, v in recs])
    slope, icpt = theil_sen(steps, ys)
    resid = ys - (icpt + slope * steps)
    level = float(np.median(ys))
    noise = max(float(np.median(np.abs(resid - np.median(resid)))) * MAD_TO_SIGMA, 1e-3 * level)
    return slope * float(np.std(steps)) * math.sqrt(len(recs)) / noise, slope


def early_growth(
    t: Trajectory, limit: float, th: Thresholds
) -> tuple[float, list[tuple[int, float]], int, str] | None:
    """A |value| seen climbing from at most `CLIMB_FROM` of `limit` to past it for good that
    still rises there: (z, the drift's checkpoints, onset step, how), else None.

    The climb starts at the last checkpoint at or under `CLIMB_FROM` of the limit before the
    first past it for good (as in `onset_of`); the drift is the Theil-Sen slope of |value| over
    the checkpoints from the first at or past `CLIMB_HALF` of the limit after that start to the
    last, at least `EARLY_MIN` of them, past `EARLY_Z` standard errors. The onset is the
    departure on the climb where the trend rule saw one, else the climb's first checkpoint
    (the first after its start; Adam's climb is dated the same way, `adam`): a growth that
    starts with the run is its own trend, and the checkpoint where it passed the limit for
    good can come long after the growth began (issue #45's held-out draws)."""
    pts = [(s, abs(v)) for s, v in t.finite()]
    start = _last_low(t, limit)
    if start is None:
        return None
    half = next(i for i in range(start + 1, len(pts)) if pts[i][1] >= CLIMB_HALF * limit)
    recs = pts[half:]
    if len(recs) < EARLY_MIN:
        return None
    z, _ = _slope_z(recs)
    if z <= EARLY_Z:
        return None
    d = _climb_departure(t, limit, th)
    grew = f"climbed x{pts[-1][1] / max(pts[start][1], 1e-12):.3g} from {pts[start][1]:.3g} at step {pts[start][0]}"
    if d is not None:
        return (
            z,
            recs,
            d.step,
            (
                f"{grew} and left its trend at step {d.step} (x{d.ratio:.2g} the {d.expected:.3g} its trend "
                f"predicted) on its climb to {limit:g}"
            ),
        )
    first = pts[start + 1][0]
    return (
        z,
        recs,
        first,
        f"{grew}, a climb that began at step {first} (no trend of its own to leave)",
    )


def output_drift(ev: HistoryEvidence, th: Thresholds) -> list[Finding]:
    """The head's log Z past `logit_max` at the last checkpoint and drifting further from 0:
    over the checkpoints since it passed it for good, their Theil-Sen slope > `z` standard
    errors (the replay's rule, `detectors.replay.state.output_logits`, over checkpoints instead
    of steps), dated at its onset (`onset_of`); else, where the range saw it climb from a
    quarter of the cap (a growth from the run's first checkpoints, which that window cuts
    short), still rising since it reached half the cap (`early_growth`), dated where the climb
    began. A z-loss holds log Z near 0 (PaLM); a run that sits past 30 without moving is not
    this cause."""
    t = ev.of("log_z", ev.head or "")
    pts = t.finite() if t is not None else []
    if t is None or not pts or abs(pts[-1][1]) <= th.logit_max:
        return []
    past = _first_past(t, th.logit_max)
    recs = [(s, abs(v)) for s, v in pts if past is not None and s >= past]
    z = _slope_z(recs)[0] if len(recs) >= 3 else -math.inf
    if z > th.z:
        onset, how = onset_of(t, th.logit_max, th)
        start = _climb_start(t, th.logit_max)
        if _climb_departure(t, th.logit_max, th) is None and start is not None:
            # No departure on the climb: the growth is its own trend from the climb's start,
            # and where it passed the cap for good can come long after (issue #45's held-out
            # draw 9919, dated at 100 for a climb that began by 60).
            onset, how = start, f"began its climb at step {start} (no trend of its own to leave)"
        rule, bar = "since_cap", th.z
        since = f"since it passed the {th.logit_max:g} at which Gemma 2 caps its logits"
    else:
        early = early_growth(t, th.logit_max, th)
        if early is None:
            return []
        z, recs, onset, how = early
        rule, bar = "early_growth", EARLY_Z
        since = (
            f"since it reached {CLIMB_HALF * th.logit_max:g} on a climb past the {th.logit_max:g} at which "
            "Gemma 2 caps its logits"
        )
    slope = _slope_z(recs)[1]
    mx = ev.of("max_logit", ev.head or "")
    top = max((v for _, v in mx.finite()), default=math.nan) if mx is not None else math.nan
    return [
        Finding(
            "",
            "output_logit_drift",
            ev.head or "the output logits",
            cap(z / bar),
            "warning",
            {
                "onset_step": onset,
                "onset_rule": how,
                "drift_rule": rule,
                "drift_from": recs[0][0],
                "steps": [s for s, _ in pts],
                "log_z": [v for _, v in pts],
                "slope_z": z,
                "slope_z_limit": bar,
                "drift": slope * float(recs[-1][0] - recs[0][0]),
                "max_abs_logit": top,
                "limit": th.logit_max,
            },
            f"{ev.head}'s log Z drifts from {pts[0][1]:.3g} to {pts[-1][1]:.3g} over steps {pts[0][0]}-{pts[-1][0]} "
            f"({z:.1f} standard errors {since}); it {how}; max |logit| {top:.3g}",
            "docs/signatures.md#history-output (PaLM z-loss; Gemma 2 soft-cap; Wortsman 2309.14322)",
            ("output_logit_divergence",),
            primary=True,
        )
    ]
