"""The examination stage, on the step that went bad: the first module out of its range
(forward and backward), overflowing tensors, the attention layer whose logits grew."""

from __future__ import annotations

import math
import warnings

import numpy as np

from ckptforensics.core.tensors import (
    robust_z,
)
from ckptforensics.detectors.base import Finding, Thresholds, cap, module_of
from ckptforensics.detectors.replay.evidence import ReplayEvidence
from ckptforensics.engine.replay.probes import BWD_STATS, FWD_STATS
from ckptforensics.trainers.fused import computes

__all__ = ["STALE_RMS_T", "attention", "localise", "overflow"]


def localise(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """First module, in forward and in backward order, far outside its own range on other
    steps; the backward finding ranks the modules past the threshold (the replay's layers)."""

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
    params = tuple(rec.param_grad_rms) if rec is not None else ()
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
                fused=computes(p.modules[fwd_first], params),
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
                fused=computes(p.modules[bwd_first], params),
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
    fused: str | None = None,
) -> Finding:
    """The first module, in forward or backward order, whose statistic leaves its range; where
    it holds a parameter with a stale second moment, evidence of Adam's instability first.
    A fused module is named with what it computes (`trainers.fused.computes`)."""
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
        f"step {s}: {name}{f' ({fused})' if fused else ''} is the first module in {order} order whose {what} leaves its range{extra} ({label} {value:.3g}, robust z {z:.1f})"
        + (
            f"; its gradient is over {STALE_RMS_T:g}x what Adam's second moment expects (RMS_t)"
            if adam
            else ""
        ),
        "docs/signatures.md#first-anomaly (OLMo-core 6 sigma)" + (", #rms-t" if adam else ""),
        ("adam_instability", "gradient_explosion") if adam else ("gradient_explosion",),
    )


def overflow(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """The first step with non-finite values in the run's precision that the fp32 replay does not have."""

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


def attention(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
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
