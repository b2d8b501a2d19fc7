"""Gather an audit's evidence from the run: the checkpoint and its optimizer state, the
configuration it recorded, the training log, and one traced forward (and backward) pass on
a batch of the run (random token ids where the run kept none).

Over 400 lines: one `gather` over every source the audit's rows read, its readers sharing
the open checkpoint and the recorded config.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptforensics.checkpoints import list_checkpoints, open_checkpoint
from ckptforensics.core.errors import ForensicsError
from ckptforensics.detectors.audit import AuditEvidence, MoeSettings, TensorMoments
from ckptforensics.detectors.audit.rows import BF16_HALF_ULP
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.conventions import (
    LabelError,
    call_model,
    detect_call,
    settle_labels,
)
from ckptforensics.engine.replay.model import build_model, load_weights
from ckptforensics.engine.replay.optimizer import build_optimizer
from ckptforensics.engine.replay.probes import param_grad_table
from ckptforensics.engine.replay.samples import per_token_loss
from ckptforensics.engine.trace import Architecture, trace_pass
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchError, BatchSource, open_batches
from ckptforensics.logs import find_metrics, log_dirs, param_grad_columns, read_metrics
from ckptforensics.trainers.settings import RunSettings, run_settings

__all__ = ["AuditConfig", "gather"]

log = logging.getLogger(__name__)
Progress = Callable[[str], None]

# Rows and tokens of the random batch traced when the run kept no batch: enough positions
# for every layer's attention to have several keys, few enough for any model.
_RANDOM_ROWS, _RANDOM_TOKENS = 2, 32


@dataclass(kw_only=True, slots=True)
class AuditConfig:
    """What to audit.

    Attributes:
        checkpoint: the checkpoint to audit.
        compare: an earlier checkpoint for the between-checkpoint rows (None: the one
            before `checkpoint` in `run_dir`, if any; `False`: none).
        run_dir: where the run wrote its checkpoints, log and batch log.
        model: `--model` (module:factory, file.py:factory, HF config dir); None: what the run recorded.
        batch: a batch log or batch file; None: discovered beside the checkpoints.
        metrics: the training log; None: discovered.
        device: 'cpu' or 'cuda' for the traced pass.
    """

    checkpoint: Path
    compare: Path | None | bool = None
    run_dir: Path | None = None
    model: str | None = None
    batch: str | None = None
    metrics: Path | None = None
    device: str = "cpu"


def gather(cfg: AuditConfig, a: Checkpoint, progress: Progress | None = None) -> AuditEvidence:
    """Read everything the checks need from the run; `a` is the opened checkpoint."""
    say = progress or (lambda _s: None)
    notes: list[str] = []
    run_dir = cfg.run_dir or cfg.checkpoint.parent
    mfile = cfg.metrics or next(
        (f for f in (find_metrics(d) for d in _near(run_dir, cfg.checkpoint)) if f is not None),
        None,
    )
    try:
        rows = read_metrics(mfile) if mfile is not None else {}
    except ForensicsError as e:  # an unreadable log takes its rows to unknown, not the audit down
        notes.append(f"training log not read: {e}")
        rows, mfile = {}, None
    say("batch")
    found = _batch(cfg, a, run_dir, notes)
    batch, batch_source = found.batch, found.source
    rs = run_settings(a, found.opened)
    arch = prev = None
    arch_note = None
    prev_step = None
    rms_t: dict[str, float] = {}
    to_ckpt: Callable[[str], str] = lambda k: k  # noqa: E731 - identity until the model is loaded
    say("model")
    try:
        model, _desc = build_model(cfg.model, a)
        to_ckpt = load_weights(model, a)
        model.to(cfg.device)
        batch = batch if batch is not None else _random_batch(model)
        batch = {k: v.to(cfg.device) for k, v in batch.items()}
        shifted, call = _convention(model, batch, found.shifted, notes)
        say("trace")
        arch, logits = trace_pass(model, batch, call)
        rms_t = _rms_t(model, a, to_ckpt, logits, batch, shifted, batch_source, notes)
        prev_path = earlier_checkpoint(cfg, a, run_dir)
        if prev_path is not None:
            say("earlier checkpoint")
            prev, prev_step = _trace_other(cfg, prev_path, batch, call, notes)
    except ForensicsError as e:
        arch_note = str(e)
        notes.append(f"model not built: {e}")
    except ValueError as e:  # the model's output has no logits with a graph
        arch_note = str(e)
        notes.append(f"no traced pass: {e}")
    names = _names(arch, to_ckpt, a)
    say("optimizer state")
    moments, decayed, betas, eps, lrs, moment_dtype, lost = _optimizer(a, names)
    precision, psrc, masters = _precision(a, rs)
    scaler = a.scalars.get("scaler") if isinstance(a.scalars.get("scaler"), dict) else {}
    interval = scaler.get("growth_interval", scaler.get("_growth_interval"))
    scales = tuple(
        (s, float(r["loss_scale"]))
        for s, r in sorted(rows.items())
        if "loss_scale" in r and math.isfinite(float(r["loss_scale"]))
    )
    clip, csrc = _clip(rs)
    warm, wsrc = _warmup(rs, rows)
    z, zsrc = _z_loss(rs.config)
    moe = _moe(rs.config)
    per_param = max((len(param_grad_columns(r)) for r in list(rows.values())[:50]), default=0)
    return AuditEvidence(
        step=a.step,
        arch=arch,
        arch_note=arch_note,
        prev=prev,
        prev_step=prev_step,
        batch_source=batch_source,
        precision=precision,
        precision_source=psrc,
        weight_dtype=_main_dtype(a),
        moment_dtype=moment_dtype,
        fp32_masters=masters,
        loss_scale=a.scalars.get("loss_scale"),
        growth_interval=int(interval) if isinstance(interval, (int, float)) else None,
        scales=scales,
        betas=betas,
        eps=eps,
        lr=lrs,
        moments=moments,
        rms_t=rms_t,
        decayed=decayed,
        norm_params=tuple(names.get("norm", ())),
        embedding_params=tuple(names.get("embedding", ())),
        bf16_lost=lost,
        clip=clip,
        clip_source=csrc,
        warmup=warm,
        warmup_source=wsrc,
        total_steps=rs.total_steps,
        tokens_per_step=found.tokens,
        z_loss=z,
        z_loss_source=zsrc,
        log_file=str(mfile) if mfile is not None else None,
        per_param_grad_columns=per_param,
        batch_log=found.log,
        moe=moe,
        notes=tuple(notes),
    )


def _near(run_dir: Path, ckpt: Path) -> list[Path]:
    """Where a run keeps its log and batch log: the run dir, the checkpoint's folder and the
    run's folders above it (`logs.log_dirs`: never the folder of other runs)."""

    out: list[Path] = []
    for d in (run_dir, *log_dirs(ckpt)):
        if d.is_dir() and d not in out:
            out.append(d)
    return out


