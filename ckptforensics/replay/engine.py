"""Replay the window's steps from the *before* state with probes, and compare with *after*."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ForensicsError, doing
from ..formats import bnb, open_checkpoint, open_pair
from ..formats.base import Checkpoint
from ..logs import group_lrs, read_metrics
from ..options import ReplayOptions
from ..tensors import LR_GROWTH_MARGIN, adam_ratio_bound
from ..updates import replay_bound
from . import distributed, skipstep
from . import precision as mp
from .batches import BatchSource, open_batches
from .conventions import CallConvention, LabelConvention, call_model, detect_call, settle_labels
from .logcheck import GRAD_RTOL, LOSS_RTOL, LogCheck, StepCheck, check_against_log, log_rounding
from .model import (
    LossNorm,
    build_model,
    build_optimizer,
    load_callable,
    load_weights,
    padding_rows_trained,
    trainer_loss_norm,
)
from .probes import ModuleProbe, PassStats, param_grad_stats, param_grad_sums
from .samples import PerSampleGrad, RowStats, per_token_loss, row_data_stats

__all__ = ["ReplayConfig", "StepRecord", "TensorMatch", "ReplayResult", "Plan", "Session", "plan", "replay"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class ReplayConfig(ReplayOptions):
    """What to replay (the window) and how (`options.ReplayOptions`, every field of which
    is a keyword here too).

    Attributes:
        before, after: checkpoint paths (after optional: then one step is replayed).
        batch: batch file, batch log (.h5) or `module:function`; None with `data`.
        step: the step to replay when there is no *after*.
    """

    before: Path
    after: Path | None = None
    batch: str | None = None
    step: int | None = None


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One replayed step: loss, pre-clip grad norm, whether the optimizer skipped it."""

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    lr: tuple[float, ...]
    loss_scale: float | None
    sample_loss: tuple[float, ...]
    sample_grad_sq: tuple[float, ...] | None
    sample_ids: tuple[int, ...] | None
    param_grad_nonfinite: tuple[str, ...]
    param_grad_rms: dict[str, float] = field(default_factory=dict)  # checkpoint name -> RMS of its gradient
    # RMS_t = sqrt(mean(g^2 / v_hat)) against the second moment before this step
    # (StableAdamW, Wortsman 2304.13013), and elements with g^2 > 5000 v (SPAM 2501.06842).
    param_rms_t: dict[str, float] = field(default_factory=dict)
    param_spikes: dict[str, int] = field(default_factory=dict)
    logit_absmax: float = math.nan  # max |logit| of the step's batch
    skipped_by: str = ""  # who skipped the update: "loss scaler", "optimizer rule" (SkipStepAdamW), "mitigation"
    log_z: float = math.nan  # mean logsumexp of the logits (softmax normaliser, nats)
    sample_tokens: tuple[int, ...] = ()  # target tokens of each row (weights of its mean loss)


@dataclass(frozen=True, slots=True)
class _Grads:
    """One step's gradient evidence, merged over the ranks: the step's loss, the pre-clip
    total norm, parameters (model names) with non-finite gradients, per parameter RMS /
    RMS_t / spikes (checkpoint names), per row loss and gradient norm^2, logit stats."""

    loss: float
    total: float
    nonfinite: tuple[str, ...]
    rms: dict[str, float]
    rms_t: dict[str, float]
    spikes: dict[str, int]
    sample_loss: tuple[float, ...]
    sample_grad_sq: tuple[float, ...] | None
    logit_absmax: float
    log_z: float
    sample_tokens: tuple[int, ...] = ()


def _local(t: Any) -> Any:
    """A rank's shard of a DTensor (FSDP2 parameter, gradient or moment); others as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _local_state(state: dict | None) -> dict:
    return {k: _local(v) for k, v in (state or {}).items()}


@dataclass(frozen=True, slots=True)
class TensorMatch:
    """Replayed vs *after* for one tensor: max |difference|, elements past tolerance and past the bound."""

    name: str
    where: str
    max_abs_diff: float
    mismatched: int
    numel: int
    tolerance: float
    impossible: int = 0  # elements further from *after* than any Adam step allows
    worst: float = 0.0  # the largest |difference| / tolerance of an element (< 1: every element within)


@dataclass(slots=True)
class ReplayResult:
    """Everything the replay measured; detectors turn it into findings."""

    config: dict[str, dict[str, Any]]
    precision: str
    records: list[StepRecord] = field(default_factory=list)
    passes: dict[int, PassStats] = field(default_factory=dict)
    fp32_passes: dict[int, PassStats] = field(default_factory=dict)
    row_stats: dict[int, list[RowStats]] = field(default_factory=dict)
    matches: list[TensorMatch] | None = None
    logged: dict[int, dict[str, float]] = field(default_factory=dict)
    baseline: dict[int, dict[str, float]] = field(default_factory=dict)  # logged steps before the window
    check: LogCheck = field(default_factory=LogCheck)  # every replayed step against the run's log
    plan: Any = None  # the settled Plan the replay ran (bisect continues from it)
    diagnosis: str = ""  # the likeliest reason the first checked step misses the log, where it does




def _precision(cfg: ReplayConfig, ckpt: Checkpoint) -> tuple[str, str]:
    """The run's precision and its source (`precision.candidates` lists the alternatives)."""
    return mp.resolve(cfg.precision, ckpt)


def _model_source(spec: str | None, desc: str | None) -> str:
    if spec:
        return "--model"
    if desc and not desc.startswith("transformers"):
        return "the run's recorded config (args, config.json, model_config.yaml or a LightningCLI class path)"
    return "checkpoint config.json"


def _metrics_file(cfg: ReplayConfig) -> Path | None:
    if cfg.metrics is not None:
        return cfg.metrics
    from ..logs import find_metrics, log_dirs

    found = next((f for f in (find_metrics(d) for d in log_dirs(cfg.before)) if f is not None), None)
    if found is None and cfg.batch is not None:
        # A flight recorder's directory (or a black box inside one) keeps the run's log too.
        for d in (Path(cfg.batch), Path(cfg.batch).parent):
            if (d / "metrics.jsonl").is_file():
                return d / "metrics.jsonl"
    return found


def _lr_plan(steps: list[int], ckpt: Checkpoint, batches: BatchSource, logged: dict[int, dict[str, float]]) -> tuple[dict[int, list[float]], str]:
    """LR per step and group: batch log -> training log -> constant from *before*."""
    assert ckpt.optimizer is not None
    base = [g.lr for g in ckpt.optimizer.groups]
    if all(s in batches.lr for s in steps):
        return {s: batches.lr[s] if len(batches.lr[s]) == len(base) else [batches.lr[s][0]] * len(base) for s in steps}, "batch log /lr"
    per_group = {s: group_lrs(logged.get(s, {}), len(base)) for s in steps}
    if all(v is not None for v in per_group.values()):
        return {s: list(v) for s, v in per_group.items() if v is not None}, "training log, LR per group"
    if all("lr" in logged.get(s, {}) for s in steps):
        # A single logged LR: groups keep the ratio to it they had at *before*.
        ref = logged[steps[0]]["lr"]
        ratios = [b / ref if ref > 0 else 1.0 for b in base]
        return {s: [logged[s]["lr"] * r for r in ratios] for s in steps}, "training log lr (group ratios from before)"
    return {s: list(base) for s in steps}, "constant: the LR stored in before"


def _clip_from_checkpoint(ckpt: Checkpoint, batches: BatchSource) -> tuple[float | None, str] | None:
    tc = ckpt.scalars.get("train_config") or {}
    for key in ("grad_clip", "max_grad_norm", "gradient_clipping", "clip_grad"):
        if isinstance(tc.get(key), (int, float)):
            v = float(tc[key])
            return (v if v > 0 else None), f"checkpoint config {key}"
    if batches.grad_clip is not None:
        return (batches.grad_clip if batches.grad_clip > 0 else None), "batch log attribute grad_clip"
    return None


