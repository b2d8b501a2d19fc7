"""The state stage, over the whole window: the head's logits drifting, a stale second moment
(RMS_t), whether the replay reproduces *after* (the run's own log: `agreement`)."""

from __future__ import annotations

import math

import numpy as np

from ckptforensics.core.stats import MAD_TO_SIGMA, theil_sen
from ckptforensics.core.tensors import (
    robust_z,
)
from ckptforensics.detectors.base import Finding, Thresholds, cap, module_of
from ckptforensics.detectors.replay.evidence import ReplayEvidence
from ckptforensics.engine.diff.pair import tensor_role
from ckptforensics.engine.replay.records import AFTER_SHARE, after_share
from ckptforensics.trainers.fused import computes

__all__ = ["output_logits", "reproduction", "rms_t"]


def output_logits(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The head's logits drifting away from the log-probabilities: |log Z| (the softmax
    normaliser, mean over the batch's tokens) past `logit_max` across the window and moving
    further from 0, its Theil-Sen slope over the window's steps > `z` standard errors
    (the residuals' robust spread / (std(steps) sqrt(n))). A z-loss run holds log Z near 0
    (PaLM), a healthy run without one sits where it sits: only the drift is this cause."""
    rep = ev.rep
    recs = [r for r in rep.records if math.isfinite(r.log_z)]
    if len(recs) < 5:
        return []
    steps = np.array([r.step for r in recs], dtype=np.float64)
    lz = np.abs(np.array([r.log_z for r in recs]))
    level = float(np.median(lz))
    slope, intercept = theil_sen(steps, lz)
    resid = lz - (intercept + slope * steps)
    noise = max(
        float(np.median(np.abs(resid - np.median(resid)))) * MAD_TO_SIGMA, 1e-3 * level, 1e-6
    )
    z = slope * float(np.std(steps)) * math.sqrt(len(recs)) / noise
    if level <= th.logit_max or z <= th.z:
        return []
    first, last = recs[0], recs[-1]
    p0 = rep.passes.get(first.step)
    head = (p0.head if p0 is not None else None) or "the output logits"
    means = [rep.passes[r.step].logit_mean for r in recs if r.step in rep.passes]
    drift = slope * float(steps[-1] - steps[0])
    return [
        Finding(
            "",
            "output_logit_drift",
            head,
            cap(z / th.z),
            "warning",
            {
                "log_z": [r.log_z for r in recs],
                "steps": [r.step for r in recs],
                "level": level,
                "drift": drift,
                "slope_z": z,
                "max_abs_logit": max(r.logit_absmax for r in recs),
                "mean_logit": [float(m) for m in means],
                "limit": th.logit_max,
            },
            f"{head}'s log Z drifts from {first.log_z:.3g} to {last.log_z:.3g} over steps {first.step}-{last.step} "
            f"({drift:+.3g} nats on its trend, {z:.1f} standard errors), past the {th.logit_max:g} at which Gemma 2 caps "
            f"its logits; max |logit| {max(r.logit_absmax for r in recs):.3g}: nothing holds the head's logits to the log-probabilities",
            "docs/signatures.md#output-logits (PaLM z-loss; Gemma 2 soft-cap; Wortsman 2309.14322)",
            ("output_logit_divergence",),
            primary=True,
        )
    ]


def rms_t(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """A parameter whose gradient outgrew Adam's second moment: RMS_t = sqrt(mean(g^2/v_hat))
    is ~1 in steady state; > 1 and a robust outlier (log scale) among the step's
    parameters means its updates turn sign-like and lr-sized (StableAdamW). Embeddings
    are left out: their gradients are row-sparse, so rows idle for a while always have a
    stale v (SPAM's observation), which is normal for them. Past 100 it is the step's
    onset (a second moment two orders of magnitude stale). Below that, RMS_t > 1 is what
    StableAdamW clips routinely: evidence where the window went bad, context (info) on a
    window with no onset (tuning draws 1246, 1260: 6-8x on a LayerNorm weight in healthy runs)."""
    for r in ev.rep.records:
        names = [
            n
            for n in r.param_rms_t
            if tensor_role(n, (2, 2)) != "embedding" and r.param_rms_t[n] > 0
        ]
        if len(names) < 4:
            continue
        vals = np.array([r.param_rms_t[n] for n in names])
        z = robust_z(np.log10(vals), floor=0.1)
        hits = [i for i in np.argsort(-vals) if vals[i] > 1.0 and z[i] > th.z]
        if not hits:
            continue
        i = int(hits[0])
        name, v = names[i], float(vals[i])
        spikes = r.param_spikes.get(name, 0)
        evidence = ev.bad or v > 100
        fused = computes(module_of(name), r.param_grad_rms)  # what a fused module computes
        return [
            Finding(
                "",
                "rms_t",
                name,
                cap(float(z[i]) / th.z),
                "warning" if evidence else "info",
                {
                    "step": r.step,
                    "rms_t": v,
                    "robust_z": float(z[i]),
                    "spam_spikes": spikes,
                    "flagged": [names[int(j)] for j in hits[:8]],
                },
                f"step {r.step}: {name}{f' ({fused})' if fused else ''}'s gradient is {v:.3g}x what Adam's second moment expects (RMS_t; robust z {float(z[i]):.1f} "
                f"among the step's parameters){f', {spikes} elements with g^2 > 5000 v' if spikes else ''}: its updates go sign-like",
                "docs/signatures.md#rms-t (StableAdamW 2304.13013), per-element spike (SPAM 2501.06842)",
                ("adam_instability", "gradient_explosion") if evidence else (),
                primary=v > 100,
            )
        ]
    return []


def reproduction(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Replayed state vs *after*: impossible elements confined -> corruption; match -> reproduces."""
    rep = ev.rep
    if rep.matches is None:
        return []
    share = after_share(rep) or 0.0
    imp = [m for m in rep.matches if m.impossible]
    confined = 0 < len(imp) <= th.confined_tensors and all(
        m.impossible <= max(8, th.confined_share * m.numel) for m in imp
    )
    if confined:
        return [
            Finding(
                "",
                "replay_mismatch_confined",
                imp[0].name,
                10.0,
                "critical",
                {
                    "tensors": [m.name for m in imp],
                    "elements": sum(m.impossible for m in imp),
                    "where": [m.where for m in imp],
                },
                f"the replay reproduces every tensor except {sum(m.impossible for m in imp)} element(s) of "
                f"{', '.join(sorted({m.name for m in imp}))}, which no replay of these steps can reach: a hardware fault",
                "docs/signatures.md#reproducibility",
                ("silent_corruption",),
                primary=True,
            )
        ]
    if not imp and share <= AFTER_SHARE:
        return [
            Finding(
                "",
                "replay_reproduces",
                "run",
                1.0,
                "info",
                {"mismatched_share": share},
                f"the replay reproduces the after checkpoint ({1 - share:.2%} of elements within tolerance): numerics or data, not hardware",
                "docs/signatures.md#reproducibility",
                (),
            )
        ]
    worst = max(rep.matches, key=lambda m: m.mismatched / max(m.numel, 1))
    miss = rep.check.first_miss
    why = (
        f"the run left the replay at step {miss.step}, where it stops matching the run's own log"
        if miss is not None and miss.step != rep.check.first_checked
        else "the replay configuration (LR, clipping, precision, loss averaging) differs from the trainer's; see replay.config"
    )
    return [
        Finding(
            "",
            "replay_config_mismatch",
            worst.name,
            1.0,
            "info",
            {"mismatched_share": share, "impossible_tensors": len(imp), "worst": worst.name},
            f"the replay deviates from after on {share:.1%} of elements (worst: {worst.name} {worst.where}): {why}",
            "docs/signatures.md#reproducibility",
            (),
        )
    ]
