"""The architecture checks: norm placement, QK-norm, logit control, tied embeddings and
embedding scale, read off the traced model."""

from __future__ import annotations

import math

from ckptforensics.detectors.audit.rows import (
    ATTN_LOGIT_CAP,
    EMBED_RMS_MIN,
    FINAL_LOGIT_CAP,
    AuditEvidence,
    Check,
    no_model,
    row,
)

__all__ = ["norm_placement", "qk_norm", "logit_control", "tied_embeddings", "embedding_scale"]


def norm_placement(ev: AuditEvidence) -> Check:
    """Post-LN (or no norm) puts the residual stream itself through every norm: large
    gradients near the output at initialisation, divergence without a long warm-up."""
    paper = "Xiong et al. 2020, arXiv 2002.04745; Liu et al. 2020, arXiv 2004.08249"
    if ev.arch is None:
        return no_model(
            ev,
            "norm_placement",
            "architecture",
            f"docs/signatures.md#audit-norm-placement ({paper})",
        )
    p = ev.arch.norm_placement
    per = {x.module: x.placement for x in ev.arch.layers}
    src = f"docs/signatures.md#audit-norm-placement ({paper})"
    fused = ev.arch.fused_norms
    inside = (
        f"; {len(fused)} norms fused into the projection after them ({fused[0]}, ...)"
        if len(fused) > 1
        else f"; the norm fused into {fused[0]}"
        if fused
        else ""
    )
    if p in ("pre", "reordered", "sandwich"):
        return row(
            "norm_placement",
            "architecture",
            "ok",
            p,
            "pre, reordered or sandwich",
            f"norm placement {p} in all {len(per)} attention layers{inside}",
            src,
        )
    if p in ("post", "none"):
        what = (
            "post-LN: the residual stream is normalised after every add"
            if p == "post"
            else "no norm found around the attention layers"
        )
        return row(
            "norm_placement",
            "architecture",
            "risk",
            p,
            "pre, reordered or sandwich",
            f"{what} ({len(per)} layers)",
            src,
            "warning",
            supports=("gradient_explosion",),
            fix="normalise each sublayer's input (pre-LN) or output (OLMo 2's reordered norm); a post-LN run needs a long warm-up",
        )
    return row(
        "norm_placement",
        "architecture",
        "unknown",
        p,
        "pre, reordered or sandwich",
        f"norm placement {p}: {'; '.join(ev.arch.notes) or per}",
        src,
    )


def qk_norm(ev: AuditEvidence) -> Check:
    """Queries and keys without a norm (or an attention soft-cap) leave the attention logits
    unbounded: they grow with the weights at a high LR until attention collapses."""
    paper = "Dehghani et al. 2023, arXiv 2302.05442; Wortsman et al. 2023, arXiv 2309.14322"
    if ev.arch is None:
        return no_model(
            ev, "qk_norm", "architecture", f"docs/signatures.md#audit-qk-norm ({paper})"
        )
    src = f"docs/signatures.md#audit-qk-norm ({paper})"
    layers = ev.arch.layers
    if not layers:
        return row(
            "qk_norm",
            "architecture",
            "unknown",
            None,
            True,
            "no attention call was seen in the forward pass",
            src,
        )
    if ev.arch.qk_norm:
        return row(
            "qk_norm",
            "architecture",
            "ok",
            True,
            True,
            f"queries and keys are normalised in all {len(layers)} attention layers",
            src,
        )
    bare = [x for x in layers if not x.qk_norm and not x.softcap]
    if not bare:
        return row(
            "qk_norm",
            "architecture",
            "ok",
            False,
            True,
            "no QK-norm, but every layer soft-caps its attention logits (tanh, Gemma 2)",
            src,
        )
    top = max(bare, key=lambda x: x.max_logit if math.isfinite(x.max_logit) else -1)
    hot = math.isfinite(top.max_logit) and top.max_logit > ATTN_LOGIT_CAP
    return row(
        "qk_norm",
        "architecture",
        "risk",
        False,
        True,
        f"{len(bare)} of {len(layers)} attention layers normalise neither queries nor keys nor cap their logits"
        + (f"; {top.module}'s already reach {top.max_logit:.3g}" if hot else ""),
        src,
        "warning" if hot else "info",
        supports=("attention_logit_growth",) if hot else (),
        fix="add QK-norm (LayerNorm or RMSNorm on each head's queries and keys) or cap attention logits (Gemma 2: 50 tanh(x/50))",
        subject=top.module,
    )


