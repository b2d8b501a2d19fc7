"""Detectors over a replay of the window (replay.ReplayResult): the spiking step, the module
that leaves its range first, overflow, the rows that carry the spike, reproduction."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..diff import tensor_role
from ..stats import MAD_TO_SIGMA, theil_sen
from ..tensors import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    log_curve,
    loss_follows,
    lr_growth_limit,
    robust_z,
    trend_z,
)
from .base import Finding, Thresholds, cap, module_of

__all__ = [
    "ReplayEvidence",
    "ReplayDetector",
    "ONSET_DETECTORS",
    "EXAMINE_DETECTORS",
    "STATE_DETECTORS",
    "ONSET_KINDS",
    "WITHHELD",
    "replay_findings",
    "first_steps_from_state",
    "step_z",
    "log_onset",
]


def step_z(
    values: Sequence[float], baseline: Sequence[float] = (), above_level: bool = False
) -> np.ndarray:
    """Robust z of per-step values (log scale) against the run's own trend: the logged
    history before the window leads into the window (`tensors.trend_z`, as triage judges
    the log; `above_level` as there); lacking that much history, against every step there
    is, the short history and the window together (5 window steps alone make a MAD of
    noise: a healthy run's 1.4x grad-norm wiggle read z 6.9 against its 4 neighbours and
    1.8 against the 20 steps of the run, fixtures/hf_ddp_run.py 15 -> 20). Non-finite = +inf."""
    if len(baseline) >= CURVE_MIN_HISTORY:
        return trend_z([*baseline, *values], judge_from=len(baseline), above_level=above_level)[0][
            len(baseline) :
        ]
    x = log_curve(values)
    pool = log_curve([*baseline, *values])
    ref = pool[np.isfinite(pool)]
    return np.where(
        np.isfinite(x), robust_z(x, floor=CURVE_FLOOR, reference=ref if ref.size else None), np.inf
    )


@dataclass(frozen=True, slots=True)
class ReplayEvidence:
    """What a replay detector reads: the replay, and the step the onset detectors settled.

    Attributes:
        rep: the replay (replay.ReplayResult).
        step: the step to examine: the first bad step where one is known, else the step
            with the largest grad norm (None before the onset detectors ran).
        bad: whether `step` went bad (a module "leaving its range" means something only
            on a step that did: on a healthy window the largest step always has a largest
            module).
    """

    rep: Any
    step: int | None = None
    bad: bool = False


ReplayDetector = Callable[[ReplayEvidence, Thresholds], list[Finding]]


def replay_findings(rep: Any, th: Thresholds | None = None) -> list[Finding]:
    """Findings from a replay (replay.ReplayResult), without ids.

    Three stages, each a list of pure detectors behind one protocol: the onset detectors
    find the step that went bad; the examination detectors read that step; the state
    detectors read the whole window. `verdict.replay_fields` reads the verdict's fields
    (first bad step, first module, rows, reproduction) off the findings.
    """
    th = th or Thresholds()
    ev = ReplayEvidence(rep)
    out = [f for d in ONSET_DETECTORS for f in d(ev, th)]
    ev = _examined(rep, out)
    out += [f for d in EXAMINE_DETECTORS for f in d(ev, th)]
    out += [f for d in STATE_DETECTORS for f in d(ev, th)]
    return out


def _examined(rep: Any, onset: list[Finding]) -> ReplayEvidence:
    """The step the examination detectors read: the earliest onset, else the largest grad norm."""
    steps = [f.metrics["step"] for f in onset if f.kind in ONSET_KINDS]
    if steps:
        return ReplayEvidence(rep, min(steps), True)
    if not rep.records:
        return ReplayEvidence(rep)
    zg = _grad_z(rep)
    return ReplayEvidence(
        rep, rep.records[int(np.argmax(np.where(np.isfinite(zg), zg, 1e9)))].step, False
    )


def _grad_z(rep: Any) -> np.ndarray:
    return step_z(
        [r.grad_norm for r in rep.records],
        [b["grad_norm"] for b in rep.baseline.values() if "grad_norm" in b],
    )


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
    return bool(zg[i] > th.z and loss_follows(zl, i, th.z, z_grad=zg, z_level=above))


def _onset(
    recs: Sequence[Any], base: Sequence[dict[str, float]], th: Thresholds, grads: bool = True
) -> tuple[int | None, np.ndarray, np.ndarray]:
    """Index of the first step of `recs` (anything with .loss, .grad_norm, .skipped,
    .loss_scale) that goes bad against the history `base` (logged rows), and the loss and
    grad-norm z of every step (`grads` False: a log without grad norms, judged on the loss)."""
    values = [r.grad_norm for r in recs]
    zg = (
        step_z(values, [b["grad_norm"] for b in base if "grad_norm" in b])
        if grads
        else np.zeros(len(recs))
    )
    losses, history = [r.loss for r in recs], [b["loss"] for b in base if "loss" in b]
    zl = step_z(losses, history)
    above = step_z(losses, history, above_level=True)
    bad = [i for i, r in enumerate(recs) if _went_bad(r, i, zl, zg, th, above)]
    if not bad or (len(recs) <= 1 and len(base) < 5):
        return None, zl, zg
    return bad[0], zl, zg


def _spike(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The first replayed step whose loss, or grad norm with the loss following, leaves the run's trend."""
    rep = ev.rep
    recs = rep.records
    i, zl, zg = _onset(recs, list(rep.baseline.values()), th)
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


