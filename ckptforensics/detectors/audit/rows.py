"""What every audit check shares: the row it returns (`Check`), the evidence it reads
(`AuditEvidence`), the danger levels it judges by (each with its source), and the helpers
that make a row."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.engine.trace import Architecture

__all__ = [
    "AREAS",
    "ATTN_LOGIT_CAP",
    "BF16_HALF_ULP",
    "EMBED_RMS_MIN",
    "EPS_SHARE",
    "FINAL_LOGIT_CAP",
    "GROWTH_INTERVAL",
    "GROWTH_LIMIT",
    "GROWTH_Z",
    "RMS_T_LIMIT",
    "AuditEvidence",
    "Check",
    "Checker",
    "TensorMoments",
    "no_model",
    "row",
]

AREAS = ("architecture", "numerics", "optimizer", "headroom", "observability")

# Danger levels (the audit rows of docs/signatures.md), each with its source.
# Gemma 2 soft-caps attention logits at 50 and final logits at 30 (Gemma Team 2024,
# arXiv 2408.00118, sec. 2): levels a production model does not let a logit pass.
ATTN_LOGIT_CAP = 50.0
FINAL_LOGIT_CAP = 30.0
# Takase et al. 2023 ("Spike No More", arXiv 2312.16903, sec. 3-4): a pre-LN stack is stable
# when the shortcut is large: embeddings with a standard deviation close to 1 (scaled or
# LayerNorm'd embeddings); the 0.02 of a plain initialisation breaks the condition. A
# stream an order of magnitude below 1 counts.
EMBED_RMS_MIN = 0.1
# An Adam moment is epsilon-dominated where sqrt(v_hat) < eps: the update is m / eps, no
# longer normalised (Molybog et al. 2023, arXiv 2304.09871, sec. 4-5). A tensor counts when
# most of its elements are.
EPS_SHARE = 0.5
# StableAdamW (Wortsman et al. 2023, arXiv 2304.13013, sec. 3.4): loss spikes follow
# RMS_t = sqrt(mean(g^2 / v_hat)) > 1, the second moment out of date (beta2 too slow for how
# fast this tensor's gradient moves).
RMS_T_LIMIT = 1.0
# A layer's residual stream grew this much between two checkpoints and stands out of the
# other layers' growth (robust z > 6, log scale, OLMo-core's 6 sigma): the growth of linear
# outputs that precedes divergence at high LR (Rybakov et al. 2024, arXiv 2410.16682, sec. 3;
# Wortsman et al. 2023, arXiv 2309.14322, sec. 3.4).
GROWTH_LIMIT = 2.0
GROWTH_Z = 6.0
# bf16 keeps 8 significant bits (Kalamkar et al. 2019, arXiv 1905.12322): an update smaller
# than half the spacing at a weight, |w| 2^-9, rounds away. A pure-bf16 run whose LR is below
# that for most weights stops learning them (Zamirai et al. 2020, arXiv 2010.06192).
BF16_HALF_ULP = 2.0**-9
# torch.amp.GradScaler doubles the scale after growth_interval (2000) clean steps and halves
# it on an overflow: one halving per interval is its equilibrium; more, and the scale falls.
GROWTH_INTERVAL = 2000


@dataclass(frozen=True, slots=True)
class Check:
    """One audit row.

    Attributes:
        id: the check ("norm_placement", "qk_norm", ...; its row in docs/signatures.md is audit-<id>).
        area: 'architecture', 'numerics', 'optimizer', 'headroom' or 'observability'.
        status: 'ok', 'risk' or 'unknown'.
        severity: 'info', 'warning' or 'critical' (a risk's weight; 'info' otherwise).
        value: the figure measured (the check's own units, said in `message`).
        threshold: the level it is judged against (None for a yes/no).
        message: one sentence for people.
        source: the docs/signatures.md row and the paper or code behind the level.
        supports: causes this risk leads to (the verdict's vocabulary).
        fix: what to change, in the trainer's terms.
        subject: the module or tensor the row is about ('run' for the whole run).
    """

    id: str
    area: str
    status: str
    severity: str
    value: Any
    threshold: Any
    message: str
    source: str
    supports: tuple[str, ...] = ()
    fix: str | None = None
    subject: str = "run"

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class TensorMoments:
    """Adam's second moment of one tensor, summarised.

    Attributes:
        name: checkpoint tensor name.
        numel: elements.
        eps_share: share of elements with 0 < sqrt(v_hat) < eps (an element whose v is exactly
            0 never had a gradient and takes no update).
        role: 'embedding', 'norm' or 'weight'.
    """

    name: str
    numel: int
    eps_share: float
    role: str


@dataclass(frozen=True, slots=True)
class MoeSettings:
    """A Mixture-of-Experts model's routing settings as the run recorded them.

    Attributes:
        experts: experts per MoE layer; top_k: the experts each token goes to.
        aux_loss: the load-balancing loss coefficient in the optimised loss (0: recorded as
            off, e.g. transformers' `output_router_logits` false), with `aux_loss_source`.
        z_loss: the router z-loss coefficient (None: none recorded), `z_loss_source`.
        router_dtype: the dtype the routers compute in where recorded ('fp32'), its source.
    """

    experts: int
    top_k: int | None = None
    aux_loss: float | None = None
    aux_loss_source: str | None = None
    z_loss: float | None = None
    z_loss_source: str | None = None
    router_dtype: str | None = None
    router_dtype_source: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditEvidence:
    """What the audit gathered from the run (`audit.evidence.gather`).

    Attributes:
        step: the audited checkpoint's step.
        arch: the traced architecture (None: the model could not be built; `arch_note` why).
        prev: the same trace of the earlier checkpoint, on the same batch (None: no pair).
        prev_step: that checkpoint's step.
        batch_source: where the traced batch came from ('random token ids' when no batch was found).
        precision: 'fp32', 'bf16' or 'fp16', with `precision_source`.
        weight_dtype: the dtype holding most of the weights' elements.
        moment_dtype: the dtype of Adam's moments (None: no optimizer state).
        fp32_masters: the run keeps fp32 master weights beside its bf16 ones (the optimizer
            state holds them, or its config says so: Megatron / DeepSpeed bf16).
        loss_scale: the scaler's current scale (None: no scaler).
        growth_interval: the scaler's growth interval when recorded.
        scales: (step, loss scale) from the training log.
        betas, eps: Adam's, of the first param group (None: no Adam state).
        lr: the current LR of each param group.
        moments: per tensor epsilon-domination (empty: no Adam state).
        rms_t: tensor -> RMS_t on the traced batch's gradient (empty: none measured).
        decayed: parameter -> weight decay of its group (checkpoint names).
        norm_params, embedding_params: checkpoint names of the trace's norms and embeddings.
        bf16_lost: share of bf16 weight elements whose LR-sized update rounds away (NaN: n/a).
        clip: the clip norm the run recorded (0: none), with `clip_source` (None: not recorded).
        warmup: warm-up steps, with `warmup_source` (None: not found).
        total_steps: the schedule's length when recorded.
        tokens_per_step: tokens of the traced batch (NaN: not known).
        z_loss: the z-loss coefficient the run recorded (None: none found), `z_loss_source`.
        log_file: the training log read (None: none), `log_columns` its columns.
        per_param_grad_columns: per-parameter gradient-norm columns in the log.
        batch_log: the batch log found (None: none).
        moe: the routing settings of a Mixture-of-Experts model (None: dense).
        notes: what could not be read.
    """

    step: int | None
    arch: Architecture | None
    arch_note: str | None = None
    prev: Architecture | None = None
    prev_step: int | None = None
    batch_source: str | None = None
    precision: str = "fp32"
    precision_source: str = ""
    weight_dtype: str = "float32"
    moment_dtype: str | None = None
    fp32_masters: bool = False
    loss_scale: float | None = None
    growth_interval: int | None = None
    scales: tuple[tuple[int, float], ...] = ()
    betas: tuple[float, float] | None = None
    eps: float | None = None
    lr: tuple[float, ...] = ()
    moments: tuple[TensorMoments, ...] = ()
    rms_t: dict[str, float] = field(default_factory=dict)
    decayed: dict[str, float] = field(default_factory=dict)
    norm_params: tuple[str, ...] = ()
    embedding_params: tuple[str, ...] = ()
    bf16_lost: float = math.nan
    clip: float | None = None
    clip_source: str | None = None
    warmup: int | None = None
    warmup_source: str | None = None
    total_steps: int | None = None
    tokens_per_step: float = math.nan
    z_loss: float | None = None
    z_loss_source: str | None = None
    log_file: str | None = None
    per_param_grad_columns: int = 0
    batch_log: str | None = None
    moe: MoeSettings | None = None
    notes: tuple[str, ...] = ()


# A check: its row, or None where it does not apply to the model (a dense model's MoE rows).
Checker = Callable[[AuditEvidence], "Check | None"]


def row(
    id: str,
    area: str,
    status: str,
    value: Any,
    threshold: Any,
    message: str,
    source: str,
    severity: str = "info",
    **kw: Any,
) -> Check:
    return Check(
        id,
        area,
        status,
        severity if status == "risk" else "info",
        value,
        threshold,
        message,
        source,
        **kw,
    )


def no_model(ev: AuditEvidence, id: str, area: str, source: str) -> Check:
    return row(
        id,
        area,
        "unknown",
        None,
        None,
        f"not checked: {ev.arch_note or 'the model could not be built'}",
        source,
    )
