"""Mixture-of-Experts rows of the audit: what holds a router's logits and load in check.

Each row reads the run's recorded MoE settings (`AuditEvidence.moe`); a dense model has none
of these rows. The levels come from the MoE literature: Switch
Transformer's load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, §2.2: alpha 1e-2),
ST-MoE's router z-loss and selective precision (Zoph et al. 2022, arXiv 2202.08906, §3: 1e-3,
the router in fp32).
"""

from __future__ import annotations

from ckptforensics.detectors.audit.rows import AuditEvidence, Check, row

__all__ = ["router_z_loss", "load_balancing", "router_precision"]

_SWITCH = "Fedus et al. 2021 (Switch Transformer), arXiv 2101.03961, sec. 2.2"
_ST_MOE = "Zoph et al. 2022 (ST-MoE), arXiv 2202.08906, sec. 3"


def router_z_loss(ev: AuditEvidence) -> Check | None:
    """A router without a z-loss is free to grow its logits until its softmax is a hard pick
    (ST-MoE's instability, fixed by 1e-3 log^2 Z of the router logits)."""
    src = f"docs/signatures.md#audit-router-z-loss ({_ST_MOE})"
    m = ev.moe
    if m is None:
        return None  # a dense model: the row does not apply
    if m.z_loss:
        return row("router_z_loss", "architecture", "ok", m.z_loss, "> 0",
                   f"router z-loss {m.z_loss:g} ({m.z_loss_source})", src)  # fmt: skip
    return row(
        "router_z_loss", "architecture", "risk", 0.0, "> 0 (ST-MoE: 1e-3)",
        f"no router z-loss recorded for the {m.experts} experts' routers: nothing holds their logits down",
        src, "info", supports=("expert_collapse",),
        fix="add a router z-loss (ST-MoE: 1e-3 log^2 Z of the router logits; router_z_loss_coef, moe_z_loss_coeff)",
    )  # fmt: skip


def load_balancing(ev: AuditEvidence) -> Check | None:
    """Without the load-balancing loss in the optimised loss, nothing pulls a router back from
    sending most tokens to a few experts."""
    src = f"docs/signatures.md#audit-load-balancing ({_SWITCH})"
    m = ev.moe
    if m is None:
        return None  # a dense model: the row does not apply
    if m.aux_loss:
        return row("load_balancing", "architecture", "ok", m.aux_loss, "> 0",
                   f"load-balancing loss {m.aux_loss:g} ({m.aux_loss_source})", src)  # fmt: skip
    why = m.aux_loss_source or "no load-balancing coefficient recorded"
    return row(
        "load_balancing", "architecture", "risk", 0.0, "> 0 (Switch: 1e-2)",
        f"the load-balancing loss is not in the optimised loss ({why}): nothing keeps the {m.experts} experts' load even",
        src, "warning", supports=("expert_collapse",),
        fix="turn the load-balancing loss on at 1e-3..1e-2 (output_router_logits=True with router_aux_loss_coef; "
        "moe_aux_loss_coeff)",
    )  # fmt: skip


def router_precision(ev: AuditEvidence) -> Check | None:
    """A router computed in bf16/fp16 rounds its logits before the softmax and the top-k pick;
    ST-MoE computes the router in fp32 (selective precision)."""
    src = f"docs/signatures.md#audit-router-precision ({_ST_MOE})"
    m = ev.moe
    if m is None:
        return None  # a dense model: the row does not apply
    if m.router_dtype in ("fp32", "fp64") or ev.precision == "fp32":
        dtype = m.router_dtype or ev.precision
        return row("router_precision", "numerics", "ok", dtype, "fp32",
                   f"the routers compute in {dtype} ({m.router_dtype_source or ev.precision_source or 'the run precision'})",
                   src)  # fmt: skip
    return row(
        "router_precision", "numerics", "risk", ev.precision, "fp32",
        f"the run computes in {ev.precision} and records no fp32 router: the router logits round before the top-k pick "
        "unless the model casts them up",
        src, "info", supports=("expert_collapse",),
        fix="compute the router in fp32 (moe_router_dtype fp32; an upcast before the router's matmul)",
    )  # fmt: skip
