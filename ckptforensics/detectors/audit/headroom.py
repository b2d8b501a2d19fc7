"""The headroom checks, now: attention and output logits against their caps, and activation
growth since the previous checkpoint."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptforensics.core.tensors import robust_z
from ckptforensics.detectors.audit.rows import (
    ATTN_LOGIT_CAP,
    FINAL_LOGIT_CAP,
    GROWTH_LIMIT,
    GROWTH_Z,
    AuditEvidence,
    Check,
    no_model,
    row,
)

__all__ = ["attention_logits", "output_logits", "activation_growth"]


def attention_logits(ev: AuditEvidence) -> Check:
    """The largest pre-softmax attention logit per layer on the traced batch."""
    paper = "Gemma 2 caps at 50, arXiv 2408.00118; Dehghani et al. 2023; Zhai et al. 2023, arXiv 2303.06296"
    if ev.arch is None:
        return no_model(
            ev,
            "attention_logits",
            "headroom",
            f"docs/signatures.md#audit-attention-logits ({paper})",
        )
    src = f"docs/signatures.md#audit-attention-logits ({paper})"
    layers = [x for x in ev.arch.layers if math.isfinite(x.max_logit)]
    if not layers:
        return row(
            "attention_logits",
            "headroom",
            "unknown",
            None,
            ATTN_LOGIT_CAP,
            "no attention logits measured",
            src,
        )
    per = {x.module: x.max_logit for x in layers}
    ent = {x.module: x.entropy for x in layers}
    top = max(layers, key=lambda x: x.max_logit)
    value = {"max_logit": per, "entropy": ent, "batch": ev.batch_source}
    prev = {x.module: x.max_logit for x in ev.prev.layers} if ev.prev is not None else {}
    grew = f", {prev[top.module]:.3g} at step {ev.prev_step}" if top.module in prev else ""
    if top.max_logit > ATTN_LOGIT_CAP and not top.softcap:
        return row(
            "attention_logits",
            "headroom",
            "risk",
            value,
            ATTN_LOGIT_CAP,
            f"{top.module}'s largest attention logit is {top.max_logit:.3g}{grew} (its most collapsed head's entropy "
            f"{top.entropy:.2f} of uniform) on {ev.batch_source}",
            src,
            "warning",
            supports=("attention_logit_growth",),
            subject=top.module,
            fix="add QK-norm or soft-cap attention logits before the next increase of LR or scale",
        )
    return row(
        "attention_logits",
        "headroom",
        "ok",
        value,
        ATTN_LOGIT_CAP,
        f"largest attention logit {top.max_logit:.3g} ({top.module}) on {ev.batch_source}",
        src,
    )


def output_logits(ev: AuditEvidence) -> Check:
    """log Z and the output logits on the traced batch, and log Z's drift since the earlier
    checkpoint on the same batch."""
    paper = "PaLM z-loss, arXiv 2204.02311; Gemma 2 final cap 30; Wortsman et al. 2023, sec. 3.1.2"
    if ev.arch is None:
        return no_model(
            ev, "output_logits", "headroom", f"docs/signatures.md#audit-output-logits ({paper})"
        )
    a = ev.arch
    src = f"docs/signatures.md#audit-output-logits ({paper})"
    value: dict[str, Any] = {
        "log_z": a.log_z,
        "logit_mean": a.logit_mean,
        "logit_max": a.logit_max,
        "batch": ev.batch_source,
    }
    drift = ""
    falling = False
    if ev.prev is not None and math.isfinite(ev.prev.log_z):
        value["log_z_before"] = ev.prev.log_z
        value["step_before"] = ev.prev_step
        drift = f" (log Z {ev.prev.log_z:.3g} at step {ev.prev_step})"
        falling = abs(a.log_z) < abs(ev.prev.log_z)
    if not math.isfinite(a.log_z):
        return row(
            "output_logits",
            "headroom",
            "risk",
            value,
            FINAL_LOGIT_CAP,
            "the output logits are not finite",
            src,
            "critical",
            supports=("output_logit_divergence",),
        )
    if abs(a.log_z) > FINAL_LOGIT_CAP and not falling:
        return row(
            "output_logits",
            "headroom",
            "risk",
            value,
            FINAL_LOGIT_CAP,
            f"log Z is {a.log_z:.3g}{drift}, mean logit {a.logit_mean:.3g}, max {a.logit_max:.3g}: the head's logits have left the log-probabilities",
            src,
            "warning",
            supports=("output_logit_divergence",),
            subject=a.head_module or a.head_param or "run",
            fix="add z-loss (1e-4 log^2 Z) or a final soft-cap; weight decay on the head bounds it too",
        )
    return row(
        "output_logits",
        "headroom",
        "ok",
        value,
        FINAL_LOGIT_CAP,
        f"log Z {a.log_z:.3g}{drift}, max logit {a.logit_max:.3g}",
        src,
    )


def activation_growth(ev: AuditEvidence) -> Check:
    """Per-layer RMS of the residual stream after each attention add, now against the earlier
    checkpoint on the same batch: one layer growing out of line with the others."""
    src = "docs/signatures.md#audit-activation-growth (Rybakov et al. 2024, arXiv 2410.16682; Wortsman et al. 2023, sec. 3.4; OLMo-core 6 sigma)"
    if ev.arch is None or ev.prev is None:
        why = ev.arch_note if ev.arch is None else "no earlier checkpoint to compare with"
        return row(
            "activation_growth",
            "headroom",
            "unknown",
            None,
            GROWTH_LIMIT,
            f"not checked: {why}",
            src,
        )
    before = {x.module: x.stream_rms for x in ev.prev.layers}
    ratio = {
        x.module: x.stream_rms / before[x.module]
        for x in ev.arch.layers
        if x.module in before and before[x.module] > 0 and math.isfinite(x.stream_rms)
    }
    if len(ratio) < 2:
        return row(
            "activation_growth",
            "headroom",
            "unknown",
            None,
            GROWTH_LIMIT,
            "the residual stream was not found in both checkpoints",
            src,
        )
    names = list(ratio)
    vals = np.array([ratio[n] for n in names])
    z = robust_z(np.log10(vals), floor=0.02)
    i = int(np.argmax(vals))
    value = {"growth": ratio, "step_before": ev.prev_step}
    if vals[i] > GROWTH_LIMIT and z[i] > GROWTH_Z:
        return row(
            "activation_growth",
            "headroom",
            "risk",
            value,
            GROWTH_LIMIT,
            f"{names[i]}'s residual stream RMS grew {vals[i]:.3g}x since step {ev.prev_step} (robust z {z[i]:.1f} among the layers)",
            src,
            "warning",
            supports=("gradient_explosion",),
            subject=names[i],
            fix="replay the steps since the earlier checkpoint (`ckptforensics replay`) and watch that layer",
        )
    return row(
        "activation_growth",
        "headroom",
        "ok",
        value,
        GROWTH_LIMIT,
        f"residual stream growth since step {ev.prev_step} at most {vals[i]:.3g}x ({names[i]})",
        src,
    )
