"""The optimizer checks: epsilon-dominated moments, beta2, weight decay on norms and
embeddings, clipping and warm-up."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ckptforensics.core.tensors import robust_z
from ckptforensics.detectors.audit.rows import (
    EPS_SHARE,
    GROWTH_Z,
    RMS_T_LIMIT,
    AuditEvidence,
    Check,
    row,
)

__all__ = ["adam_epsilon", "beta2", "weight_decay", "clipping", "warmup"]


def adam_epsilon(ev: AuditEvidence) -> Check:
    """Tensors whose second moment fell below eps^2 for most elements: Adam's update there
    is m / eps, not normalised."""
    src = "docs/signatures.md#audit-adam-epsilon (Molybog et al. 2023, arXiv 2304.09871)"
    if not ev.moments or ev.eps is None:
        return row(
            "adam_epsilon",
            "optimizer",
            "unknown",
            None,
            EPS_SHARE,
            "no Adam state in the checkpoint",
            src,
        )
    total = sum(m.numel for m in ev.moments)
    share = sum(m.eps_share * m.numel for m in ev.moments) / max(total, 1)
    hit = sorted((m for m in ev.moments if m.eps_share > EPS_SHARE), key=lambda m: -m.eps_share)
    weights = [m for m in hit if m.role != "embedding"]
    value = {"share": share, "tensors": {m.name: m.eps_share for m in hit[:8]}}
    if not hit:
        return row(
            "adam_epsilon",
            "optimizer",
            "ok",
            value,
            EPS_SHARE,
            f"{share:.1%} of moment elements have sqrt(v_hat) < eps {ev.eps:g}; no tensor is mostly there",
            src,
        )
    lead = (weights or hit)[0]
    return row(
        "adam_epsilon",
        "optimizer",
        "risk",
        value,
        EPS_SHARE,
        f"{len(hit)} tensors have most elements with sqrt(v_hat) < eps {ev.eps:g} (worst {lead.name}: {lead.eps_share:.0%})"
        + ("; only embeddings, whose idle rows keep a stale v" if not weights else ""),
        src,
        "warning" if weights else "info",
        supports=("adam_instability",) if weights else (),
        fix="lower Adam's eps (1e-15 .. 1e-12 at scale) or check why these tensors' gradients vanished",
        subject=lead.name,
    )


def beta2(ev: AuditEvidence) -> Check:
    """beta2's half-life in steps (and tokens) against what this batch's gradient needs:
    RMS_t > 1 says the second moment is out of date for a tensor (StableAdamW)."""
    src = "docs/signatures.md#audit-beta2 (Wortsman et al. 2023, arXiv 2304.13013, sec. 3.4; Marek et al. 2025, arXiv 2507.07101)"
    if ev.betas is None:
        return row(
            "beta2",
            "optimizer",
            "unknown",
            None,
            RMS_T_LIMIT,
            "no Adam state in the checkpoint",
            src,
        )
    b2 = ev.betas[1]
    half = math.log(0.5) / math.log(b2) if 0 < b2 < 1 else math.inf
    tok = half * ev.tokens_per_step if math.isfinite(ev.tokens_per_step) else math.nan
    value: dict[str, Any] = {"beta2": b2, "half_life_steps": half, "token_half_life": tok}
    what = f"beta2 {b2:g}: v's half-life is {half:.3g} steps" + (
        f" ({tok:.3g} tokens)" if math.isfinite(tok) else ""
    )
    names = [
        n
        for n in ev.rms_t
        if n not in ev.embedding_params and ev.rms_t[n] > 0 and math.isfinite(ev.rms_t[n])
    ]
    if len(names) < 4:
        why = (
            ev.arch_note
            if ev.arch is None
            else "no batch of the run to take a gradient on"
            if (ev.batch_source or "").startswith("random")
            else "no Adam state"
        )
        return row(
            "beta2",
            "optimizer",
            "unknown",
            value,
            RMS_T_LIMIT,
            f"{what}; RMS_t not measured ({why})",
            src,
        )
    vals = np.array([ev.rms_t[n] for n in names])
    z = robust_z(np.log10(vals), floor=0.1)
    i = int(np.argmax(vals))
    value["rms_t_max"] = float(vals[i])
    value["rms_t_tensor"] = names[i]
    if vals[i] > RMS_T_LIMIT and z[i] > GROWTH_Z:
        return row(
            "beta2",
            "optimizer",
            "risk",
            value,
            RMS_T_LIMIT,
            f"{what}; on this batch {names[i]}'s gradient is {vals[i]:.3g}x what its second moment expects (RMS_t, robust z {z[i]:.1f})",
            src,
            "warning",
            supports=("adam_instability",),
            fix="lower beta2 (0.95) or clip updates per tensor (StableAdamW / Adafactor update clipping)",
            subject=names[i],
        )
    return row(
        "beta2",
        "optimizer",
        "ok",
        value,
        RMS_T_LIMIT,
        f"{what}; RMS_t at most {vals[i]:.3g} ({names[i]})",
        src,
    )


def weight_decay(ev: AuditEvidence) -> Check:
    """Weight decay on norm gains and embeddings pulls them toward zero: the norms' scale
    and the embedding's shortcut shrink (OLMo 2 dropped it on embeddings for stability)."""
    src = "docs/signatures.md#audit-weight-decay (Team OLMo 2024, OLMo 2, arXiv 2501.00656; Megatron-LM / nanoGPT exclude norms and biases)"
    if not ev.decayed:
        return row(
            "weight_decay",
            "optimizer",
            "unknown",
            None,
            0.0,
            "no optimizer param groups in the checkpoint",
            src,
        )
    if ev.arch is None:
        return row(
            "weight_decay",
            "optimizer",
            "unknown",
            None,
            0.0,
            f"norms and embeddings not identified: {ev.arch_note}",
            src,
        )
    hit = {
        n: ev.decayed[n]
        for n in (*ev.norm_params, *ev.embedding_params)
        if ev.decayed.get(n, 0.0) > 0
    }
    if not hit:
        return row(
            "weight_decay",
            "optimizer",
            "ok",
            {},
            0.0,
            "no weight decay on norm gains or embeddings",
            src,
        )
    emb = [n for n in hit if n in ev.embedding_params]
    return row(
        "weight_decay",
        "optimizer",
        "risk",
        hit,
        0.0,
        f"weight decay on {len(hit)} norm / embedding tensors"
        + (f", embeddings included ({', '.join(emb[:2])})" if emb else ""),
        src,
        "info",
        fix="put norm gains, biases and embeddings in a param group with weight_decay=0",
        subject=next(iter(hit)),
    )


