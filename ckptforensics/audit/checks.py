"""The audit's checks: pure functions from a run's evidence to one row each, with the
figure measured, the level it is judged against and where that level comes from.

A row is `ok`, a `risk` (with a severity and the causes it leads to), or `unknown` (the run
did not record what the check needs: the row says what would). Nothing here opens a file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..detectors.base import Finding
from ..tensors import robust_z
from .trace import Architecture

__all__ = [
    "Check",
    "AuditEvidence",
    "TensorMoments",
    "CHECKS",
    "run_checks",
    "check_findings",
    "AREAS",
]

AREAS = ("architecture", "numerics", "optimizer", "headroom", "observability")
_SEV = {"critical": 0, "warning": 1, "info": 2}

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
    notes: tuple[str, ...] = ()


Checker = Callable[[AuditEvidence], Check]


def _row(
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


def _no_model(ev: AuditEvidence, id: str, area: str, source: str) -> Check:
    return _row(
        id,
        area,
        "unknown",
        None,
        None,
        f"not checked: {ev.arch_note or 'the model could not be built'}",
        source,
    )


# ---------------------------------------------------------------- architecture
def norm_placement(ev: AuditEvidence) -> Check:
    """Post-LN (or no norm) puts the residual stream itself through every norm: large
    gradients near the output at initialisation, divergence without a long warm-up."""
    paper = "Xiong et al. 2020, arXiv 2002.04745; Liu et al. 2020, arXiv 2004.08249"
    if ev.arch is None:
        return _no_model(
            ev,
            "norm_placement",
            "architecture",
            f"docs/signatures.md#audit-norm-placement ({paper})",
        )
    p = ev.arch.norm_placement
    per = {x.module: x.placement for x in ev.arch.layers}
    src = f"docs/signatures.md#audit-norm-placement ({paper})"
    if p in ("pre", "reordered", "sandwich"):
        return _row(
            "norm_placement",
            "architecture",
            "ok",
            p,
            "pre, reordered or sandwich",
            f"norm placement {p} in all {len(per)} attention layers",
            src,
        )
    if p in ("post", "none"):
        what = (
            "post-LN: the residual stream is normalised after every add"
            if p == "post"
            else "no norm found around the attention layers"
        )
        return _row(
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
    return _row(
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
        return _no_model(
            ev, "qk_norm", "architecture", f"docs/signatures.md#audit-qk-norm ({paper})"
        )
    src = f"docs/signatures.md#audit-qk-norm ({paper})"
    layers = ev.arch.layers
    if not layers:
        return _row(
            "qk_norm",
            "architecture",
            "unknown",
            None,
            True,
            "no attention call was seen in the forward pass",
            src,
        )
    if ev.arch.qk_norm:
        return _row(
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
        return _row(
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
    return _row(
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
        return _row(
            "logit_control",
            "architecture",
            "ok",
            f"z-loss {ev.z_loss:g}",
            "z-loss or soft-cap",
            f"z-loss {ev.z_loss:g} ({ev.z_loss_source})",
            src,
        )
    if ev.arch is not None and ev.arch.final_softcap:
        return _row(
            "logit_control",
            "architecture",
            "ok",
            "final soft-cap",
            "z-loss or soft-cap",
            "the head's logits pass a tanh soft-cap",
            src,
        )
    if ev.arch is None:
        return _no_model(
            ev, "logit_control", "architecture", f"docs/signatures.md#audit-logit-control ({paper})"
        )
    lz = ev.arch.log_z
    hot = math.isfinite(lz) and abs(lz) > FINAL_LOGIT_CAP
    return _row(
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
        return _no_model(
            ev,
            "tied_embeddings",
            "architecture",
            f"docs/signatures.md#audit-tied-embeddings ({paper})",
        )
    t = ev.arch.tied_embeddings
    return _row(
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
        return _no_model(
            ev,
            "embedding_scale",
            "architecture",
            f"docs/signatures.md#audit-embedding-scale ({paper})",
        )
    r = ev.arch.embed_rms
    src = f"docs/signatures.md#audit-embedding-scale ({paper})"
    if not math.isfinite(r):
        return _row(
            "embedding_scale",
            "architecture",
            "unknown",
            None,
            EMBED_RMS_MIN,
            "the stream entering the first attention layer was not found",
            src,
        )
    if ev.arch.norm_placement == "post":
        return _row(
            "embedding_scale",
            "architecture",
            "ok",
            r,
            EMBED_RMS_MIN,
            f"embedding output RMS {r:.3g}; post-LN normalises the stream after every add",
            src,
        )
    if r >= EMBED_RMS_MIN:
        return _row(
            "embedding_scale",
            "architecture",
            "ok",
            r,
            EMBED_RMS_MIN,
            f"the stream enters the first layer at RMS {r:.3g}",
            src,
        )
    return _row(
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


# ---------------------------------------------------------------- numerics
def fp16_loss_scaler(ev: AuditEvidence) -> Check:
    """fp16 gradients underflow without a loss scale (and overflow past 65504)."""
    src = "docs/signatures.md#audit-fp16-loss-scaler (Micikevicius et al. 2018, Mixed Precision Training, arXiv 1710.03740, sec. 3.2)"
    if ev.precision != "fp16":
        return _row(
            "fp16_loss_scaler",
            "numerics",
            "ok",
            ev.precision,
            None,
            f"{ev.precision} training ({ev.precision_source}): no loss scale needed",
            src,
        )
    if ev.loss_scale is None and not ev.scales:
        return _row(
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
        return _row(
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
    return _row(
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
        return _row(
            "master_weights",
            "numerics",
            "ok",
            "fp32 masters",
            None,
            f"bf16 weights over fp32 master weights ({ev.precision_source})",
            src,
        )
    if ev.weight_dtype != "bfloat16":
        return _row(
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
        return _row(
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
        return _row(
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
    return _row(
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
        return _row(
            "loss_scale_history",
            "numerics",
            "ok",
            None,
            None,
            f"{ev.precision} training: no loss scale to back off",
            src,
        )
    if len(ev.scales) < 2:
        return _row(
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
        return _row(
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
    return _row(
        "loss_scale_history",
        "numerics",
        "ok",
        rate,
        limit,
        f"{backoffs} backoffs over {span} logged steps ({rate:.3g} per 1k)",
        src,
    )


# ---------------------------------------------------------------- optimizer
def adam_epsilon(ev: AuditEvidence) -> Check:
    """Tensors whose second moment fell below eps^2 for most elements: Adam's update there
    is m / eps, not normalised."""
    src = "docs/signatures.md#audit-adam-epsilon (Molybog et al. 2023, arXiv 2304.09871)"
    if not ev.moments or ev.eps is None:
        return _row(
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
        return _row(
            "adam_epsilon",
            "optimizer",
            "ok",
            value,
            EPS_SHARE,
            f"{share:.1%} of moment elements have sqrt(v_hat) < eps {ev.eps:g}; no tensor is mostly there",
            src,
        )
    lead = (weights or hit)[0]
    return _row(
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
        return _row(
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
        return _row(
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
        return _row(
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
    return _row(
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
        return _row(
            "weight_decay",
            "optimizer",
            "unknown",
            None,
            0.0,
            "no optimizer param groups in the checkpoint",
            src,
        )
    if ev.arch is None:
        return _row(
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
        return _row(
            "weight_decay",
            "optimizer",
            "ok",
            {},
            0.0,
            "no weight decay on norm gains or embeddings",
            src,
        )
    emb = [n for n in hit if n in ev.embedding_params]
    return _row(
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
        return _row(
            "clipping",
            "optimizer",
            "unknown",
            None,
            None,
            "the run recorded no gradient-clipping setting",
            src,
        )
    if not ev.clip:
        return _row(
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
    return _row(
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
        return _row(
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
        return _row(
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
    return _row(
        "warmup",
        "optimizer",
        "ok",
        value,
        need,
        f"warm-up of {ev.warmup} steps{frac} ({ev.warmup_source}) >= 2/(1-beta2) = {need:.0f}",
        src,
    )


# ---------------------------------------------------------------- headroom
def attention_logits(ev: AuditEvidence) -> Check:
    """The largest pre-softmax attention logit per layer on the traced batch."""
    paper = "Gemma 2 caps at 50, arXiv 2408.00118; Dehghani et al. 2023; Zhai et al. 2023, arXiv 2303.06296"
    if ev.arch is None:
        return _no_model(
            ev,
            "attention_logits",
            "headroom",
            f"docs/signatures.md#audit-attention-logits ({paper})",
        )
    src = f"docs/signatures.md#audit-attention-logits ({paper})"
    layers = [x for x in ev.arch.layers if math.isfinite(x.max_logit)]
    if not layers:
        return _row(
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
        return _row(
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
    return _row(
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
        return _no_model(
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
        return _row(
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
        return _row(
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
    return _row(
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
        return _row(
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
        return _row(
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
        return _row(
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
    return _row(
        "activation_growth",
        "headroom",
        "ok",
        value,
        GROWTH_LIMIT,
        f"residual stream growth since step {ev.prev_step} at most {vals[i]:.3g}x ({names[i]})",
        src,
    )


# ---------------------------------------------------------------- observability
_RECORDER = (
    "attach ckptforensics' flight recorder: `from ckptforensics.record import Recorder; rec = Recorder('runs/x/flight', "
    "checkpoint_every=N)` and call rec.on_batch / after_backward / after_step / on_checkpoint in the loop "
    "(transformers: `ckptforensics.record.hf.hf_callback`, Lightning: `ckptforensics.record.lightning.lightning_callback`)"
)


def grad_norm_logging(ev: AuditEvidence) -> Check:
    """Per-layer gradient norms in the log: what locates the layer a spike starts in."""
    src = "docs/signatures.md#audit-grad-norm-logging (OLMo-core logs optim/grad/<param>.norm; Megatron --log-params-norm)"
    if ev.log_file is None:
        return _row(
            "grad_norm_logging",
            "observability",
            "risk",
            0,
            None,
            "no training log found",
            src,
            "info",
            fix=_RECORDER,
        )
    if ev.per_param_grad_columns:
        return _row(
            "grad_norm_logging",
            "observability",
            "ok",
            ev.per_param_grad_columns,
            None,
            f"{ev.per_param_grad_columns} per-parameter gradient-norm columns in {ev.log_file}",
            src,
        )
    return _row(
        "grad_norm_logging",
        "observability",
        "risk",
        0,
        None,
        f"{ev.log_file} has no per-layer gradient norms",
        src,
        "info",
        fix=_RECORDER,
    )


def batch_log(ev: AuditEvidence) -> Check:
    """A batch log makes the next incident replayable step by step."""
    src = "docs/signatures.md#audit-batch-log (PaLM's replay of a spike from the batches around it, arXiv 2204.02311, sec. 5.1)"
    if ev.batch_log:
        return _row(
            "batch_log", "observability", "ok", ev.batch_log, None, f"batch log {ev.batch_log}", src
        )
    return _row(
        "batch_log",
        "observability",
        "risk",
        None,
        None,
        "no batch log next to the checkpoints: a spike's batches cannot be replayed",
        src,
        "info",
        fix=_RECORDER,
    )


CHECKS: tuple[Checker, ...] = (
    norm_placement, qk_norm, logit_control, tied_embeddings, embedding_scale,
    fp16_loss_scaler, master_weights, loss_scale_history,
    adam_epsilon, beta2, weight_decay, clipping, warmup,
    attention_logits, output_logits, activation_growth,
    grad_norm_logging, batch_log,
)  # fmt: skip


def run_checks(ev: AuditEvidence) -> list[Check]:
    """Every check, risks first by severity, then by area (AREAS order)."""
    rows = [c(ev) for c in CHECKS]
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
