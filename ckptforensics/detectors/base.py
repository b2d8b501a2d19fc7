"""Findings and thresholds: what every detector returns and reads.

A detector is a pure function `(evidence, Thresholds) -> list[Finding]`: it opens no file,
logs and prints nothing. Each finding cites its row of docs/signatures.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptforensics.core.tensors import LR_GROWTH_MARGIN

__all__ = ["Finding", "Thresholds", "SEVERITIES", "module_of", "cap", "with_id"]

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of evidence, traceable to the statistic and threshold that raised it.

    Attributes:
        id: stable within a report ('F1', 'F2', ...; assigned by `diff_findings`).
        kind: the signature ('adam_bound_violation', 'lr_jump', ...).
        subject: tensor, module or 'run'.
        score: how far past its threshold (1 = at the threshold; dimensionless).
        severity: 'info', 'warning' or 'critical'.
        metrics: the statistic(s) and the threshold used.
        message: one sentence for people.
        source: the catalogue row / paper it implements.
        supports: causes this evidence points to, strongest first.
        primary: direct evidence of a cause (a recorded LR, a flipped bit) rather than
            an effect that several causes share (a gradient burst).
    """

    id: str
    kind: str
    subject: str
    score: float
    severity: str
    metrics: dict[str, Any]
    message: str
    source: str
    supports: tuple[str, ...]
    primary: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """Detector thresholds, each with its source.

    Attributes:
        z: robust z that marks a tensor as an outlier among its peers (OLMo-core 6 sigma).
        burst: implied gradient energy r_v that counts as a burst (r_v >> 1; docs/signatures.md#gradient-burst).
        update_ratio: ||dw||/||w|| per step; healthy pre-training sits near 1e-3
            (Karpathy's update:data rule), 100x that moves a weight 10% a step.
        lr_over_base: LR above the schedule's own base/peak LR by this factor.
        lr_growth_margin: LR growth beyond what a linear warmup from zero allows, times this.
        confined_tensors: corruption touches at most this many tensors ...
        confined_share: ... and at most this share (or 8 elements) of each.
        headroom_warn: max|x| within this factor of the dtype's max.
        logit_max: the head's normaliser |log Z| past which its logits count as drifted:
            Gemma 2 soft-caps final logits at 30 (Gemma Team 2024, arXiv 2408.00118, sec. 2),
            and PaLM's z-loss holds log Z at 0 (Chowdhery et al. 2022, sec. 5).
        attn_logit: a pre-softmax attention logit past which attention saturates: Gemma 2
            soft-caps attention logits at 50 (arXiv 2408.00118, sec. 2); ViT-22B's divergence
            came with logits far past it (Dehghani et al. 2023, arXiv 2302.05442, sec. 2).
        attn_growth: a layer's attention logits grew (its max over the steps up to the bad
            step against its own value on the window's first step) by this factor, or its
            most collapsed head's entropy fell by it (Zhai et al. 2023's entropy collapse).
        rho_share: share of sign-like updates (|m|/sqrt(v) > 0.9) (Molybog 2304.09871).
        routine_backoffs: loss-scale halvings between two checkpoints that dynamic loss
            scaling makes in normal operation (one per growth_interval; a window of a few
            hundred steps meets one or two with torch's default interval of 2000).
        routine_overflow: a scaled gradient within this factor of fp16's limit is the
            scaler probing its ceiling (two halvings undo it), not an overflow incident.
    """

    z: float = 6.0
    burst: float = 10.0
    update_ratio: float = 0.1
    lr_over_base: float = 1.5
    logit_max: float = 30.0
    attn_logit: float = 50.0
    attn_growth: float = 1.5
    lr_growth_margin: float = LR_GROWTH_MARGIN
    confined_tensors: int = 4
    confined_share: float = 1e-5
    headroom_warn: float = 2.0
    rho_share: float = 0.5
    routine_backoffs: int = 2
    routine_overflow: float = 4.0


def module_of(name: str) -> str:
    """'transformer.h.3.attn.c_proj.weight' -> 'transformer.h.3.attn.c_proj'."""
    return name.rsplit(".", 1)[0] if "." in name else name


def cap(x: float, hi: float = 1e6) -> float:
    return float(min(x, hi)) if math.isfinite(x) else hi


def with_id(f: Finding, i: int) -> Finding:
    """The finding numbered `F<i>` (ids are assigned once all detectors have run)."""
    return Finding(
        f"F{i}",
        f.kind,
        f.subject,
        f.score,
        f.severity,
        f.metrics,
        f.message,
        f.source,
        f.supports,
        f.primary,
    )