def clipping(ev: AuditEvidence) -> Check:
    """No gradient clipping lets one bad batch take a full-size step."""
    src = "docs/signatures.md#audit-clipping (Pascanu et al. 2013, arXiv 1211.5063; clip 1.0 in GPT-3, PaLM, LLaMA, OLMo)"
    if ev.clip_source is None:
        return row(
            "clipping",
            "optimizer",
            "unknown",
            None,
            None,
            "the run recorded no gradient-clipping setting",
            src,
        )
    if not ev.clip:
        return row(
            "clipping",
            "optimizer",
            "risk",
            0.0,
            "> 0",
            f"gradient clipping is off ({ev.clip_source})",
            src,
            "warning",
            supports=("gradient_explosion",),
            fix="clip the global gradient norm (1.0 is the usual LLM setting)",
        )
    return row(
        "clipping",
        "optimizer",
        "ok",
        ev.clip,
        "> 0",
        f"gradients clipped at norm {ev.clip:g} ({ev.clip_source})",
        src,
    )


def warmup(ev: AuditEvidence) -> Check:
    """Warm-up shorter than 2 / (1 - beta2) steps: Adam's second moment is still an average
    of too few gradients when the LR reaches its peak (Ma & Yarats 2021)."""
    src = "docs/signatures.md#audit-warmup (Ma & Yarats 2021, On the Adequacy of Untuned Warmup for Adaptive Optimization, arXiv 1910.04209; Wortsman et al. 2023, sec. 3.2.1)"
    if ev.warmup is None:
        return row(
            "warmup",
            "optimizer",
            "unknown",
            None,
            None,
            "no warm-up length recorded and no LR column in the log",
            src,
        )
    b2 = ev.betas[1] if ev.betas else 0.999
    need = 2.0 / (1.0 - b2)
    frac = (
        f" ({ev.warmup / ev.total_steps:.1%} of {ev.total_steps} steps)" if ev.total_steps else ""
    )
    value = {"warmup": ev.warmup, "total_steps": ev.total_steps}
    if ev.warmup < need:
        return row(
            "warmup",
            "optimizer",
            "risk",
            value,
            need,
            f"warm-up of {ev.warmup} steps{frac} ({ev.warmup_source}), shorter than 2/(1-beta2) = {need:.0f}",
            src,
            "warning",
            supports=("lr_too_high",),
            fix=f"warm the LR up over at least {math.ceil(need)} steps",
        )
    return row(
        "warmup",
        "optimizer",
        "ok",
        value,
        need,
        f"warm-up of {ev.warmup} steps{frac} ({ev.warmup_source}) >= 2/(1-beta2) = {need:.0f}",
        src,
    )