def _rms_t(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
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
                f"step {r.step}: {name}'s gradient is {v:.3g}x what Adam's second moment expects (RMS_t; robust z {float(z[i]):.1f} "
                f"among the step's parameters){f', {spikes} elements with g^2 > 5000 v' if spikes else ''}: its updates go sign-like",
                "docs/signatures.md#rms-t (StableAdamW 2304.13013), per-element spike (SPAM 2501.06842)",
                ("adam_instability", "gradient_explosion") if evidence else (),
                primary=v > 100,
            )
        ]
    return []


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


def _output_logits(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
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


def _attention(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The first attention layer whose largest pre-softmax logit passes `attn_logit` by the
    examined step (earliest step, then forward order), with its growth over the window and
    its heads' entropy. Evidence of this cause where the window went bad and that layer's
    logits grew into the bad step, or its most collapsed head's entropy fell (Dehghani et
    al. 2023; Zhai et al. 2023); a warning without a spike where both happen inside the
    window; context (info) otherwise."""
    rep = ev.rep
    steps = [
        s
        for s in sorted(rep.passes)
        if rep.passes[s].attn is not None and rep.passes[s].attn_modules
    ]
    if not steps:
        return []
    end = ev.step if ev.step is not None and ev.bad else steps[-1]
    upto = [s for s in steps if s <= end] or steps[:1]
    mods = rep.passes[upto[0]].attn_modules
    if any(len(rep.passes[s].attn_modules) != len(mods) for s in upto):
        return []
    # [steps, layers]: the layer's largest logit over its heads, its most collapsed head's
    # entropy. Non-finite logits (an overflow upstream fed the attention NaN or inf) are the
    # overflow detector's, never a logit that grew: they count as absent here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a layer whose heads are all NaN
        logit = np.stack(
            [
                np.nanmax(
                    np.where(np.isfinite(a := rep.passes[s].attn[..., 0].numpy()), a, np.nan),
                    axis=1,
                )
                for s in upto
            ]
        )
        ent = np.stack([np.nanmin(rep.passes[s].attn[..., 1].numpy(), axis=1) for s in upto])
    over = np.isfinite(logit) & (logit > th.attn_logit)
    crossed = [(int(np.argmax(over[:, j])), j) for j in range(logit.shape[1]) if over[:, j].any()]
    if not crossed:
        return []
    k, j = min(crossed)
    name = mods[j]
    first_logit = logit[0, j] if np.isfinite(logit[0, j]) else logit[k, j]
    growth = float(np.nanmax(logit[:, j]) / max(first_logit, 1e-12))
    fell = (
        float(ent[0, j] / max(ent[-1, j], 1e-12))
        if np.isfinite(ent[0, j]) and np.isfinite(ent[-1, j])
        else 1.0
    )
    grew = growth >= th.attn_growth or fell >= th.attn_growth
    evidence = ev.bad and grew
    # Without a spike the mechanism can still be under way: the layer's logits, already past
    # the cap, grow by the factor and its heads' entropy falls by it inside the window (the
    # slow divergence small models show, Wortsman et al. 2023, sec. 3.1.1): a warning that
    # names the cause, never the onset.
    developing = not ev.bad and growth >= th.attn_growth and fell >= th.attn_growth
    heads = rep.passes[end if end in rep.passes else upto[-1]].attn[j].numpy()
    collapsed = [int(h) for h in np.nonzero(heads[:, 1] < ent[0, j] / th.attn_growth)[0]]
    return [
        Finding(
            "",
            "attention_logit_growth",
            name,
            cap(float(np.nanmax(logit[:, j])) / th.attn_logit),
            "warning" if evidence or developing else "info",
            {
                "step": upto[k],
                "examined_step": end,
                "max_logit": [float(x) for x in logit[:, j]],
                "entropy": [float(x) for x in ent[:, j]],
                "steps": upto,
                "growth": growth,
                "entropy_fall": fell,
                "collapsed_heads": collapsed,
                "limit": th.attn_logit,
                "layers_past": [mods[i] for _, i in sorted(crossed)],
            },
            f"attention layer {name}: its largest pre-softmax logit is {logit[k, j]:.3g} at step {upto[k]}, past the {th.attn_logit:g} at which "
            f"Gemma 2 caps attention logits; it reaches {float(np.nanmax(logit[:, j])):.3g} by step {end} (x{growth:.2g} the window's "
            f"first step) and its most collapsed head's entropy goes {ent[0, j]:.2f} -> {ent[-1, j]:.2f} of uniform",
            "docs/signatures.md#attention-logits (Dehghani 2302.05442; Wortsman 2309.14322; Zhai 2303.06296)",
            ("attention_logit_growth",) if evidence or developing else (),
            primary=evidence,
        )
    ]


def _lr_steps(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """A step whose LR (as replayed) jumps past what any warmup allows: the first bad step."""
    from ..logs import group_lrs

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


def _localise(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """First module, in forward and in backward order, far outside its own range on other
    steps; the backward finding ranks the modules past the threshold (the replay's layers)."""
    from ..replay.probes import BWD_STATS, FWD_STATS

    rep, s = ev.rep, ev.step
    if not ev.bad or s not in rep.passes:
        return []
    p = rep.passes[s]
    others = [rep.passes[t] for t in rep.passes if t != s]
    if not others:
        return []
    ia, ig = FWD_STATS.index("absmax"), BWD_STATS.index("grad_norm")

    def z_of(table: str, col: int) -> np.ndarray:
        cur = getattr(p, table)[:, col].double().numpy()
        ref = np.stack([getattr(o, table)[:, col].double().numpy() for o in others])
        with np.errstate(divide="ignore", invalid="ignore"):
            lc, lr = np.log10(np.maximum(cur, 1e-30)), np.log10(np.maximum(ref, 1e-30))
            # per module across the other steps; floor 0.05 in log10 (12%): a module's own
            # step-to-step spread on a quiet window
            return robust_z(lc, floor=0.05, reference=lr, axis=0)

    zf, zb = z_of("fwd", ia), z_of("bwd", ig)
    # A first anomaly whose own parameters' gradients dwarf Adam's second moment (RMS_t past
    # STALE_RMS_T: a moment two orders of magnitude stale, a frozen-then-released or gated
    # module) went bad through Adam, not through a gradient the others share.
    rec = next((r for r in rep.records if r.step == s), None)
    stale = {
        module_of(n)
        for n, v in (rec.param_rms_t if rec is not None else {}).items()
        if v > STALE_RMS_T
    }
    nf_f = p.fwd[:, FWD_STATS.index("nonfinite")].numpy()
    nf_b = p.bwd[:, BWD_STATS.index("grad_nonfinite")].numpy()
    out = []
    fwd_first = next((i for i in p.fwd_order if nf_f[i] > 0 or zf[i] > th.z), None)
    bwd_first = next((i for i in p.bwd_order if nf_b[i] > 0 or zb[i] > th.z), None)
    if fwd_first is not None:
        out.append(
            _first_anomaly(
                "forward",
                s,
                p.modules[fwd_first],
                float(zf[fwd_first]),
                float(nf_f[fwd_first]),
                th,
                ("absmax", float(p.fwd[fwd_first, ia]), "output", "max |x|"),
                stale=stale,
            )
        )
    ranked = sorted(
        (i for i in range(len(p.modules)) if math.isfinite(zb[i]) and zb[i] > th.z),
        key=lambda i: -zb[i],
    )
    if bwd_first is not None:
        out.append(
            _first_anomaly(
                "backward",
                s,
                p.modules[bwd_first],
                float(zb[bwd_first]),
                float(nf_b[bwd_first]),
                th,
                ("grad_norm", float(p.bwd[bwd_first, ig]), "output gradient", "norm"),
                ranked=[p.modules[i] for i in ranked[:8]],
                stale=stale,
            )
        )
    return out


# RMS_t past which a parameter's second moment is two orders of magnitude stale (the `rms_t`
# detector's primary level): Adam's updates of it go lr-sized and sign-like at once.
STALE_RMS_T = 100.0


def _first_anomaly(
    order: str,
    s: int,
    name: str,
    z: float,
    nonfinite: float,
    th: Thresholds,
    stat: tuple[str, float, str, str],
    ranked: list[str] | None = None,
    stale: set[str] = frozenset(),  # type: ignore[assignment]
) -> Finding:
    """The first module, in forward or backward order, whose statistic leaves its range; where
    it holds a parameter with a stale second moment, evidence of Adam's instability first."""
    key, value, what, label = stat
    extra = " on the window's other steps" if order == "forward" else ""
    adam = any(m == name or m.startswith(name + ".") or name.startswith(m + ".") for m in stale)
    return Finding(
        "",
        f"first_{order}_anomaly",
        name,
        cap(z / th.z) if math.isfinite(z) else 10.0,
        "warning",
        {
            "step": s,
            "robust_z": z,
            "nonfinite": nonfinite,
            key: value,
            **({"ranked": ranked} if ranked is not None else {}),
        },
        f"step {s}: {name} is the first module in {order} order whose {what} leaves its range{extra} ({label} {value:.3g}, robust z {z:.1f})"
        + (
            f"; its gradient is over {STALE_RMS_T:g}x what Adam's second moment expects (RMS_t)"
            if adam
            else ""
        ),
        "docs/signatures.md#first-anomaly (OLMo-core 6 sigma)" + (", #rms-t" if adam else ""),
        ("adam_instability", "gradient_explosion") if adam else ("gradient_explosion",),
    )


def _overflow(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The first step with non-finite values in the run's precision that the fp32 replay does not have."""
    from ..replay.probes import BWD_STATS, FWD_STATS

    rep = ev.rep
    if rep.precision == "fp32" or ev.step is None:
        return []
    out = []
    for r in rep.records:
        p, ref = rep.passes[r.step], rep.fp32_passes.get(r.step)
        # Non-finite outputs only: under autocast, fp32 tensors (the residual stream,
        # norms) may legitimately exceed the low-precision range; a low-precision
        # tensor that overflows holds inf.
        nf_f = p.fwd[:, FWD_STATS.index("nonfinite")].numpy()
        nf_b = p.bwd[:, BWD_STATS.index("grad_nonfinite")].numpy()
        mods_param = {n.rsplit(".", 1)[0] for n in r.param_grad_nonfinite}
        pos = {i: k for k, i in enumerate(p.bwd_order)}
        cands = [i for i in range(len(p.modules)) if nf_b[i] > 0 or p.modules[i] in mods_param]
        fwd_over = [i for i in p.fwd_order if nf_f[i] > 0]
        if not cands and not fwd_over:
            continue
        fp32_ok = (
            ref is not None
            and not bool((ref.fwd[:, FWD_STATS.index("nonfinite")] > 0).any())
            and not bool((ref.bwd[:, BWD_STATS.index("grad_nonfinite")] > 0).any())
        )
        if fwd_over:
            first, where = p.modules[fwd_over[0]], "output"
        else:
            first, where = p.modules[min(cands, key=lambda i: pos.get(i, len(pos)))], "gradient"
        limit = 65504.0 if rep.precision == "fp16" else 3.39e38
        # What the value would have been: the fp32 replay of the same step, same module.
        true_max = math.nan
        if ref is not None and first in ref.modules:
            j = ref.modules.index(first)
            true_max = float(
                ref.fwd[j, FWD_STATS.index("absmax")]
                if where == "output"
                else ref.bwd[j, BWD_STATS.index("grad_absmax")] * (r.loss_scale or 1.0)
            )
        # Dynamic loss scaling grows the scale until a scaled gradient overflows, then halves
        # it: an overflow that one or two halvings (x4) undo is its normal operation.
        if (
            where == "gradient"
            and (r.loss_scale or 0) > 1
            and fp32_ok
            and math.isfinite(true_max)
            and true_max < th.routine_overflow * limit
        ):
            out.append(
                Finding(
                    "",
                    "routine_scale_overflow",
                    first,
                    1.0,
                    "info",
                    {
                        "step": r.step,
                        "loss_scale": r.loss_scale,
                        "scaled_max_abs": true_max,
                        "limit": limit,
                    },
                    f"step {r.step}: the scaled gradient of {first} reaches {true_max:.4g} under loss scale {r.loss_scale:g} "
                    f"({true_max / limit:.2f}x fp16's limit): the scaler's routine backoff, not an incident",
                    "docs/signatures.md#skipped-steps; torch.amp.GradScaler growth/backoff",
                    (),
                )
            )
            continue
        tensor = {
            "name": first,
            "dtype": rep.precision,
            "max_abs": true_max if math.isfinite(true_max) else math.inf,
            "limit": limit,
            "where": f"{where} at step {r.step}",
        }
        reach = (
            f" (in fp32 it reaches {true_max:.4g}, {true_max / limit:.2f}x the limit)"
            if math.isfinite(true_max) and true_max > 0
            else ""
        )
        cause = ("fp16_overflow",) if rep.precision == "fp16" else ("bf16_overflow",)
        out.append(
            Finding(
                "",
                "replay_overflow",
                first,
                10.0,
                "critical",
                {
                    "step": r.step,
                    "where": where,
                    "precision": rep.precision,
                    "fp32_finite": fp32_ok,
                    "loss_scale": r.loss_scale,
                    "skipped": r.skipped,
                    "fp32_max_abs": true_max,
                    "tensor": tensor,
                },
                f"step {r.step}: the {where} of {first} overflows {rep.precision}{reach}"
                + (
                    f" under loss scale {r.loss_scale:g}"
                    if r.loss_scale and where == "gradient"
                    else ""
                )
                + (
                    "; the fp32 replay of the same step stays finite"
                    if fp32_ok
                    else "; fp32 overflows too"
                ),
                "docs/signatures.md#dtype-range",
                cause if fp32_ok else ("gradient_explosion", *cause),
                primary=True,
            )
        )
        break
    return out


# A row whose loss and gradient share are ordinary is flagged on its data alone only when its
# longest run or repeat is half again the longest of every row of the window's other steps
# (tuning draws: natural rows come within 1-20% of the window's longest; junk rows 3x).
DATA_MARGIN = 1.5


def _samples(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Rows of the spiking batch that carry it: gradient share, loss, data statistics."""
    rep, s = ev.rep, ev.step
    if not ev.bad:
        return []
    r = next(x for x in rep.records if x.step == s)
    stats = rep.row_stats.get(s, [])
    b = len(r.sample_loss)
    if b < 2:
        return []
    loss = np.array(r.sample_loss)
    fin = np.isfinite(loss)
    # Rows are judged against the window's other steps' rows first (a batch that is mostly
    # junk has junk for its median), then against their own batch. The nearest steps are
    # the reference, whole steps until they hold 3 batches of rows: a loss still falling
    # across the window would otherwise widen the reference's spread by its own descent.
    others = sorted(
        (x for x in rep.records if x.step != s), key=lambda x: (abs(x.step - s), x.step)
    )
    ref: list[float] = []
    for x in others:
        if len(ref) >= 3 * b:
            break
        ref += [v for v in x.sample_loss if math.isfinite(v)]
    ref_loss = np.array(ref)
    zl = np.zeros(b)
    if fin.sum() >= 2:
        zl[fin] = robust_z(loss[fin], floor=0.05 * float(np.median(np.abs(loss[fin]))) + 1e-12)
    zw = np.zeros(b)
    if ref_loss.size >= 3 * b and fin.any():
        zw[fin] = robust_z(
            loss[fin], floor=0.05 * abs(float(np.median(ref_loss))) + 1e-12, reference=ref_loss
        )
    share = np.zeros(b)
    zs = np.zeros(b)
    if (
        r.sample_grad_sq is not None
        and math.isfinite(sum(r.sample_grad_sq))
        and sum(r.sample_grad_sq) > 0
    ):
        sq = np.array(r.sample_grad_sq)
        share = sq / sq.sum()
        zs = robust_z(share, floor=0.05 / b)
    # Natural data has long runs and repeats too (indentation, tables): a row's are
    # anomalous only past every other row of the window's other steps, and over half the row.
    ref_stats = [st for t, v in rep.row_stats.items() if t != s for st in v]
    run_cap = max((st.longest_run for st in ref_stats), default=0)
    rep_cap = max((st.periodic_repeat for st in ref_stats), default=0)
    rows = []
    evidence = False  # finite, data-level evidence (a non-finite loss alone is a numerics symptom)
    for i in range(b):
        why = []
        if share[i] > max(0.2, 2.0 / b) and zs[i] > th.z:
            why.append(f"{share[i]:.0%} of the gradient norm^2")
        if zl[i] > th.z:
            why.append(f"loss {loss[i]:.3g} (robust z {zl[i]:.1f} in its batch)")
        elif zw[i] > th.z:
            why.append(
                f"loss {loss[i]:.3g} (robust z {zw[i]:.1f} against the window's other steps' rows)"
            )
        numeric = bool(why)
        evidence |= numeric
        st = stats[i] if i < len(stats) else None
        if st is not None:
            data, decisive = [], False
            if st.longest_run > run_cap and st.longest_run >= st.length / 2:
                data.append(
                    f"one token repeated {st.longest_run} times (other steps' rows: at most {run_cap})"
                )
                decisive = st.longest_run >= DATA_MARGIN * run_cap
            elif st.periodic_repeat > rep_cap and st.periodic_repeat >= st.length / 2:
                data.append(
                    f"a pattern of period <= 13 repeated over {st.periodic_repeat} tokens (other steps' rows: at most {rep_cap})"
                )
                decisive = st.periodic_repeat >= DATA_MARGIN * rep_cap
            # A few rare tokens are normal in any window; a quarter of the row is not.
            if st.unseen >= max(1, 0.25 * st.length):
                data.append(f"{st.unseen} of {st.length} tokens seen nowhere else in the window")
                decisive = True
            # Data explains a row whose loss or gradient stands out; alone, it must stand
            # clear of every other row of the window, not just past the longest.
            if numeric or decisive:
                evidence |= bool(data)
                why += data
        if not fin[i] and fin.any():
            why.append("its loss is not finite while other rows' are")
        if why:
            sid = r.sample_ids[i] if r.sample_ids else None
            rows.append(
                {
                    "index": i,
                    "sample_id": sid,
                    "score": float(max(zs[i], zl[i], 0.0)),
                    "why": "; ".join(why),
                }
            )
    if not rows:
        return []
    carried = float(sum(share[x["index"]] for x in rows))
    idx = [x["index"] for x in rows]
    if not evidence:
        # Rows that only overflowed: they triggered the numerics, they are not bad data.
        return [
            Finding(
                "",
                "overflowing_samples",
                f"step {s}",
                1.0,
                "info",
                {"step": s, "rows": idx, "batch_size": b},
                f"step {s}: rows {idx} have a non-finite loss while the others' are finite; their data is unremarkable",
                "docs/signatures.md#per-sample-share, #data-stats",
                ("fp16_overflow", "bf16_overflow", "gradient_explosion"),
            )
        ]
    return [
        Finding(
            "",
            "anomalous_samples",
            f"step {s}",
            cap(carried / 0.5 * 2),
            "critical" if carried >= 0.5 else "warning",
            {
                "step": s,
                "rows": [x["index"] for x in rows],
                "grad_share": carried,
                "batch_size": b,
                "samples": rows,
            },
            f"step {s}: rows {[x['index'] for x in rows]} carry {carried:.0%} of the gradient norm^2 of a spiking batch",
            "docs/signatures.md#per-sample-share, #data-stats (OLMo-core instance filter)",
            ("poison_batch",),
            primary=carried >= 0.5,
        )
    ]


def _reproduction(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Replayed state vs *after*: impossible elements confined -> corruption; match -> reproduces."""
    rep = ev.rep
    if rep.matches is None:
        return []
    total = sum(m.numel for m in rep.matches) or 1
    mis = sum(m.mismatched for m in rep.matches)
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
    if not imp and mis / total <= 0.01:
        return [
            Finding(
                "",
                "replay_reproduces",
                "run",
                1.0,
                "info",
                {"mismatched_share": mis / total},
                f"the replay reproduces the after checkpoint ({1 - mis / total:.2%} of elements within tolerance): numerics or data, not hardware",
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
            {"mismatched_share": mis / total, "impossible_tensors": len(imp), "worst": worst.name},
            f"the replay deviates from after on {mis / total:.1%} of elements (worst: {worst.name} {worst.where}): {why}",
            "docs/signatures.md#reproducibility",
            (),
        )
    ]


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


# Statuses of the replay's check against the run's log whose replay is not evidence.
WITHHELD = ("missed_first", "missed_later")


def _log_agreement(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
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
        msg = (
            f"step {d}: the run's log spikes ({figures}) where the replay from the same state and batch does not, {before}: "
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


def _figures(miss: Any) -> str:
    parts = []
    if miss.loss_ok is False:
        parts.append(f"loss {miss.loss:.5g} vs {miss.logged_loss:.5g} logged")
    if miss.grad_ok is False:
        parts.append(f"grad norm {miss.grad_norm:.4g} vs {miss.logged_grad_norm:.4g} logged")
    return ", ".join(parts)


# The onset detectors' findings whose step is the first bad step.
ONSET_KINDS = ("lr_step_jump", "replay_spike")
ONSET_DETECTORS: tuple[ReplayDetector, ...] = (_lr_steps, _spike)
EXAMINE_DETECTORS: tuple[ReplayDetector, ...] = (_localise, _overflow, _samples, _attention)
STATE_DETECTORS: tuple[ReplayDetector, ...] = (
    _output_logits,
    _rms_t,
    _reproduction,
    _log_agreement,
)