# ---------------------------------------------------------------- the run's configuration
def _walk(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _walk(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, d


def _z_loss(rc: dict[str, Any]) -> tuple[float | None, str | None]:
    """A z-loss coefficient anywhere in the recorded configuration (PaLM's name, OLMo-core's
    `z_loss_multiplier`, the project's GPT's `z_loss`); a MoE router's z-loss is not this
    (transformers' `router_z_loss_coef`, Megatron's `moe_z_loss_coeff`: `_MOE_KEYS`)."""
    for key, v in _walk(rc):
        leaf = key.rsplit(".", 1)[-1].lower()
        if (
            "z_loss" in leaf
            and "router" not in key.lower()
            and leaf not in _MOE_KEYS["z"]
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and v > 0
        ):
            return float(v), key
    return None, None


# A Mixture-of-Experts model's routing settings under the names the frameworks record them:
# transformers' configs (Qwen3-MoE's num_experts, Mixtral's and gpt-oss's num_local_experts,
# DeepSeek's n_routed_experts; router_aux_loss_coef, added only with output_router_logits),
# Megatron's arguments (num_experts, moe_router_topk, moe_aux_loss_coeff, moe_z_loss_coeff,
# moe_router_dtype).
_MOE_KEYS = {
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_router_topk", "moe_top_k"),
    "aux": ("router_aux_loss_coef", "moe_aux_loss_coeff", "aux_loss_alpha"),
    "z": ("router_z_loss_coef", "moe_z_loss_coeff"),
    "dtype": ("moe_router_dtype", "router_dtype"),
}


def _moe(rc: dict[str, Any]) -> MoeSettings | None:
    """The routing settings of a MoE model in the recorded configuration; None for a dense one."""
    found: dict[str, tuple[Any, str]] = {}
    switch: tuple[Any, str] | None = None
    for key, v in _walk(rc):
        leaf = key.rsplit(".", 1)[-1]
        if leaf == "output_router_logits":
            switch = (v, key)
        for what, names in _MOE_KEYS.items():
            if leaf in names and what not in found and v is not None and not isinstance(v, bool):
                found[what] = (v, key)
    experts = found.get("experts", (None, ""))[0]
    if not isinstance(experts, int) or experts < 2:
        return None
    aux, aux_src = found.get("aux", (None, None))
    if switch is not None and switch[0] is False:
        aux, aux_src = 0.0, f"{switch[1]} is false: the model adds no load-balancing loss"
    z, z_src = found.get("z", (None, None))
    dtype, dtype_src = found.get("dtype", (None, None))
    top_k = found.get("top_k", (None, ""))[0]
    return MoeSettings(
        experts=experts,
        top_k=top_k if isinstance(top_k, int) else None,
        aux_loss=float(aux) if isinstance(aux, (int, float)) else None,
        aux_loss_source=aux_src,
        z_loss=float(z) if isinstance(z, (int, float)) and z > 0 else None,
        z_loss_source=z_src,
        router_dtype=str(dtype) if dtype else None,
        router_dtype_source=dtype_src,
    )


def _clip(rs: RunSettings) -> tuple[float | None, str | None]:
    """The clip as the audit's rows take it: 0 where clipping is off, None where not recorded."""
    if rs.clip_source is None:
        return None, None
    return (rs.clip if rs.clip is not None else 0.0), rs.clip_source


def _warmup(rs: RunSettings, rows: dict[int, dict[str, float]]) -> tuple[int | None, str | None]:
    """The recorded warm-up, else the log's: steps until the LR first reaches its peak."""
    if rs.warmup is not None:
        return rs.warmup, rs.warmup_source
    lrs = sorted((s, r["lr"]) for s, r in rows.items() if "lr" in r and math.isfinite(r["lr"]))
    if len(lrs) >= 3 and lrs[0][0] <= 1:
        top = max(v for _, v in lrs)
        peak = next(s for s, v in lrs if v >= 0.99 * top)
        return int(peak - lrs[0][0]), "the log's LR (steps until it first reaches its peak)"
    return None, None


def _precision(a: Checkpoint, rs: RunSettings) -> tuple[str, str, bool]:
    """The precision the run trained in and whether it keeps fp32 master weights, from what
    it recorded (`replay.precision`: its scaler, its config's flags, then the weights'
    dtypes; a trainer's configuration file, `trainers.settings`, besides)."""

    prec, src = mp.resolve("auto", a)
    masters = prec == "bf16-params" or bool(a.scalars.get("fp32_masters"))
    if prec == "bf16-params":
        return "bf16", src, masters
    if prec == "fp32" and rs.precision is not None:
        return rs.precision, str(rs.precision_source), masters
    if prec == "fp32" and _main_dtype(a) == "float16":  # fp16 parameters: trained in fp16 itself
        return "fp16", "float16 weights in the checkpoint", masters
    return prec, src, masters


def _main_dtype(a: Checkpoint) -> str:
    counts: Counter[str] = Counter()
    for n in a.names():
        m = a.meta(n)
        if m.dtype.is_floating_point:
            counts[str(m.dtype).replace("torch.", "")] += m.numel
    return counts.most_common(1)[0][0] if counts else "float32"


# ---------------------------------------------------------------- batch
@dataclass(frozen=True, slots=True)
class _Batch:
    """The batch the audit traces and where it comes from.

    Attributes:
        batch: its tensors (None: random token ids are traced).
        source: where it comes from, in words.
        log: the batch log's path, where one was found.
        tokens: its token count (nan: random ids).
        shifted: its labels' declared convention.
        opened: the batch log, where it was read (its recorded settings: the clip).
    """

    batch: dict[str, torch.Tensor] | None
    source: str
    log: str | None = None
    tokens: float = math.nan
    shifted: bool | None = None
    opened: BatchSource | None = None


def _batch(cfg: AuditConfig, a: Checkpoint, run_dir: Path, notes: list[str]) -> _Batch:
    """The batch to trace: the run's next batch after the checkpoint where a batch log has it."""

    spec = cfg.batch
    found = None
    if spec is None:
        for d in _near(run_dir, cfg.checkpoint):
            for cand in (d / "batches.h5", d / "flight"):
                if cand.exists():
                    found = cand
                    break
            if found is not None:
                break
        spec = str(found) if found is not None else None
    if spec is None:
        return _Batch(None, "random token ids (no batch log found)")
    try:
        src = open_batches(spec)
    except (BatchError, ForensicsError) as e:
        notes.append(f"batch log not read: {e}")
        return _Batch(None, "random token ids (the batch log could not be read)", spec)
    if src.ids_only:
        notes.append(f"{spec} keeps sample ids, not tokens")
        return _Batch(
            None, "random token ids (the batch log keeps sample ids only)", spec, opened=src
        )
    step = a.step or 0
    steps = src.steps
    pick = (
        step + 1
        if steps is None or step + 1 in steps
        else (
            min((s for s in steps if s > step), default=None)
            or max((s for s in steps if s <= step), default=None)
        )
    )
    if pick is None:
        return _Batch(None, "random token ids (the batch log has no step)", spec, opened=src)
    try:
        b = src.batch(pick)
    except (BatchError, ForensicsError) as e:
        notes.append(str(e))
        return _Batch(None, "random token ids (the batch could not be read)", spec, opened=src)
    batch = {k: v for k, v in b.items() if k in ("input_ids", "attention_mask", "labels")}
    return _Batch(
        batch,
        f"the batch of step {pick} ({src.describe})",
        spec,
        float(batch["input_ids"].numel()),
        src.labels_shifted,
        src,
    )


def _convention(
    model: nn.Module, batch: dict[str, torch.Tensor], declared: bool | None, notes: list[str]
) -> tuple[bool, Callable[[nn.Module, dict[str, torch.Tensor]], Any]]:
    """The batch's label convention (measured from the data) and how the run's trainer calls
    the model (`replay.conventions`), so that the traced pass gives every position's logits."""

    try:
        shifted = settle_labels([batch], declared).shifted
    except LabelError as e:
        notes.append(f"label convention not settled ({e}); the inputs taken as the targets")
        shifted = False
    with torch.no_grad():
        conv = detect_call(model, batch, shifted)
    return shifted, lambda m, b: call_model(m, conv, b, shifted)


def _random_batch(model: nn.Module) -> dict[str, torch.Tensor]:
    """Seeded random ids within every embedding table (token and position)."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = min(sizes) if sizes else 2
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(
            0, vocab, (_RANDOM_ROWS, min(_RANDOM_TOKENS, vocab)), generator=g
        )
    }


# ---------------------------------------------------------------- gradient and state
def _rms_t(
    model: nn.Module,
    a: Checkpoint,
    to_ckpt: Callable[[str], str],
    logits: torch.Tensor,
    batch: dict[str, torch.Tensor],
    shifted: bool,
    source: str,
    notes: list[str],
) -> dict[str, float]:
    """RMS_t = sqrt(mean(g^2 / v_hat)) per tensor, the gradient of the causal-LM loss on the
    traced batch (a real batch only: random tokens say nothing about v)."""
    if source.startswith("random") or a.optimizer is None or a.optimizer.kind != "adam":
        return {}

    try:
        opt = build_optimizer(model, a, to_ckpt)
    except ForensicsError as e:
        notes.append(f"RMS_t not measured: {e}")
        return {}
    labels = batch.get("labels", batch["input_ids"])
    loss = per_token_loss(logits, labels, batch.get("attention_mask"), shifted=shifted).mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    with_grad = [
        (n, p) for n, p in model.named_parameters() if p.grad is not None and opt.state.get(p)
    ]
    if not with_grad:
        return {}
    table = (
        param_grad_table(
            [p.grad for _, p in with_grad],
            [opt.state[p] for _, p in with_grad],
            [group[id(p)] for _, p in with_grad],
        )
        .cpu()
        .tolist()
    )
    model.zero_grad(set_to_none=True)
    return {
        to_ckpt(n): row[1]
        for (n, _), row in zip(with_grad, table, strict=True)
        if math.isfinite(row[1])
    }


def _names(
    arch: Architecture | None, to_ckpt: Callable[[str], str], a: Checkpoint
) -> dict[str, list[str]]:
    """The trace's norm and embedding parameters under their checkpoint names."""
    if arch is None:
        return {}

    def ck(n: str) -> str:
        c = to_ckpt(n)
        return a.aliases.get(c, c)

    return {
        "norm": sorted({ck(n) for n in arch.norm_params}),
        "embedding": sorted({ck(n) for n in arch.embedding_params}),
    }


def _optimizer(
    a: Checkpoint, names: dict[str, list[str]]
) -> tuple[
    tuple[TensorMoments, ...],
    dict[str, float],
    tuple[float, float] | None,
    float | None,
    tuple[float, ...],
    str | None,
    float,
]:
    """Per tensor: the share of sqrt(v_hat) < eps; every parameter's weight decay; Adam's
    betas and eps; the LRs; the moments' dtype; the share of bf16 weight elements whose
    LR-sized update rounds away. One tensor and its state in memory at a time."""

    opt = a.optimizer
    if opt is None:
        return (), {}, None, None, (), None, math.nan
    emb, norm = set(names.get("embedding", ())), set(names.get("norm", ()))
    decayed = {n: h.weight_decay for n, h in opt.hyper.items()}
    g0 = opt.groups[0] if opt.groups else None
    betas = g0.betas if g0 is not None and g0.betas is not None else None
    eps = g0.eps if g0 is not None else None
    moments = []
    moment_dtype = None
    lost_n, lost_tot = 0, 0
    for name in a.names():
        h = opt.hyper.get(name)
        st = a.optim_state(name)
        if h is not None and a.meta(name).dtype == torch.bfloat16:
            w = a.tensor(name).float().abs()
            lost_n += int((w * BF16_HALF_ULP > h.lr).sum())
            lost_tot += w.numel()
        if opt.kind != "adam" or not st or "exp_avg_sq" not in st or h is None or h.betas is None:
            continue
        v = st["exp_avg_sq"]
        moment_dtype = moment_dtype or str(v.dtype).replace("torch.", "")
        t = float(st.get("step", 0) or 0)
        if t <= 0:
            continue
        # Elements that never had a gradient (v exactly 0: a key bias the softmax cancels)
        # take no update at all; the eps-dominated ones had one, and a burst finds them.
        root = (v.float() / (1.0 - h.betas[1] ** t)).sqrt()
        share = float(((root < h.eps) & (root > 0)).float().mean())
        role = "embedding" if name in emb else "norm" if name in norm else "weight"
        moments.append(TensorMoments(name, v.numel(), share, role))
        a.forget(name)
    lrs = tuple(g.lr for g in opt.groups)
    return (
        tuple(moments),
        decayed,
        betas,
        eps,
        lrs,
        moment_dtype,
        (lost_n / lost_tot if lost_tot else math.nan),
    )


# ---------------------------------------------------------------- the earlier checkpoint
def earlier_checkpoint(cfg: AuditConfig, a: Checkpoint, run_dir: Path) -> Path | None:
    if cfg.compare is False:
        return None
    if isinstance(cfg.compare, Path):
        return cfg.compare
    before = [p for s, p in list_checkpoints(run_dir) if a.step is not None and s < a.step]
    return before[-1] if before else None


def _trace_other(
    cfg: AuditConfig, path: Path, batch: dict[str, torch.Tensor], call: Any, notes: list[str]
) -> tuple[Architecture | None, int | None]:
    """The earlier checkpoint's trace on the same batch (the between-checkpoint rows)."""

    try:
        with open_checkpoint(path) as b:
            model, _ = build_model(cfg.model, b)
            load_weights(model, b)
            model.to(cfg.device)
            return trace_pass(model, batch, call)[0], b.step
    except (ForensicsError, ValueError) as e:
        notes.append(f"earlier checkpoint {path} not traced: {e}")
        return None, None
