"""The numerics checks: fp16 without a loss scaler, bf16 without fp32 master weights, and
the loss scale's history."""

from __future__ import annotations

import math

from ckptforensics.detectors.audit.rows import (
    GROWTH_INTERVAL,
    AuditEvidence,
    Check,
    row,
)

__all__ = ["fp16_loss_scaler", "master_weights", "loss_scale_history"]


def fp16_loss_scaler(ev: AuditEvidence) -> Check:
    """fp16 gradients underflow without a loss scale (and overflow past 65504)."""
    src = "docs/signatures.md#audit-fp16-loss-scaler (Micikevicius et al. 2018, Mixed Precision Training, arXiv 1710.03740, sec. 3.2)"
    if ev.precision != "fp16":
        return row(
            "fp16_loss_scaler",
            "numerics",
            "ok",
            ev.precision,
            None,
            f"{ev.precision} training ({ev.precision_source}): no loss scale needed",
            src,
        )
    if ev.loss_scale is None and not ev.scales:
        return row(
            "fp16_loss_scaler",
            "numerics",
            "risk",
            "fp16, no scaler",
            "a loss scaler",
            f"fp16 training ({ev.precision_source}) with no loss-scaler state in the checkpoint and no loss scale in the log",
            src,
            "critical",
            supports=("fp16_overflow",),
            fix="use dynamic loss scaling (torch.amp.GradScaler) or train in bf16",
        )
    scale = ev.loss_scale if ev.loss_scale is not None else ev.scales[-1][1]
    if scale < 1:
        return row(
            "fp16_loss_scaler",
            "numerics",
            "risk",
            scale,
            1.0,
            f"fp16 with a loss scale of {scale:g}: the scale has collapsed below 1",
            src,
            "critical",
            supports=("loss_scale_collapse", "fp16_overflow"),
            fix="find the overflowing module (`ckptforensics replay`); train in bf16",
        )
    return row(
        "fp16_loss_scaler",
        "numerics",
        "ok",
        scale,
        1.0,
        f"fp16 with dynamic loss scaling (scale {scale:g})",
        src,
    )


def master_weights(ev: AuditEvidence) -> Check:
    """bf16 weights updated in bf16 lose every update below half their spacing."""
    src = "docs/signatures.md#audit-master-weights (Kalamkar et al. 2019, arXiv 1905.12322; Zamirai et al. 2020, arXiv 2010.06192)"
    if (
        ev.fp32_masters
    ):  # read as the weights where the checkpoint keeps them (Megatron, DeepSpeed): fp32 here
        return row(
            "master_weights",
            "numerics",
            "ok",
            "fp32 masters",
            None,
            f"bf16 weights over fp32 master weights ({ev.precision_source})",
            src,
        )
    if ev.weight_dtype != "bfloat16":
        return row(
            "master_weights",
            "numerics",
            "ok",
            ev.weight_dtype,
            None,
            f"weights stored in {ev.weight_dtype}",
            src,
        )
    lost = ev.bf16_lost
    if ev.moment_dtype == "float32":
        return row(
            "master_weights",
            "numerics",
            "unknown",
            ev.moment_dtype,
            None,
            "bf16 weights with fp32 Adam moments: a mixed-precision optimizer keeps fp32 master weights (Megatron, DeepSpeed), "
            "which this checkpoint does not show"
            + (
                f"; without them {lost:.0%} of updates at the current LR would round away"
                if math.isfinite(lost)
                else ""
            ),
            src,
        )
    if math.isfinite(lost) and lost > 0.5:
        return row(
            "master_weights",
            "numerics",
            "risk",
            lost,
            0.5,
            f"bf16 weights and bf16 Adam state, no fp32 copy: {lost:.0%} of weight elements are so large that an LR-sized update rounds away",
            src,
            "warning",
            supports=("adam_instability",),
            fix="keep fp32 master weights (mixed-precision optimizer) or use stochastic rounding / Kahan summation",
        )
    return row(
        "master_weights",
        "numerics",
        "ok",
        lost,
        0.5,
        f"bf16 weights and state; {lost:.0%} of updates at the current LR round away",
        src,
    )


def loss_scale_history(ev: AuditEvidence) -> Check:
    """Loss-scale backoffs per 1000 steps against the scaler's equilibrium (one halving per
    growth interval): more, and the scale trends down toward collapse."""
    src = "docs/signatures.md#audit-loss-scale-history (torch.amp.GradScaler growth_interval 2000 / backoff 0.5; Micikevicius et al. 2018)"
    if ev.precision != "fp16":
        return row(
            "loss_scale_history",
            "numerics",
            "ok",
            None,
            None,
            f"{ev.precision} training: no loss scale to back off",
            src,
        )
    if len(ev.scales) < 2:
        return row(
            "loss_scale_history",
            "numerics",
            "unknown",
            None,
            None,
            "the training log has no loss-scale column: log `loss_scale` each step",
            src,
        )
    steps = [s for s, _ in ev.scales]
    backoffs = sum(1 for (_, a), (_, b) in zip(ev.scales, ev.scales[1:], strict=False) if b < a)
    span = max(steps[-1] - steps[0], 1)
    rate = 1000.0 * backoffs / span
    interval = ev.growth_interval or GROWTH_INTERVAL
    limit = 1000.0 / interval
    if rate > limit:
        return row(
            "loss_scale_history",
            "numerics",
            "risk",
            rate,
            limit,
            f"{backoffs} loss-scale backoffs over {span} logged steps ({rate:.3g} per 1k; the scaler regrows once per {interval} steps)",
            src,
            "warning",
            supports=("loss_scale_collapse", "fp16_overflow"),
            fix="train in bf16, or find the module that overflows (`ckptforensics replay`)",
        )
    return row(
        "loss_scale_history",
        "numerics",
        "ok",
        rate,
        limit,
        f"{backoffs} backoffs over {span} logged steps ({rate:.3g} per 1k)",
        src,
    )
