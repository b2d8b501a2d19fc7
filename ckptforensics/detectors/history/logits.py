"""The logit causes from a run's history: a layer's attention logits that grew past the cap
(`attention_logit_growth`), the head's log Z drifting away from 0 (`output_logit_divergence`);
each dated at the checkpoint where its module left its own trend (`trend`) on its climb to the
cap (`onset_of`)."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import MAD_TO_SIGMA, theil_sen
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.history.evidence import HistoryEvidence, Trajectory
from ckptforensics.detectors.history.trend import departure

__all__ = ["attention_growth", "output_drift", "onset_of"]


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


def onset_of(t: Trajectory, limit: float, th: Thresholds) -> tuple[int | None, str]:
    """Since when a trajectory that ends past `limit` has been going wrong: the checkpoint
    where it left its own trend on its climb to the limit, else the first from which it
    stayed past the limit.

    The climb runs from the last checkpoint at or under `CLIMB_FROM` of the limit to the
    first past it for good. A departure before it is early learning (every layer's logits
    rise from ~0 over the first checkpoints); one after it is a later turn of a growth that
    had already passed the cap, not its onset."""
    past = _first_past(t, limit)
    d = departure(t, th.attn_growth)
    if d is not None and past is not None:
        low = [s for s, v in t.finite() if s < past and abs(v) <= CLIMB_FROM * limit]
        start = low[-1] if low else t.finite()[0][0]
        if start <= d.step <= past:
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


def output_drift(ev: HistoryEvidence, th: Thresholds) -> list[Finding]:
    """The head's log Z past `logit_max` at the last checkpoint and drifting further from 0
    over the checkpoints since it passed it: their Theil-Sen slope > `z` standard errors
    (the replay's rule, `detectors.replay.state.output_logits`, over checkpoints instead of
    steps). A z-loss holds log Z near 0 (PaLM); a run that sits past 30 without moving is not
    this cause."""
    t = ev.of("log_z", ev.head or "")
    pts = t.finite() if t is not None else []
    if t is None or not pts or abs(pts[-1][1]) <= th.logit_max:
        return []
    past = _first_past(t, th.logit_max)
    recs = [(s, abs(v)) for s, v in pts if past is not None and s >= past]
    if len(recs) < 3:
        return []
    steps = np.array([s for s, _ in recs], dtype=np.float64)
    lz = np.array([v for _, v in recs])
    slope, icpt = theil_sen(steps, lz)
    resid = lz - (icpt + slope * steps)
    level = float(np.median(lz))
    noise = max(float(np.median(np.abs(resid - np.median(resid)))) * MAD_TO_SIGMA, 1e-3 * level)
    z = slope * float(np.std(steps)) * math.sqrt(len(recs)) / noise
    if z <= th.z:
        return []
    onset, how = onset_of(t, th.logit_max, th)
    mx = ev.of("max_logit", ev.head or "")
    top = max((v for _, v in mx.finite()), default=math.nan) if mx is not None else math.nan
    return [
        Finding(
            "",
            "output_logit_drift",
            ev.head or "the output logits",
            cap(z / th.z),
            "warning",
            {
                "onset_step": onset,
                "onset_rule": how,
                "steps": [s for s, _ in pts],
                "log_z": [v for _, v in pts],
                "slope_z": z,
                "drift": slope * float(steps[-1] - steps[0]),
                "max_abs_logit": top,
                "limit": th.logit_max,
            },
            f"{ev.head}'s log Z drifts from {pts[0][1]:.3g} to {pts[-1][1]:.3g} over steps {pts[0][0]}-{pts[-1][0]} "
            f"({z:.1f} standard errors since it passed the {th.logit_max:g} at which Gemma 2 caps its logits); "
            f"it {how}; max |logit| {top:.3g}",
            "docs/signatures.md#history-departure (PaLM z-loss; Gemma 2 soft-cap; Wortsman 2309.14322)",
            ("output_logit_divergence",),
            primary=True,
        )
    ]
