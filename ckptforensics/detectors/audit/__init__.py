"""The audit's checks: pure functions from a run's evidence to one row each, with the
figure measured, the level it is judged against and where that level comes from.

A row is `ok`, a `risk` (with a severity and the causes it leads to), or `unknown` (the run
did not record what the check needs: the row says what would). Nothing here opens a file.
One module per area (`architecture`, `numerics`, `optimizer`, `headroom`, `observability`);
`rows` holds the row, the evidence and the danger levels they share.
"""

from __future__ import annotations

from ckptforensics.detectors.audit.architecture import (
    embedding_scale,
    logit_control,
    norm_placement,
    qk_norm,
    tied_embeddings,
)
from ckptforensics.detectors.audit.headroom import (
    activation_growth,
    attention_logits,
    output_logits,
)
from ckptforensics.detectors.audit.moe import load_balancing, router_precision, router_z_loss
from ckptforensics.detectors.audit.numerics import (
    fp16_loss_scaler,
    loss_scale_history,
    master_weights,
)
from ckptforensics.detectors.audit.observability import batch_log, grad_norm_logging
from ckptforensics.detectors.audit.optimizer import (
    adam_epsilon,
    beta2,
    clipping,
    warmup,
    weight_decay,
)
from ckptforensics.detectors.audit.rows import (
    AREAS,
    AuditEvidence,
    Check,
    Checker,
    MoeSettings,
    TensorMoments,
)
from ckptforensics.detectors.base import Finding

__all__ = [
    "Check",
    "AuditEvidence",
    "TensorMoments",
    "MoeSettings",
    "CHECKS",
    "run_checks",
    "check_findings",
    "AREAS",
]
_SEV = {"critical": 0, "warning": 1, "info": 2}


CHECKS: tuple[Checker, ...] = (
    norm_placement, qk_norm, logit_control, tied_embeddings, embedding_scale,
    load_balancing, router_z_loss,
    fp16_loss_scaler, master_weights, loss_scale_history, router_precision,
    adam_epsilon, beta2, weight_decay, clipping, warmup,
    attention_logits, output_logits, activation_growth,
    grad_norm_logging, batch_log,
)  # fmt: skip


def run_checks(ev: AuditEvidence) -> list[Check]:
    """Every check, risks first by severity, then by area (AREAS order)."""
    rows = [r for c in CHECKS if (r := c(ev)) is not None]  # None: not this model's (MoE rows)
    order = {"risk": 0, "unknown": 1, "ok": 2}
    return sorted(
        rows,
        key=lambda r: (
            order[r.status],
            _SEV[r.severity] if r.status == "risk" else 3,
            AREAS.index(r.area),
        ),
    )


def check_findings(rows: list[Check]) -> list[Finding]:
    """One Finding per risk (ids assigned by the caller), for the verdict and --strict."""
    out = []
    for r in rows:
        if r.status != "risk":
            continue
        weight = {"critical": 10.0, "warning": 2.0, "info": 1.0}[r.severity]
        out.append(
            Finding(
                "",
                f"audit_{r.id}",
                r.subject,
                weight,
                r.severity,
                {"value": r.value, "threshold": r.threshold, "area": r.area},
                r.message,
                r.source,
                r.supports,
                primary=r.severity != "info",
            )
        )
    return out