def logit_control(ev: AuditEvidence) -> Check:
    """Nothing holds the head's logits to the log-probabilities without z-loss or a final
    soft-cap: log Z is free to drift."""
    paper = (
        "Chowdhery et al. 2022 (PaLM), arXiv 2204.02311, sec. 5; Gemma Team 2024, arXiv 2408.00118"
    )
    src = f"docs/signatures.md#audit-logit-control ({paper})"
    if ev.z_loss:
        return row(
            "logit_control",
            "architecture",
            "ok",
            f"z-loss {ev.z_loss:g}",
            "z-loss or soft-cap",
            f"z-loss {ev.z_loss:g} ({ev.z_loss_source})",
            src,
        )
    if ev.arch is not None and ev.arch.final_softcap:
        return row(
            "logit_control",
            "architecture",
            "ok",
            "final soft-cap",
            "z-loss or soft-cap",
            "the head's logits pass a tanh soft-cap",
            src,
        )
    if ev.arch is None:
        return no_model(
            ev, "logit_control", "architecture", f"docs/signatures.md#audit-logit-control ({paper})"
        )
    lz = ev.arch.log_z
    hot = math.isfinite(lz) and abs(lz) > FINAL_LOGIT_CAP
    return row(
        "logit_control",
        "architecture",
        "risk",
        "none",
        "z-loss or soft-cap",
        "no z-loss recorded and no soft-cap on the final logits"
        + (f"; log Z is already {lz:.3g}" if hot else ""),
        src,
        "warning" if hot else "info",
        supports=("output_logit_divergence",) if hot else (),
        fix="add z-loss (1e-4 log^2 Z, PaLM; OLMo-core's z_loss_multiplier) or soft-cap the final logits (Gemma 2: 30 tanh(x/30))",
    )


def tied_embeddings(ev: AuditEvidence) -> Check:
    """Whether the head reuses the token embedding: context for the embedding and head rows."""
    paper = "Press & Wolf 2017, arXiv 1608.05859; Chowdhery et al. 2022, sec. 2"
    if ev.arch is None:
        return no_model(
            ev,
            "tied_embeddings",
            "architecture",
            f"docs/signatures.md#audit-tied-embeddings ({paper})",
        )
    t = ev.arch.tied_embeddings
    return row(
        "tied_embeddings",
        "architecture",
        "ok" if t is not None else "unknown",
        t,
        None,
        (
            "the head reuses the token embedding"
            if t
            else "the head has its own weight"
            if t is False
            else "the head's weight was not found"
        )
        + (f" ({ev.arch.head_param})" if ev.arch.head_param else ""),
        f"docs/signatures.md#audit-tied-embeddings ({paper})",
    )


def embedding_scale(ev: AuditEvidence) -> Check:
    """The stream entering the first block: in a pre-LN stack it is the shortcut every later
    gradient rides; far below 1 breaks Takase et al.'s large-shortcut condition."""
    paper = "Takase et al. 2023, Spike No More, arXiv 2312.16903"
    if ev.arch is None:
        return no_model(
            ev,
            "embedding_scale",
            "architecture",
            f"docs/signatures.md#audit-embedding-scale ({paper})",
        )
    r = ev.arch.embed_rms
    src = f"docs/signatures.md#audit-embedding-scale ({paper})"
    if not math.isfinite(r):
        return row(
            "embedding_scale",
            "architecture",
            "unknown",
            None,
            EMBED_RMS_MIN,
            "the stream entering the first attention layer was not found",
            src,
        )
    if ev.arch.norm_placement == "post":
        return row(
            "embedding_scale",
            "architecture",
            "ok",
            r,
            EMBED_RMS_MIN,
            f"embedding output RMS {r:.3g}; post-LN normalises the stream after every add",
            src,
        )
    if r >= EMBED_RMS_MIN:
        return row(
            "embedding_scale",
            "architecture",
            "ok",
            r,
            EMBED_RMS_MIN,
            f"the stream enters the first layer at RMS {r:.3g}",
            src,
        )
    return row(
        "embedding_scale",
        "architecture",
        "risk",
        r,
        EMBED_RMS_MIN,
        f"the stream enters the first layer at RMS {r:.3g}, far below the ~1 of Takase et al.'s stable pre-LN (scaled or normed embeddings)",
        src,
        "info",
        supports=("gradient_explosion",),
        fix="scale the embeddings by sqrt(d_model) or add a LayerNorm after them (Takase et al. 2023)",
    )