class Session:
    """Model, optimizer and probes rebuilt from *before*; one replay of the window."""

    def __init__(
        self,
        cfg: ReplayConfig,
        a: Checkpoint,
        precision: str,
        loss_fn: Callable[..., torch.Tensor] | None,
        labels: LabelConvention,
        micro_batch_size: int | None = None,
        first: tuple[int, dict[str, torch.Tensor]] | None = None,
        scale_plan: mp.ScalePlan | None = None,
        skip_rule: skipstep.SkipRule | None = None,
    ) -> None:
        self.cfg = cfg
        self.ranks = distributed.current()
        self.device = torch.device(cfg.device) if self.ranks is None else self.ranks.device
        if self.ranks is not None and precision == "fp16":
            # GradScaler's inf check is per rank: ranks could disagree on skipping a step.
            raise ForensicsError("an fp16 (loss-scaled) replay runs in one process for now: run it without torchrun")
        with distributed.params_on_meta() if self.ranks is not None else contextlib.nullcontext():
            self.model, self.model_source = build_model(cfg.model, a)
        self.loss_norm = trainer_loss_norm(self.model, a)
        self.micro_batch_size = micro_batch_size
        if cfg.checkpoint_activations:
            distributed.checkpoint_blocks(self.model)
        if self.ranks is not None:
            distributed.shard_model(self.model, self.ranks, bf16_params=precision == "bf16-params")
            distributed.materialize(self.model, self.device)
        self.to_ckpt = load_weights(self.model, a, self.ranks)
        self.model.to(self.device).train()
        self.opt = build_optimizer(self.model, a, self.to_ckpt, self.ranks)
        unpadded = padding_rows_trained(self.model, self.opt) if self.ranks is None else []
        if unpadded:
            self.model_source += f"; padding_idx of {', '.join(unpadded)}: the run trained the row config.json names (its exp_avg_sq is not 0 there)"
        self.precision = precision
        self.loss_fn = loss_fn
        self.labels = labels
        self.call = None
        # bf16 parameters on fp32 masters in one process (FSDP2 casts them under torchrun).
        self.bf16_params = mp.BF16Params([p for _, p in self.model.named_parameters() if p.requires_grad]) if precision == "bf16-params" and self.ranks is None else None
        # Megatron --bf16: each micro-batch's bf16 gradient summed in fp32 (`_regrad_micro`).
        self.micro_fp32 = mp.fp32_micro_batches(a) if self.bf16_params is not None else None
        if first is not None:  # the calling convention, from the window's first batch
            check_vocab(self.model, first[1], first[0])
            self.call = self._detect_call(first[1])
        self.skip_rule = skip_rule  # OLMo-core's SkipStepAdamW: the steps it skipped
        # fp16: the run's loss scale (precision.LossScaler); without a plan, the
        # checkpoint's scaler state or GradScaler's default start.
        self.loss_scaler = mp.LossScaler(self.device, scale_plan or mp.scale_plan(a, None, [a.step or 0], {}, {})) if precision == "fp16" else None
        self.probe = ModuleProbe(self.model, self.device, self.ranks)
        self.probe.once = cfg.checkpoint_activations
        self.psg = PerSampleGrad(self.model)
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._group_of = {id(p): g for g in self.opt.param_groups for p in g["params"]}

    @property
    def labels_shifted(self) -> bool:
        return self.labels.shifted

    def _detect_call(self, batch: dict[str, torch.Tensor]) -> CallConvention:
        """How the run's trainer calls this model (`conventions.detect_call`), from one
        forward of the first batch (no gradients, before the probes are attached)."""
        if self.ranks is not None:
            batch = self.ranks.my_rows(batch)
        on = {k: v.to(self.device) for k, v in batch.items()}
        try:
            with torch.no_grad(), self._compute(self.precision):
                return detect_call(self.model, on, self.labels.shifted)
        finally:
            if self.bf16_params is not None:
                self.bf16_params.restore()
            if self.ranks is not None:
                # A no-grad forward leaves FSDP2's root unsharded; under a bf16 policy the
                # next backward then never hands the root's gradients to its fp32 shards.
                distributed.reshard(self.model)

    def _forward(self, batch: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
        """The logits of every position [B, T, V], the model called as its trainer calls it."""
        assert self.call is not None
        with self._compute(precision):
            out = call_model(self.model, self.call, batch, self.labels.shifted)
        if isinstance(out, torch.Tensor):
            return out
        return out.logits if self.call.output == "object" else out[0]

    def _loss(self, batch: dict[str, torch.Tensor], precision: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss as the trainer averaged it, and each row's mean token loss.

        Under torchrun: this rank's rows only, and its share of the step's loss (its
        token losses over the whole batch's denominator), so the ranks' shares sum to it.
        """
        full = batch
        if self.ranks is not None:
            batch = self.ranks.my_rows(batch)
            self.probe.rows = batch["input_ids"].shape[0]
        on = {k: v.to(self.device) for k, v in batch.items()}
        if self.call is None:
            self.call = self._detect_call(full)
        logits = self._forward(on, precision)
        labels = on.get("labels", on["input_ids"])
        shifted = self.labels.shifted and "labels" in on
        am = on.get("attention_mask")
        if self.loss_fn is not None:
            tok = self.loss_fn(logits, on)
            mask = torch.ones_like(tok)
        else:
            tok = per_token_loss(logits, labels, am, shifted=shifted)
            mask = ((labels if shifted else labels[:, 1:]) >= 0).to(tok.dtype)
            if am is not None:
                mask = mask * (am if shifted else am[:, 1:]).to(tok.dtype)
        masked = tok * mask
        self.row_tokens = mask.sum(1)
        per_sample = masked.sum(1) / self.row_tokens.clamp_min(1)
        loss = self._normalise(masked, mask, labels, shifted) if self.ranks is None else self._share(masked, mask, full, shifted)
        with torch.no_grad():
            lg = logits.detach()
            lo, hi = torch.aminmax(lg) if lg.numel() else (lg.new_zeros(()), lg.new_zeros(()))
            lse = torch.logsumexp(lg.float(), -1)
            absmax = torch.maximum(-lo.float(), hi.float())
            # One rank: [max |logit|, mean log Z]; ranks: the sum and count to merge.
            self.logit_stats = torch.stack([absmax, lse.mean()]) if self.ranks is None else torch.stack([absmax, lse.sum(), lse.new_tensor(lse.numel())])
        return loss, per_sample

    def _compute(self, precision: str) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision: autocast, or the weights cast to bf16 (bf16-params)."""
        if precision == "bf16-params" and self.ranks is None:
            if self.bf16_params is None:  # another precision tried on this session (`evaluate`)
                self.bf16_params = mp.BF16Params([p for _, p in self.params])
            return self.bf16_params.compute()
        return mp.autocast(precision, self.device.type)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward; with bf16 parameters, the fp32 masters back with fp32 gradients."""
        try:
            loss.backward()
        finally:
            if self.bf16_params is not None:
                self.bf16_params.restore()

    def _regrad_micro(self, batch: dict[str, torch.Tensor]) -> None:
        """The step's gradient again, one micro-batch at a time, each micro-batch's bf16
        gradient cast to fp32 and summed (`precision.fp32_micro_batches`: Megatron's fp32
        main_grad buffer). One backward over the whole batch rounds the sum to bf16 once
        instead: a different gradient by bf16's rounding. The whole-batch pass before this
        one gives the loss, the probes and the per-sample figures; its gradient is replaced."""
        mbs, bp = self.micro_fp32, self.bf16_params
        rows = batch["input_ids"].shape[0]
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        if mbs is None or bp is None or mbs >= rows or kind not in ("targets", "micro"):
            return
        keep, probing = (self.row_tokens, self.logit_stats), self.probe.enabled
        total = self.row_tokens.sum().clamp_min(1)
        n = -(-rows // mbs)
        acc: list[torch.Tensor | None] = [None] * len(bp.params)
        self.opt.zero_grad(set_to_none=True)
        self.probe.enabled = False
        try:
            for i in range(0, rows, mbs):
                part = {k: v[i : i + mbs] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows else v for k, v in batch.items()}
                loss, _ = self._loss(part, "bf16-params")
                share = 1.0 / n if kind == "micro" else self.row_tokens.sum() / total  # its part of the step's loss
                (loss * share).backward()
                acc = bp.accumulate(acc)
        finally:
            bp.restore()
            self.probe.enabled = probing
            self.row_tokens, self.logit_stats = keep
        for p, g in zip(bp.params, acc, strict=True):
            p.grad = g

    def _normalise(self, tok: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, shifted: bool) -> torch.Tensor:
        """The step's loss as its trainer averaged it (`trainer_loss_norm`)."""
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        if kind == "labels" and not shifted:
            return tok.sum() / (labels >= 0).sum().clamp_min(1)
        if kind == "micro" and self.micro_batch_size and self.micro_batch_size < tok.shape[0]:
            parts = [(t.sum() / m.sum().clamp_min(1)) for t, m in zip(tok.split(self.micro_batch_size), mask.split(self.micro_batch_size), strict=True)]
            return torch.stack(parts).mean()
        return tok.sum() / mask.sum().clamp_min(1)

    def _share(self, tok: torch.Tensor, mask: torch.Tensor, full: dict[str, torch.Tensor], shifted: bool) -> torch.Tensor:
        """This rank's share of the step's loss: `_normalise` with the whole batch's
        denominator (counted from the global batch every rank holds)."""
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        labels = full.get("labels", full["input_ids"])
        rows = labels.shape[0]
        if kind == "labels" and not shifted:
            return tok.sum() / (labels >= 0).sum().clamp_min(1).to(tok.device)
        if kind == "micro" and self.micro_batch_size and self.micro_batch_size < rows:
            parts = [t.sum() / m.sum().clamp_min(1) for t, m in zip(tok.split(self.micro_batch_size), mask.split(self.micro_batch_size), strict=True)]
            return torch.stack(parts).sum() / -(-rows // self.micro_batch_size) if parts else tok.sum() * 0
        if self.loss_fn is not None:
            count = torch.tensor(rows * tok.shape[1])
        else:
            count = ((labels if shifted else labels[:, 1:]) >= 0).sum()
            if "attention_mask" in full:
                am = full["attention_mask"] if shifted else full["attention_mask"][:, 1:]
                count = (((labels if shifted else labels[:, 1:]) >= 0) & (am != 0)).sum()
        return tok.sum() / count.clamp_min(1).to(tok.device)

    def probe_pass(self, batch: dict[str, torch.Tensor], precision: str) -> PassStats:
        """Forward + backward with probes, no update (the fp32 reference pass)."""
        self.probe.reset()
        loss, _ = self._loss(batch, precision)
        self._backward(loss)
        stats = self.probe.collect()
        self.opt.zero_grad(set_to_none=True)
        return stats

    def evaluate(self, batch: dict[str, torch.Tensor], precision: str | None = None) -> tuple[float, float]:
        """(loss, pre-clip grad norm) of a batch at the current state; no update, no probes
        (`precision`: another than the session's, to test what the run used)."""
        self.probe.enabled = False
        try:
            self.opt.zero_grad(set_to_none=True)
            loss, _ = self._loss(batch, precision or self.precision)
            self._backward(loss)
            if (precision or self.precision) == "bf16-params":
                self._regrad_micro(batch)
            grads = [_local(p.grad) for _, p in self.params if p.grad is not None]
            if self.ranks is not None:  # the ranks' loss shares and squared norms, summed
                sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
                total = self.ranks.sum(torch.stack([loss.detach().float().cpu(), sq.double().cpu().float()]).double())
                return float(total[0]), math.sqrt(float(total[1]))
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0
            return float(loss.detach()), norm
        finally:
            self.opt.zero_grad(set_to_none=True)
            self.probe.enabled = True

    def step(
        self, step: int, batch: dict[str, torch.Tensor], lrs: list[float], clip: float | None, update: bool = True
    ) -> tuple[StepRecord, PassStats]:
        for g, lr in zip(self.opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        ls = self.loss_scaler
        while True:  # once, unless the loss scale must move and the step be redone (fp16)
            scale = ls.begin(step) if ls is not None else None
            self.probe.reset()
            self.psg.reset()
            self.psg.enabled = True
            self.opt.zero_grad(set_to_none=True)
            loss, per_sample = self._loss(batch, self.precision)
            self._backward(ls.scale(loss) if ls is not None else loss)
            self.psg.enabled = False
            stats = self.probe.collect()
            verdict = ls.settle(step, ls.unscale(self.opt, [p for _, p in self.params])) if ls is not None else None
            if verdict != "redo":
                break
        self._regrad_micro(batch)
        with_grad = [(n, p) for n, p in self.params if p.grad is not None]
        if self.ranks is None:
            g = self._gradients(with_grad, clip, loss, per_sample)
        else:
            g = self._gradients_ranks(with_grad, clip, loss, per_sample, batch["input_ids"].shape[0])
        skipped_by = ""
        if not update:
            skipped, skipped_by = True, "mitigation"  # the mitigation skips this step's update
            if ls is not None:
                ls.hold()
        elif ls is not None:
            skipped = verdict == "skip"
            skipped_by = "loss scaler" if skipped else ""
            ls.finish(step, self.opt, skipped)
        elif self.skip_rule is not None and self.skip_rule.decide(step, g.loss, g.total):
            skipped, skipped_by = True, "optimizer rule"  # SkipStepAdamW: weights, moments and Adam's step stay as they were
        else:
            skipped = not math.isfinite(g.total)
            held = skipstep.hold_step_counter(self.opt) if self.skip_rule is not None and not self.skip_rule.step_increments else None
            self.opt.step()
            if held is not None:
                skipstep.restore_step_counter(self.opt, held)
        rec = StepRecord(
            step=step,
            loss=g.loss,
            grad_norm=g.total,
            skipped=bool(skipped),
            lr=tuple(lrs),
            loss_scale=scale,
            sample_loss=g.sample_loss,
            sample_grad_sq=g.sample_grad_sq,
            sample_ids=None,
            param_grad_nonfinite=g.nonfinite,
            param_grad_rms=g.rms,
            param_rms_t=g.rms_t,
            param_spikes=g.spikes,
            logit_absmax=g.logit_absmax,
            log_z=g.log_z,
            skipped_by=skipped_by,
            sample_tokens=g.sample_tokens,
        )
        return rec, stats

    def _grad_stats(self, p: torch.Tensor) -> torch.Tensor:
        return param_grad_stats(p.grad, self.opt.state.get(p) or {}, self._group_of[id(p)])

    def _gradients(self, with_grad: list[tuple[str, nn.Parameter]], clip: float | None, loss: torch.Tensor, per_sample: torch.Tensor) -> _Grads:
        """The step's gradient evidence in one process, then clipping (one host read)."""
        grads = [p.grad for _, p in with_grad]
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).cpu() if grads else torch.ones(0, dtype=torch.bool)
        bad = tuple(n for (n, _), ok in zip(with_grad, finite.tolist(), strict=True) if not ok)
        table = torch.stack([self._grad_stats(p) for _, p in with_grad]).cpu().tolist() if with_grad else []  # one sync
        total = torch.nn.utils.clip_grad_norm_([p for _, p in self.params], clip if clip else float("inf"))
        sq = self.psg.sq
        logit_absmax, log_z = self.logit_stats.cpu().tolist()
        return _Grads(
            loss=float(loss.detach()),
            total=float(total),
            nonfinite=bad,
            rms={self.to_ckpt(n): row[0] for (n, _), row in zip(with_grad, table, strict=True)},
            rms_t={self.to_ckpt(n): row[1] for (n, _), row in zip(with_grad, table, strict=True) if math.isfinite(row[1])},
            spikes={self.to_ckpt(n): int(row[2]) for (n, _), row in zip(with_grad, table, strict=True) if row[2] > 0},
            sample_loss=tuple(per_sample.detach().float().cpu().tolist()),
            sample_grad_sq=tuple(sq.cpu().tolist()) if sq is not None else None,
            logit_absmax=logit_absmax,
            log_z=log_z,
            sample_tokens=tuple(int(x) for x in self.row_tokens.cpu().tolist()),
        )

    def _gradients_ranks(
        self, with_grad: list[tuple[str, nn.Parameter]], clip: float | None, loss: torch.Tensor, per_sample: torch.Tensor, rows: int
    ) -> _Grads:
        """The step's gradient evidence across torchrun ranks, then clipping.

        Each rank holds its shard of every gradient and its rows' per-sample figures; all of
        it travels in one gather: [loss share, logit stats, rows, per-sample loss, grad
        norm^2 and target tokens (padded), per parameter: sum g^2, sum g^2 / v_hat, spikes, finite]. The
        total norm and clipping follow from the merged sums (torch's clip_grad_norm_ rule).
        """
        assert self.ranks is not None
        dev = self.device
        pad = -(-rows // self.ranks.world) + 1  # rows of the largest block
        n = per_sample.shape[0]
        sq = self.psg.sq
        head = torch.cat([loss.detach().float().reshape(1), self.logit_stats.float(), torch.tensor([float(n), float(sq is not None)], device=dev)])
        samples = torch.zeros(3, pad, device=dev)
        samples[0, :n] = per_sample.detach().float()
        if sq is not None:
            samples[1, :n] = sq.float()
        samples[2, :n] = self.row_tokens.float()
        rows = [torch.cat([param_grad_sums(_local(p.grad), _local_state(self.opt.state.get(p)), self._group_of[id(p)]), torch.isfinite(_local(p.grad)).all().float().reshape(1)]) for _, p in with_grad]
        table = torch.stack(rows) if rows else torch.zeros(0, 4, device=dev)
        flat = torch.cat([head, samples.reshape(-1), table.reshape(-1)]).double()
        every = self.ranks.gather(flat).cpu()  # the step's one collective: [W, len(flat)]
        h = len(head)
        heads, smp, tab = every[:, :h], every[:, h : h + 3 * pad].reshape(-1, 3, pad), every[:, h + 3 * pad :].reshape(self.ranks.world, -1, 4)
        counts = heads[:, 4].long().tolist()
        sums = tab[..., :3].sum(0)  # [P, 3]
        ok = tab[..., 3].amin(0)
        total = float(sums[:, 0].sum().sqrt()) if len(with_grad) else 0.0
        if clip and total > 0:
            coef = clip / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1:
                torch._foreach_mul_([_local(p.grad) for _, p in with_grad], coef)
        numel = [p.numel() for _, p in with_grad]
        return _Grads(
            loss=float(heads[:, 0].sum()),
            total=total,
            nonfinite=tuple(nm for (nm, _), good in zip(with_grad, ok.tolist(), strict=True) if not good),
            rms={self.to_ckpt(nm): math.sqrt(float(r[0]) / max(k, 1)) for (nm, _), r, k in zip(with_grad, sums, numel, strict=True)},
            rms_t={self.to_ckpt(nm): math.sqrt(float(r[1]) / max(k, 1)) for (nm, _), r, k in zip(with_grad, sums, numel, strict=True) if math.isfinite(float(r[1]))},
            spikes={self.to_ckpt(nm): int(r[2]) for (nm, _), r in zip(with_grad, sums, strict=True) if r[2] > 0},
            sample_loss=tuple(float(x) for w, c in enumerate(counts) for x in smp[w, 0, :c].tolist()),
            sample_grad_sq=tuple(float(x) for w, c in enumerate(counts) for x in smp[w, 1, :c].tolist()) if bool(heads[:, 5].all()) else None,
            logit_absmax=float(heads[:, 1].max()),
            log_z=float(heads[:, 2].sum() / heads[:, 3].sum().clamp_min(1)),
            sample_tokens=tuple(int(x) for w, c in enumerate(counts) for x in smp[w, 2, :c].tolist()),
        )

    def close(self) -> None:
        self.probe.remove()
        self.psg.remove()


def _compare(session: Session, b: Checkpoint, lrs: dict[int, list[float]], only: set[str] | None = None) -> list[TensorMatch]:
    """Replayed weights and moments against *after*, per tensor (those in `only`, if given).

    A weight matches when it is within 1% of one Adam step (k lr) of *after*: a
    different summation order changes gradients in the last bits, and Adam can turn
    that into part of an update, never into more than the update bound. Elements past
    the bound (`impossible`) cannot come from any replay of these steps.
    """
    k = len(lrs)
    out = []
    state = session.opt.state
    ranks = session.ranks
    group_of = {id(p): gi for gi, g in enumerate(session.opt.param_groups) for p in g["params"]}
    for key, p in session.model.named_parameters():
        name = session.to_ckpt(key)
        name = b.aliases.get(name, name)
        if (only is not None and name not in only) or not b.has(name):
            continue
        if ranks is not None:
            out.extend(_compare_shard(ranks, name, p, state.get(p, {}), session.opt.param_groups[group_of.get(id(p), 0)], b, lrs, group_of.get(id(p), 0), session.precision))
            continue
        gi = group_of.get(id(p), 0)
        g = session.opt.param_groups[gi]
        lr = max(v[gi] for v in lrs.values())
        st_p = state.get(p, {})
        ref = b.tensor(name).to(torch.float32).view_as(p)
        mine = p.detach().cpu().to(torch.float32)
        quant = g.get("family") == "adam8bit" and bnb.is_quantised(st_p)
        # The seam to the optimizer's family: its own per-step bound (updates.replay_bound).
        c, wd = replay_bound({**g, "quantised": quant}, st_p, k, lr, tuple(p.shape), float(mine.pow(2).mean().sqrt()))
        out.append(_weight_match(name, mine, ref, b.meta(name).dtype, k * lr, c, wd, mp.reach(session.precision)))
        st = b.optim_state(name)
        if st_p and g.get("family") == "adam8bit":
            st_p = {kk: v for kk, v in bnb.with_moments(st_p).items() if kk in ("step", *bnb.DERIVED)}
        if st_p and st:
            pairs = {where: (st_p[where].cpu().float(), st[where].float().view_as(st_p[where])) for where in _shared_state(st_p, st)}
            v = pairs.get("exp_avg_sq")
            for where, (x, y) in pairs.items():
                # Relative rounding per step, floored at the tensor's own scale: elements
                # whose true gradient is zero (a key bias, say) hold pure rounding noise.
                scale = mp.moment_scale(session.precision, where, x, y, *v) if v is not None else torch.maximum(x.abs(), y.abs())
                tol = _moment_tol(scale, float(scale.max()), k, mp.moment_rounding(session.precision))
                if quant:
                    tol = tol + _code_tol(state.get(p, {}), where, x)
                out.append(_match(name, where, x, y, tol, None))
    return out if ranks is None else merge_matches(ranks, out)


def _code_tol(raw: dict[str, Any], where: str, like: torch.Tensor) -> torch.Tensor:
    """An 8-bit moment's extra tolerance: a gradient that differs in its last bits can round
    the replayed value to the neighbouring code, one code gap of its block's absmax away."""
    parts = bnb.quant_parts(raw, 1 if where == "exp_avg" else 2)
    if parts is None:
        return torch.zeros_like(like)
    _, qmap, scale = parts
    return (bnb.per_element(scale.cpu(), like.numel()) * bnb.code_gap(qmap)).view_as(like)


def _shared_state(mine: dict, after: dict) -> list[str]:
    """The state tensors of a replayed parameter that *after* holds too, shape for shape
    (Adam's moments, Adafactor's factored rows and columns, a momentum buffer)."""
    return [
        k for k, v in mine.items()
        if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(after.get(k), torch.Tensor) and after[k].numel() == v.numel()
    ]  # fmt: skip


def _compare_shard(
    ranks: distributed.Ranks, name: str, p: Any, st_p: dict, g: dict, b: Checkpoint, lrs: dict[int, list[float]], gi: int, precision: str = "fp32"
) -> list[TensorMatch]:
    """`_compare` for one FSDP2-sharded parameter: this rank's rows of the replayed state
    against the same rows of *after* (only those read); the ranks' counts are merged by
    `merge_matches`. The moments' tolerance floor is the whole tensor's scale (one
    all-reduce of the two maxima per parameter)."""
    k = len(lrs)
    lr = max(v[gi] for v in lrs.values())
    beta1, beta2 = g["betas"]
    t_end = int(st_p["step"]) if "step" in st_p else k
    c = adam_ratio_bound(beta1, beta2, max(1, t_end - k + 1), t_end)
    stored = b.meta(name).shape

    def after_rows(read: Callable[[int, int], torch.Tensor], full: Callable[[], torch.Tensor]) -> torch.Tensor:
        return distributed.local_rows(ranks, p, stored, read, full).float().reshape(_local(p).shape)

    mine = _local(p).detach().cpu().float()
    ref = after_rows(lambda lo, hi: b.rows(name, lo, hi), lambda: b.tensor(name))
    out = [_weight_match(name, mine, ref, b.meta(name).dtype, k * lr, c, g["weight_decay"], mp.reach(precision))]
    st = b.optim_state(name)
    if st_p and st:
        pairs = {}
        for where in ("exp_avg", "exp_avg_sq"):
            x = _local(st_p[where]).cpu().float()
            y = after_rows(lambda lo, hi, w=where: b.state_rows(name, w, lo, hi), lambda w=where: st[w])
            pairs[where] = (x, y, torch.maximum(x.abs(), y.abs()))
        vx, vy, _ = pairs["exp_avg_sq"]
        pairs = {w: (x, y, mp.moment_scale(precision, w, x, y, vx, vy)) for w, (x, y, _) in pairs.items()}
        tops = ranks.max(torch.stack([s.max() if s.numel() else s.new_zeros(()) for _, _, s in pairs.values()]))
        for (where, (x, y, scale)), top in zip(pairs.items(), tops.tolist(), strict=True):
            out.append(_match(name, where, x, y, _moment_tol(scale, top, k, mp.moment_rounding(precision)), None))
        b.forget(name)
    return out


def _weight_match(name: str, mine: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, klr: float, c: float, wd: float, reach: float = 1.0) -> TensorMatch:
    """A replayed weight against *after*'s: within 1% of the window's Adam steps (k lr) plus
    rounding of the stored dtype; past the bound no Adam step reaches (`impossible`)."""
    ulp = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    wscale = torch.maximum(mine.abs(), ref.abs())
    return _match(name, "weight", mine, ref, 0.01 * klr + 4 * ulp * wscale, reach * klr * (c + wd * wscale) * 1.001 + 2 * ulp * wscale)


def _moment_tol(scale: torch.Tensor, top: float, k: int, rel: float = 1e-3) -> torch.Tensor:
    """A moment's tolerance: relative rounding `rel` per step (`precision.moment_rounding`),
    floored at the whole tensor's scale `top` (elements whose true gradient is zero hold
    pure rounding noise)."""
    return rel * k * scale + 1e-4 * top + 1e-30


def merge_matches(ranks: distributed.Ranks, local: list[TensorMatch]) -> list[TensorMatch]:
    """Every rank's per-shard matches as whole-tensor ones (counts summed, maxima taken),
    identical on every rank: one collective."""
    merged: dict[tuple[str, str], TensorMatch] = {}
    for part in ranks.objects(local):
        for m in part:
            o = merged.get((m.name, m.where))
            merged[(m.name, m.where)] = m if o is None else TensorMatch(
                name=m.name,
                where=m.where,
                max_abs_diff=max(o.max_abs_diff, m.max_abs_diff),
                mismatched=o.mismatched + m.mismatched,
                numel=o.numel + m.numel,
                tolerance=max(o.tolerance, m.tolerance),
                impossible=o.impossible + m.impossible,
                worst=max(o.worst, m.worst),
            )
    return [merged[(m.name, m.where)] for m in local]


def _match(name: str, where: str, x: torch.Tensor, y: torch.Tensor, tol: torch.Tensor | float, bound: torch.Tensor | None) -> TensorMatch:
    diff = (x - y).abs()
    bad = ~(diff <= tol)
    impossible = int((~(diff <= bound)).sum()) if bound is not None else 0
    ratio = torch.where(diff == 0, 0.0, torch.nan_to_num(diff / torch.as_tensor(tol, dtype=diff.dtype), nan=float("inf")))
    return TensorMatch(
        name=name,
        where=where,
        max_abs_diff=float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0,
        mismatched=int(bad.sum()),
        numel=x.numel(),
        tolerance=float(torch.as_tensor(tol).max()),
        impossible=impossible,
        worst=float(ratio.max()) if ratio.numel() else 0.0,
    )


@dataclass(slots=True)
class Plan:
    """Everything a replay of the window needs, resolved once: checkpoints, steps,
    batches, LR per step, clipping candidates, precision, loss; each with its source."""

    cfg: ReplayConfig
    a: Checkpoint
    b: Checkpoint | None
    steps: list[int]
    batches: BatchSource
    lrs: dict[int, list[float]]
    lr_source: str
    clips: list[tuple[float | None, str]]
    precision: str
    precision_source: str
    loss_fn: Callable[..., torch.Tensor] | None
    logged: dict[int, dict[str, float]]
    metrics_file: Path | None
    labels: LabelConvention
    model_source: str = ""
    loss_norm: LossNorm | None = None
    call: CallConvention | None = None
    scale: mp.ScalePlan | None = None  # fp16: where the loss scale comes from
    skip: skipstep.SkipRule | None = None  # an optimizer that skips steps (OLMo-core)

    def config(self, clip: float | None, clip_source: str) -> dict[str, dict[str, Any]]:
        """replay.config: every assumption with its source (the report states it: replay.config)."""
        cfg = self.cfg
        return {
            "precision": {"value": self.precision, "source": self.precision_source},
            **({"loss_scale": self.scale.describe()} if self.scale is not None and self.precision == "fp16" else {}),
            "lr": {"value": {s: self.lrs[s] for s in self.steps}, "source": self.lr_source},
            "clip": {"value": clip, "source": clip_source},
            "loss": {
                "value": cfg.loss or f"causal LM cross-entropy on the logits; {self.loss_norm.source if self.loss_norm else 'mean over target tokens'}",
                "source": "--loss" if cfg.loss else ("the run's trainer" if self.loss_norm and self.loss_norm.kind != "targets" else "default"),
            },
            "labels": {"value": self.labels.describe(), "source": self.labels.source},
            "call": {
                "value": self.call.describe if self.call else None,
                "source": "the forward's signature and one forward of the first batch; checked on the first step against the log",
            },
            "optimizer": (
                {"value": f"{self.skip.name}: AdamW whose update is skipped where the loss or grad norm exceeds the mean of the last {self.skip.interval} steps by {self.skip.sigma:g} std",
                 "source": "OLMo-core config.json train_module.optim; the skipped steps from the run's log (optim/step skipped), else from that rule"}
                if self.skip is not None else {"value": _optimizer_name(self.a), "source": "checkpoint optimizer state (its family's own class)"}
            ),  # fmt: skip
            "model": {"value": self.model_source or cfg.model or "config.json", "source": _model_source(cfg.model, self.model_source)},
            "batches": {"value": self.batches.describe, "source": "--data, rebuilt; the first replayed step's loss and grad norm match the log" if self.batches.rebuilt else "--batch"},
            "metrics": {"value": str(self.metrics_file) if self.metrics_file else None, "source": "discovered" if self.metrics_file and cfg.metrics is None else "--metrics"},
            **({"distributed": {"value": ranks.describe(), "source": "torchrun"}} if (ranks := distributed.current()) is not None else {}),
            **({"activations": {"value": "recomputed per block in the backward pass", "source": "--checkpoint-activations"}} if cfg.checkpoint_activations else {}),
        }

    def baseline(self) -> dict[int, dict[str, float]]:
        """The run's own logged history, up to 128 steps before the window (OLMo-core's window)."""
        first = self.steps[0]
        return {s: self.logged[s] for s in range(first - 128, first) if s in self.logged}

    def session(self) -> Session:
        # Under torchrun each rank reads its own rows: a rank that cannot stops them all.
        first = (self.steps[0], self.batches.batch(self.steps[0]))
        sess = distributed.agree(
            distributed.current(),
            lambda: Session(
                self.cfg, self.a, self.precision, self.loss_fn, self.labels, self.batches.micro_batch_size, first,
                self.scale, self.skip.fresh() if self.skip is not None else None,
            ),  # fmt: skip
        )
        self.model_source, self.loss_norm, self.call = sess.model_source, sess.loss_norm, sess.call
        return sess


def _optimizer_name(a: Checkpoint) -> str:
    """The rebuilt optimizer's classes, as `replay.config` states them."""
    if a.optimizer is None:
        return "none"
    names = {"adam": "AdamW", "lion": "lion_pytorch.Lion", "muon": "torch.optim.Muon", "sgd": "torch.optim.SGD", "adam8bit": "bitsandbytes.optim.AdamW8bit"}
    out = []
    for h in a.optimizer.groups:
        impl = str(h.options.get("implementation", ""))
        n = impl if h.family in ("adafactor", "lamb") else names.get(h.family, h.family)
        if n not in out:
            out.append(n)
    return " + ".join(out)


def plan(cfg: ReplayConfig, steps: list[int] | None = None) -> Plan:
    """Resolve a replay: open the checkpoints, check the batches, settle LR, clip, precision.

    Args:
        cfg: the replay configuration.
        steps: override the window (whatif replays N steps from *before*).

    Raises:
        ForensicsError: bad checkpoints, batches or configuration.
    """
    a, b = open_pair(cfg.before, cfg.after) if cfg.after is not None else (open_checkpoint(cfg.before), None)
    if a.step is None:
        raise ForensicsError(f"{cfg.before}: the checkpoint does not record its step; pass --step")
    if steps is None:
        if b is not None:
            if b.step is None or b.step <= a.step:
                raise ForensicsError(f"{cfg.after}: its step ({b.step}) must come after before's ({a.step})")
            steps = list(range(a.step + 1, b.step + 1))
        else:
            steps = [cfg.step if cfg.step is not None else a.step + 1]
    candidates = _batches(cfg, a)
    batches = candidates[0]
    # Several candidates (the collators an HF run may have used): the window and its labels
    # once one is chosen (`choose_batches`).
    window = [batches.batch(s) for s in steps] if len(candidates) == 1 else []  # fail early on a missing step
    labels = settle_labels(window, batches.labels_shifted, cfg.labels, batches.describe)
    mfile = _metrics_file(cfg)
    logged = read_metrics(mfile) if mfile is not None else {}
    precision, psrc = _precision(cfg, a)
    if a.optimizer is None and a.pending_optimizer is not None:
        raise ForensicsError(f"{a.pending_optimizer.source}: optimizer ids map ambiguously ({', '.join(sorted(a.pending_optimizer.ambiguous)[:3])} ...); pass --after so the pair's updates settle the mapping")
    if a.optimizer is None:
        raise ForensicsError(f"{cfg.before}: no optimizer state; replay needs it to reproduce the update")
    lrs, lsrc = _lr_plan(steps, a, batches, logged)
    loss_fn = load_callable(cfg.loss, "--loss") if cfg.loss else None
    clips: list[tuple[float | None, str]]
    if cfg.clip is not None:
        clips = [(cfg.clip if cfg.clip > 0 else None, "--clip")]
    elif (found := _clip_from_checkpoint(a, batches)) is not None:
        clips = [found]
    elif b is not None:
        clips = [(None, "calibrated: none"), (1.0, "calibrated: 1.0")]
    elif sum(s in logged for s in steps) >= 2:  # the loss of a step after the first shows the clip
        clips = [(None, "calibrated against the log: none"), (1.0, "calibrated against the log: 1.0")]
    else:
        clips = [(None, "assumed: none (no after and no log to calibrate against)")]
    scale = mp.scale_plan(a, b, steps, batches.loss_scale, logged) if precision == "fp16" else None
    skip = skipstep.skip_rule(a, logged, steps[0])
    p = Plan(cfg, a, b, steps, batches, lrs, lsrc, clips, precision, psrc, loss_fn, logged, mfile, labels, scale=scale, skip=skip)
    if len(candidates) > 1:
        p.batches = choose_batches(p, candidates)
    return p


def choose_batches(p: Plan, candidates: list[BatchSource]) -> BatchSource:
    """The first candidate (the rebuilt batches under each collator an HF run may have
    used) whose first replayed step, evaluated from *before*, gives the loss and grad norm
    the log recorded (`require_rebuilt_match`); its `describe` says so and what was passed
    over. A candidate whose collator cannot collate the window's rows, or whose labels
    follow no convention, is passed over too. Leaves `p.labels` measured on the chosen
    candidate's window. None lands: one line, the figures of each."""
    from .hfdata import require_rebuilt_match

    step = p.steps[0]
    logged = p.logged.get(step)
    if not logged or "loss" not in logged:
        raise ForensicsError(f"the rebuilt batches cannot be checked: the log has no loss for step {step} to tell the collators apart; pass --collator or --batch")
    missed: list[str] = []
    session: Session | None = None
    try:
        with torch.random.fork_rng(devices=[torch.device(p.cfg.device)] if p.cfg.device == "cuda" else []):
            for c in candidates:
                name = c.collator or c.describe
                try:
                    window = [c.batch(s) for s in p.steps]
                    labels = settle_labels(window, c.labels_shifted, p.cfg.labels, c.describe)
                except ForensicsError as e:  # BatchError names the collator, the step and its error
                    missed.append(getattr(e, "brief", str(e)))
                    continue
                p.batches, p.labels = c, labels
                if session is None:
                    session = p.session()  # the model called as its trainer calls it, from this window
                session.labels = labels
                loss, grad = session.evaluate(window[0])
                try:
                    require_rebuilt_match(step, (loss, grad), logged, p.precision)
                except ForensicsError:
                    missed.append(f"{name}: loss {loss:.4g}" + (f", grad norm {grad:.4g}" if "grad_norm" in logged else ""))
                    continue
                passed = f"; passed over: {'; '.join(missed)}" if missed else ""
                return dataclasses.replace(c, describe=f"{c.describe}: its step {step} lands on the log{passed}")
    finally:
        if session is not None:
            session.close()
    want = f"loss {logged['loss']:.4g}" + (f", grad norm {logged['grad_norm']:.4g}" if "grad_norm" in logged else "")
    raise ForensicsError(
        f"the data pipeline differs: no collator rebuilds step {step} as logged ({want}); pass --collator module:obj or --batch. "
        f"Tried: {'; '.join(missed)}"
    )


def _batches(cfg: ReplayConfig, a: Checkpoint) -> list[BatchSource]:
    """`--batch` as given, or the batches rebuilt from the run's data (`--data`): HF
    Trainer runs give a candidate per collator (`choose_batches` keeps one)."""
    if cfg.batch is not None:
        src = open_batches(cfg.batch)
        if not src.ids_only:
            return [src]
        if cfg.data is None:
            raise ForensicsError(f"{cfg.batch}: the log keeps sample ids, not tokens: pass --data (the dataset they index) as well")
        from .batches import with_rows
        from .hfdata import _dataset

        return [with_rows(src, _dataset(cfg.data), f"--data {cfg.data}")]
    if cfg.data is None:
        raise ForensicsError("pass --batch (the batches the run consumed) or --data (the run's training data: HF Trainer, Megatron and OLMo-core runs)")
    if a.format.startswith("megatron"):
        from .megatron_data import megatron_batches

        return [megatron_batches(cfg.data, a.config, a.path.parent)]
    from .olmo_data import is_olmo_checkpoint, olmo_batches

    if is_olmo_checkpoint(a.path):
        return [olmo_batches(cfg.data, a.path)]
    if a.format != "hf-trainer":
        raise ForensicsError(f"{a.path}: --data rebuilds HF Trainer runs' batches; this is a {a.format} checkpoint: pass --batch")
    from .hfdata import trainer_batches

    world = len(list(a.path.glob("rng_state_*.pth"))) or 1  # the Trainer saves one RNG state per process
    return trainer_batches(cfg.data, a.scalars.get("training_args"), a.config, world, cfg.collator, a.path)


def _check_rebuilt(p: Plan, result: ReplayResult) -> None:
    """Rebuilt batches are trusted only when the first step replays to the logged loss."""
    from .hfdata import require_rebuilt_match

    first = result.records[0]
    require_rebuilt_match(first.step, (first.loss, first.grad_norm), p.logged.get(first.step), p.precision)


def replay(cfg: ReplayConfig, progress: Callable[[str], None] | None = None, steps: list[int] | None = None) -> ReplayResult:
    """Replay the window from *before* with probes; compare with *after* when given, and
    every replayed step with the run's own log (`logcheck`).

    With no clipping stated anywhere, the window is replayed under each usual setting and
    the one that reproduces *after* best is kept; without *after*, the one that reproduces
    the log best (calibration, said in the report). A replay that misses the log on its
    first step is not calibrated further (the first step does not depend on the clip): it
    carries the likeliest reason (`diagnose_miss`) for the detectors to withhold it.

    Raises:
        ForensicsError: bad checkpoints, model, batches or configuration.
    """
    torch.manual_seed(0)
    p = plan(cfg, steps)
    settle(p, progress)
    best: tuple[tuple[float, float], ReplayResult] | None = None
    todo = list(p.clips)
    tried: set[float | None] = set()
    while todo:
        clip, csrc = todo.pop(0)
        tried.add(clip)
        result = _run(p, clip, progress)
        if p.batches.rebuilt and best is None:  # the first step does not depend on the clip
            _check_rebuilt(p, result)
        result.config = p.config(clip, csrc)
        result.logged = {s: p.logged[s] for s in p.steps if s in p.logged}
        result.baseline = p.baseline()
        result.check = check_against_log(result.records, p.logged, p.precision, p.batches.micro_batch_size, clip)
        err = (_mismatch_score(result), _log_score(result.check)) if p.b is not None else (_log_score(result.check), 0.0)
        if best is None or err < best[0]:
            best = (err, result)
        miss = result.check.first_miss
        if miss is not None and miss.step == p.steps[0]:
            break  # nothing a clip changes reaches the first step
        if not todo and best[0][0] > 0 and csrc.startswith("calibrated"):
            # Neither usual setting lands: the other clip norms trainers use, where they
            # would have clipped at all (below the window's largest grad norm).
            top = max((r.grad_norm for r in result.records if math.isfinite(r.grad_norm)), default=0.0)
            how = csrc.split(":")[0]
            todo = [(c, f"{how}: {c:g}") for c in CLIP_CANDIDATES if c not in tried and c < top]
    assert best is not None
    result = best[1]
    result.plan = p
    miss = result.check.first_miss
    if miss is not None and miss.step == result.check.first_checked:
        result.diagnosis = diagnose_miss(p, miss, result.check.loss_atol)
    return result


def settle(p: Plan, progress: Callable[[str], None] | None = None) -> None:
    """What the plan cannot read from the run's files, calibrated: a per-group LR change the
    log does not show, the precision where the run states none (the first step against the
    log), the fp16 loss scale where the run recorded none."""
    _settle_ratio_change(p, progress)
    settle_precision(p)
    mp.settle_loss_scale(p, progress)


def settle_precision(p: Plan) -> None:
    """Where the run states no precision (fp32 weights: fp32, bf16 parameters on fp32 masters
    and bf16 autocast all keep them), the candidate whose first replayed step lands on the
    logged loss and grad norm (`precision.candidates`, likeliest first). Without a logged
    first step the likeliest stands, said so."""
    cands = [c for c in mp.candidates(p.a, p.cfg.precision) if c[0] != "fp16"]
    if len(cands) < 2:
        return
    first = p.steps[0]
    row = p.logged.get(first) or {}
    if "loss" not in row:
        p.precision_source += "; other precisions possible, the log cannot tell (no logged loss at the first step)"
        return
    others = []
    if distributed.current() is not None:  # FSDP2 shards in one precision: only the plan's is tried here
        others = [c for c, _ in cands if c != p.precision]
        cands = [c for c in cands if c[0] == p.precision]
    miss = StepCheck(step=first, logged_loss=row["loss"], logged_grad_norm=row.get("grad_norm"), loss_ok=False, grad_ok=False if "grad_norm" in row else None)
    atol = log_rounding([r["loss"] for r in p.logged.values() if "loss" in r])
    batch = p.batches.batch(first)
    session = p.session()
    tried = []
    try:
        for prec, why in cands:
            got = session.evaluate(batch, prec)
            tried.append(f"{prec} {got[0]:.5g}")
            if _lands(got, miss, atol, prec):
                p.precision = prec
                p.precision_source = f"{why}; calibrated: its first step gives loss {got[0]:.6g}, the log {row['loss']:.6g} ({', '.join(tried)})"
                return
    finally:
        session.close()
    p.precision_source += f"; no candidate lands on the log's first step ({', '.join(tried)}; logged {row['loss']:.5g})"
    if others:
        p.precision_source += f"; {', '.join(others)} are tried in one process only (run without torchrun)"


def settle_clip(p: Plan, progress: Callable[[str], None] | None = None, probe_steps: int = 4) -> tuple[float | None, str]:
    """The plan's clip norm: the stated one, else the candidate whose replay of the window's
    first `probe_steps` steps lands on the run's log best (the mitigation comparisons of
    `whatif` replay from it). Without a log to tell, the first candidate, said so."""
    if len(p.clips) == 1:
        return p.clips[0]
    head = p.steps[:probe_steps]
    if sum(s in p.logged for s in head) < 2:
        return p.clips[0][0], f"{p.clips[0][1]} (the log cannot tell within {len(head)} steps)"
    short = dataclasses.replace(p, steps=head, b=None)
    scored = []
    for clip, src in p.clips:
        if progress is not None:
            progress(f"clip {clip}?")
        recs = _run(short, clip, None).records
        scored.append((_log_score(check_against_log(recs, p.logged, p.precision, p.batches.micro_batch_size, clip)), clip, src))
    _, clip, src = min(scored, key=lambda x: x[0])
    return clip, src


def _log_score(check: LogCheck) -> float:
    """How far a replay is from the run's log: the share of its checked steps that miss, plus
    their mean relative loss error (a tie-break below one step's share)."""
    done = [c for c in check.checks if c.checked]
    if not done:
        return 0.0
    errs = [abs(c.loss - c.logged_loss) / max(abs(c.logged_loss), 1e-12) for c in done if c.loss is not None and c.logged_loss is not None]
    finite = [e for e in errs if math.isfinite(e)]
    return sum(not c.ok for c in done) / len(done) + min(sum(finite) / max(len(finite), 1), 1.0) / (len(done) + 1)


def _lands(got: tuple[float, float], miss: Any, atol: float, precision: str) -> bool:
    """Whether (loss, grad norm) lands on the log's figures of the missed step."""
    loss, grad = got
    ok = miss.logged_loss is None or abs(loss - miss.logged_loss) <= LOSS_RTOL.get(precision, 5e-3) * abs(miss.logged_loss) + atol
    if miss.logged_grad_norm is not None and miss.grad_ok is not None:
        ok = ok and abs(grad - miss.logged_grad_norm) <= GRAD_RTOL.get(precision, 3e-2) * abs(miss.logged_grad_norm)
    return bool(ok and math.isfinite(loss))


def diagnose_miss(p: Plan, miss: Any, atol: float = 0.0) -> str:
    """The likeliest reason a replay misses the log on its first checked step, from the
    figures: the same batch re-evaluated from *before* with each convention the replay may
    have got wrong (labels, loss normalisation, precision); the first that lands on the log
    is named with its figure. On a later first checked step the window's updates (LR,
    clipping, optimizer state) before it are suspects too."""
    if miss.step != p.steps[0]:
        return (
            f"the log has no figure before step {miss.step} to check the earlier steps against: the batches, model, labels or "
            "precision, or the updates before it (LR, clipping, optimizer state), differ from the run's"
        )
    batch = p.batches.batch(miss.step)
    session = p.session()
    tried: list[str] = []
    try:
        labels, norm = session.labels, session.loss_norm
        variants: list[tuple[str, Callable[[], None], str]] = []
        if "labels" in batch and labels.same is not None:
            flipped = dataclasses.replace(labels, shifted=not labels.shifted)

            def use_flipped() -> None:
                session.labels = flipped

            variants.append((f"labels: read as {flipped.name}", use_flipped, session.precision))
        for kind in ("targets", "labels", "micro"):
            if kind != norm.kind:

                def use_norm(kind: str = kind) -> None:
                    session.labels, session.loss_norm = labels, LossNorm(kind, kind)

                variants.append((f"loss normalisation: {kind}", use_norm, session.precision))
        for prec in ("fp32", "bf16-params", "bf16", "fp16"):
            if prec != session.precision:

                def use_default() -> None:
                    session.labels, session.loss_norm = labels, norm

                variants.append((f"precision: {prec}", use_default, prec))
        for what, apply, prec in variants:
            apply()
            try:
                got = session.evaluate(batch, prec)
            except (RuntimeError, ValueError) as e:  # a variant the model cannot run (fp16 on CPU kernels, say)
                tried.append(f"{what} fails ({type(e).__name__})")
                continue
            if _lands(got, miss, atol, prec):
                return f"{what} (it gives loss {got[0]:.5g}, grad norm {got[1]:.4g})"
            tried.append(f"{what} gives loss {got[0]:.4g}")
    finally:
        session.close()
    dropout = [n for n, m in session.model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if dropout:
        return f"dropout is on ({dropout[0]} p={session.model.get_submodule(dropout[0]).p:g}...): a replay cannot draw the run's masks; none of {', '.join(tried)}"
    if miss.loss_ok is not False:
        return "the loss matches but the gradient does not: the loss scaling, frozen parameters or what the log calls its grad norm differ"
    off = abs(miss.loss - miss.logged_loss) / max(abs(miss.logged_loss), 1e-12)
    if off <= 3 * LOSS_RTOL.get(p.precision, 5e-3):
        return f"a numerical difference just past float noise (kernels, TF32, fused ops) ({off:.2%} off); none of: {'; '.join(tried)}"
    # Another batch of the same data lands ~1% away; a different task or model far further.
    return f"the batches (data, order, collator) or the model (architecture, activation, norm) differ from the run's ({off:.1%} off); none of: {'; '.join(tried)}"


def ratio_change(a: Checkpoint, b: Checkpoint | None) -> tuple[list[int], list[float], list[float]] | None:
    """Param groups whose LR relative to group 0 differs between *before* and *after* by
    more than `LR_GROWTH_MARGIN`: (those groups, every group's ratio at a, at b). A schedule
    the groups share scales them all alike, so their ratios hold; a ratio that moves is a
    per-group LR change inside the window (a per-module LR bug, a group unfrozen)."""
    if b is None or a.optimizer is None or b.optimizer is None:
        return None
    la, lb = [g.lr for g in a.optimizer.groups], [g.lr for g in b.optimizer.groups]
    if len(la) != len(lb) or len(la) < 2 or la[0] <= 0 or lb[0] <= 0:
        return None
    ra, rb = [x / la[0] for x in la], [x / lb[0] for x in lb]
    changed = [g for g in range(len(la)) if ra[g] > 0 and rb[g] > 0 and max(rb[g] / ra[g], ra[g] / rb[g]) > LR_GROWTH_MARGIN]
    return (changed, ra, rb) if changed else None


def _switched(p: Plan, ra: list[float], rb: list[float], k: int) -> dict[int, list[float]]:
    """The plan's LRs with the group ratios of *before* up to step k - 1 and *after*'s from k."""
    return {s: [v[0] * (ra[g] if s < k else rb[g]) for g in range(len(v))] for s, v in p.lrs.items()}


def _settle_ratio_change(p: Plan, progress: Callable[[str], None] | None) -> None:
    """Where the log gives one LR for all groups (HF Trainer logs group 0's) and the pair
    shows a group's ratio changed, find the step it changed at: the one whose replay moves
    the changed groups' weights as far as they moved from *before* to *after* (movement
    falls monotonically as the change comes later, so bisection: ~log2(window) replays)."""
    change = ratio_change(p.a, p.b)
    if change is None or p.b is None or not p.lr_source.startswith(("training log lr", "constant")):
        return
    groups, ra, rb = change
    if distributed.current() is not None:
        raise ForensicsError(
            f"param group {', '.join(map(str, groups))}'s LR ratio changes inside the window and the log gives one LR: "
            "finding the step it changed at runs in one process; run without torchrun, or pass a batch log with /lr per group (the flight recorder's)"
        )
    assert p.a.optimizer is not None
    names = [n for n, h in p.a.optimizer.hyper.items() if h.index in groups and p.b.has(n)]
    if not names:
        return
    start = {n: p.a.tensor(n).double() for n in names}  # read once for every trial
    target = sum(float((p.b.tensor(n).double() - start[n]).norm()) for n in names)
    clip = p.clips[0][0]
    grows = any(rb[g] > ra[g] for g in groups)  # later change -> less movement when the ratio grew
    seen: dict[int, tuple[float, float]] = {}

    def trial(k: int) -> tuple[float, float]:
        if k not in seen:
            if progress is not None:
                progress(f"LR change at step {k}?")
            seen[k] = _movement(p, _switched(p, ra, rb, k), clip, start)
        return seen[k]

    lo, hi = p.steps[0], p.steps[-1] + 1  # hi: no change inside the window
    while lo < hi:
        mid = (lo + hi) // 2
        if (trial(mid)[0] > target) == grows:
            lo = mid + 1
        else:
            hi = mid
    cands = [k for k in (lo - 1, lo) if p.steps[0] <= k <= p.steps[-1]]
    k = min(cands, key=lambda c: abs(trial(c)[0] - target))
    how = "the step whose replay moves its weights as far as before -> after did"
    if trial(k)[1] > MATCH_SHARE:
        # A wrecked module's movement is chaotic, not monotone: the change step is the one
        # whose replay lands on after (every step of the window tried; the right one
        # reproduces it, as every replay must).
        k = min(p.steps, key=lambda c: trial(c)[1])
        how = "the step whose replay reproduces after's weights of those groups"
    p.lrs = _switched(p, ra, rb, k)
    shown = ", ".join(str(g) for g in groups)
    p.lr_source += f"; group {shown}'s LR ratio changes at step {k} (calibrated: {how}; {len(seen)} replays)"


# A replay reproduces *after* when at most this share of elements is off (docs/signatures.md#reproducibility).
MATCH_SHARE = 0.01


def _movement(p: Plan, lrs: dict[int, list[float]], clip: float | None, start: dict[str, torch.Tensor]) -> tuple[float, float]:
    """How far a replay of the window moves the named weights from where they started
    (`start`, *before*'s), and the share of their elements that miss *after*'s (`_compare`'s
    tolerance)."""
    assert p.b is not None
    session = p.session()
    try:
        for s in p.steps:
            session.step(s, p.batches.batch(s), lrs[s], clip)
        params = {session.to_ckpt(k): q for k, q in session.model.named_parameters()}
        moved = sum(float((params[n].detach().cpu().double() - w).norm()) for n, w in start.items() if n in params)
        matches = [m for m in _compare(session, p.b, lrs, only=set(start)) if m.where == "weight"]
        share = sum(m.mismatched for m in matches) / max(1, sum(m.numel for m in matches))
        return moved, share
    finally:
        session.close()


# Clip norms seen in practice beyond 1.0 (HF/Megatron/OLMo default): 0.5 (GPT-NeoX
# configs), 0.3 (some Llama recipes), 2.0 and 5.0 (loose clipping in small-batch runs).
CLIP_CANDIDATES = (0.3, 0.5, 2.0, 5.0)


def _mismatch_score(result: ReplayResult) -> float:
    if not result.matches:
        return 0.0
    return float(np.mean([m.mismatched / max(m.numel, 1) for m in result.matches]))


def _run(p: Plan, clip: float | None, progress: Callable[[str], None] | None) -> ReplayResult:
    b, steps, batches, lrs, precision = p.b, p.steps, p.batches, p.lrs, p.precision
    session = p.session()
    result = ReplayResult(config={}, precision=precision)
    window = {s: batches.batch(s) for s in steps}
    try:
        for s in steps:
            if progress is not None:
                progress(f"step {s}")
            batch = window[s]
            ids = batch["input_ids"]
            check_vocab(session.model, batch, s)
            with doing(f"replaying step {s}"):
                if precision != "fp32":
                    result.fp32_passes[s] = session.probe_pass(batch, "fp32")
                rec, stats = session.step(s, batch, lrs[s], clip)
            if batches.sample_ids.get(s):
                rec = dataclasses.replace(rec, sample_ids=tuple(batches.sample_ids[s]))
            result.records.append(rec)
            result.passes[s] = stats
            others = np.concatenate([window[t]["input_ids"].numpy().ravel() for t in steps if t != s] or [np.zeros(0, dtype=np.int64)])
            result.row_stats[s] = row_data_stats(ids.numpy(), others)
        if b is not None:
            result.matches = _compare(session, b, lrs)
    finally:
        session.close()
    return result


def check_vocab(model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> None:
    """A token id the model's embedding cannot index is bad input, said before any forward."""
    vocab = _vocab_size(model)
    ids = batch["input_ids"]
    if vocab is not None and ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
        raise ForensicsError(f"batch of step {step}: token id {bad} outside the model's vocabulary of {vocab}")


def _vocab_size(model: nn.Module) -> int | None:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None
