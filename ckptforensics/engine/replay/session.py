"""One replay session: the model, optimizer and probes rebuilt from *before*, stepping the
window's batches as the run's trainer did. One process is a world of one
(`distributed.OneProcess`): each step is written once, and under torchrun each rank steps
its rows and shards the same way, the ranks meeting only at the reductions (the step's
evidence in `gradients`).

Over 400 lines: the loss as each trainer averaged it (`_share`, `_regrad_micro`) needs the
session's model, precision and probes; apart from the session, those would become API."""

from __future__ import annotations

import contextlib
import logging
import math
from array import array
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptforensics.core import fused
from ckptforensics.core.errors import ForensicsError
from ckptforensics.engine.replay import distributed, paramstats
from ckptforensics.engine.replay import gradients as gr
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.conventions import (
    CallConvention,
    LabelConvention,
    call_model,
    detect_call,
)
from ckptforensics.engine.replay.model import (
    build_model,
    load_weights,
    padding_rows_trained,
    trainer_loss_norm,
)
from ckptforensics.engine.replay.optimizer import build_optimizer
from ckptforensics.engine.replay.probes import ModuleProbe, PassStats, param_grad_table
from ckptforensics.engine.replay.records import (
    GradEvidence,
    ReplayConfig,
    StepRecord,
    local_state,
    local_tensor,
)
from ckptforensics.engine.replay.routers import (
    RouterFigures,
    aux_term,
    gate_aux,
    gate_figures,
    router_figures,
    router_gates,
    router_modules,
)
from ckptforensics.engine.replay.samples import PerSampleGrad, per_token_loss
from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers import SkipRule, hold_step_counter, restore_step_counter

__all__ = ["Session", "check_vocab", "logit_figures"]

log = logging.getLogger(__name__)


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
        skip_rule: SkipRule | None = None,
    ) -> None:
        self.cfg = cfg
        # The torchrun ranks the model is sharded over (None: one process, the whole model),
        # and whom the step's figures are reduced over (the ranks, or one process).
        self.shards = distributed.current()
        self.ranks = distributed.world_of(cfg.device)
        self.device = self.ranks.device
        if self.shards is not None and precision == "fp16":
            # GradScaler's inf check is per rank: ranks could disagree on skipping a step.
            raise ForensicsError(
                "an fp16 (loss-scaled) replay runs in one process for now: run it without torchrun"
            )
        with distributed.params_on_meta() if self.shards is not None else contextlib.nullcontext():
            self.model, self.model_source = build_model(cfg.model, a)
        self.loss_norm = trainer_loss_norm(self.model, a)
        self.micro_batch_size = micro_batch_size
        if cfg.checkpoint_activations:
            distributed.checkpoint_blocks(self.model)
        if self.shards is not None:
            distributed.shard_model(self.model, self.shards, bf16_params=precision == "bf16-params")
            distributed.materialize(self.model, self.device)
        self.to_ckpt = load_weights(self.model, a, self.shards)
        self.vocab = _vocab_size(self.model)  # what `check_vocab` holds each batch to
        self.model.to(self.device).train()
        self.opt = build_optimizer(self.model, a, self.to_ckpt, self.shards)
        unpadded = padding_rows_trained(self.model, self.opt) if self.shards is None else []
        if unpadded:
            self.model_source += f"; padding_idx of {', '.join(unpadded)}: the run trained the row config.json names (its exp_avg_sq is not 0 there)"
        self.precision = precision
        self.loss_fn = loss_fn
        self.labels = labels
        self.call = None
        self.aux: torch.Tensor | None = None  # the last forward's auxiliary loss term (MoE)
        self.router: RouterFigures | None = None  # the last probed forward's routing (MoE)
        self.router_modules = router_modules(self.model)
        # Gates that route under a capacity (a trainer's MoE layers, `routers.router_gates`):
        # their tokens reach the experts in capacity buffers, not in the batch's rows, so the
        # per-sample gradient (which reads each linear's input per row) leaves the experts out.
        self.gates = router_gates(self.model)
        if self.gates is not None:
            self.model_source += f"; {len(self.gates.names)} MoE gates routing under a capacity: their load-balancing losses x the model's router_aux_loss_coef added to the loss, the experts left out of the per-sample gradient (their inputs are capacity buffers)"
        # bf16 parameters on fp32 masters in one process (FSDP2 casts them under torchrun).
        self.bf16_params = (
            mp.BF16Params([p for _, p in self.model.named_parameters() if p.requires_grad])
            if precision == "bf16-params" and self.shards is None
            else None
        )
        # Megatron --bf16: each micro-batch's bf16 gradient summed in fp32 (`_regrad_micro`).
        self.micro_fp32 = mp.fp32_micro_batches(a) if self.bf16_params is not None else None
        if first is not None:  # the calling convention, from the window's first batch
            check_vocab(self.model, first[1], first[0], self.vocab)
            self.call = self._detect_call(first[1])
        self.skip_rule = skip_rule  # OLMo-core's SkipStepAdamW: the steps it skipped
        # fp16: the run's loss scale (precision.LossScaler); without a plan, the
        # checkpoint's scaler state or GradScaler's default start.
        self.loss_scaler = (
            mp.LossScaler(self.device, scale_plan or mp.scale_plan(a, None, [a.step or 0], {}, {}))
            if precision == "fp16"
            else None
        )
        self.probe = ModuleProbe(self.model, self.device, self.shards)
        self.probe.once = cfg.checkpoint_activations
        # rides on the probe's hooks; in one process its linears form their own weight
        # gradients where that is cheaper than Gram matrices (`PerSampleGrad` fused)
        self.psg = PerSampleGrad(self.model, self.probe, fused=self.shards is None)
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._group_of = {id(p): g for g in self.opt.param_groups for p in g["params"]}
        self._saved = {  # each parameter's saved param group: the index of its LR (`step`)
            id(p): a.optimizer.hyper[a.aliases.get(k := self.to_ckpt(n), k)].index
            for n, p in self.params
        }
        self._grad_view: tuple | None = None  # `_with_grad`'s lookups, for one set of params
        self._counts = paramstats.StepCounts()  # the optimizer's step counts, read each step
        self._state_view: tuple | None = None  # `_states`' lookups

    @property
    def labels_shifted(self) -> bool:
        return self.labels.shifted

    def _detect_call(self, batch: dict[str, torch.Tensor]) -> CallConvention:
        """How the run's trainer calls this model (`conventions.detect_call`), from one
        forward of the first batch (no gradients, before the probes are attached)."""
        on = {k: v.to(self.device) for k, v in self.ranks.my_rows(batch).items()}
        try:
            with torch.no_grad(), self._compute(self.precision):
                return detect_call(self.model, on, self.labels.shifted)
        finally:
            if self.bf16_params is not None:
                self.bf16_params.restore()
            if self.shards is not None:
                # A no-grad forward leaves FSDP2's root unsharded; under a bf16 policy the
                # next backward then never hands the root's gradients to its fp32 shards.
                distributed.reshard(self.model)

    def _forward(self, batch: dict[str, torch.Tensor], precision: str) -> torch.Tensor:
        """The logits of every position [B, T, V], the model called as its trainer calls it."""
        assert self.call is not None
        if self.gates is not None:
            self.gates.reset()
        with self._compute(precision):
            out = call_model(self.model, self.call, batch, self.labels.shifted)
        if self.gates is not None:  # the gates' own losses and routing (`routers.gate_aux`)
            calls = self.gates.calls()
            self.aux = gate_aux(self.model, calls)
            if self.probe.enabled:
                self.router = gate_figures(calls)
        elif isinstance(out, torch.Tensor):
            self.aux = None
        else:
            # A Mixture-of-Experts model's own auxiliary loss, added to the loss as it adds it
            # (`routers.aux_term`), and its routing when the probes are on (`routers`).
            self.aux = aux_term(
                self.model,
                out,
                batch.get("attention_mask"),
                self._micro_parts(batch["input_ids"].shape[0]),
                summed=self.loss_norm.kind == "targets",
            )
            if self.probe.enabled:
                self.router = router_figures(
                    self.model, out, batch.get("attention_mask"), self.router_modules
                )
        if isinstance(out, torch.Tensor):
            return out
        return out.logits if self.call.output == "object" else out[0]

    def _micro_parts(self, rows: int) -> list[tuple[int, int]] | None:
        """The row ranges of the step's micro-batches in this pass (`micro_batch_size`), where
        the step had several: a MoE model's auxiliary loss is per micro-batch (`aux_term`)."""
        mbs = self.micro_batch_size
        if not mbs or mbs >= rows:
            return None
        return [(i, min(i + mbs, rows)) for i in range(0, rows, mbs)]

    def _loss(
        self, batch: dict[str, torch.Tensor], precision: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the step's loss as the trainer averaged it (its rows' token
        losses over the whole batch's denominator, so the ranks' shares sum to the loss;
        one process: the loss), and each of its rows' mean token loss."""
        full = batch
        batch = self.ranks.my_rows(batch)
        # the rows this rank's forward sees (under torchrun, its share of the batch)
        self.probe.rows = self.psg.rows = batch["input_ids"].shape[0]
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
        # tok is already 0 wherever mask is (cross_entropy's ignore_index, per_token_loss's
        # attention mask; NaN times 0 stays NaN either way): no product with the mask
        self.row_tokens = mask.sum(1)
        per_sample = tok.sum(1) / self.row_tokens.clamp_min(1)
        loss = self._share(tok, mask, full, shifted)
        if self.aux is not None:  # each rank's term, averaged over the ranks as DDP does
            loss = loss + self.aux.to(loss.device) / self.ranks.world
        self.logit_stats = _logit_figures(logits.detach())
        return loss, per_sample

    def _compute(self, precision: str) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision: autocast, or the weights cast to bf16 (bf16-params)."""
        if precision == "bf16-params" and self.shards is None:
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
        bounds = [(i, min(i + mbs, rows)) for i in range(0, rows, mbs)]
        keep, probing = (self.row_tokens, self.logit_stats), self.probe.enabled
        total = self.row_tokens.sum().clamp_min(1)
        n = len(bounds)
        acc: list[torch.Tensor | None] = [None] * len(bp.params)
        self.opt.zero_grad(set_to_none=True)
        self.probe.enabled = False
        try:
            for lo, hi in bounds:
                part = {
                    k: v[lo:hi]
                    if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == rows
                    else v
                    for k, v in batch.items()
                }
                loss, _ = self._loss(part, "bf16-params")
                share = (
                    1.0 / n if kind == "micro" else self.row_tokens.sum() / total
                )  # its part of the step's loss
                (loss * share).backward()
                acc = bp.accumulate(acc)
        finally:
            bp.restore()
            self.probe.enabled = probing
            self.row_tokens, self.logit_stats = keep
        for p, g in zip(bp.params, acc, strict=True):
            p.grad = g

    def _share(
        self, tok: torch.Tensor, mask: torch.Tensor, full: dict[str, torch.Tensor], shifted: bool
    ) -> torch.Tensor:
        """This rank's share of the step's loss as its trainer averaged it
        (`trainer_loss_norm`): its token losses `tok` over the whole batch's denominator,
        counted from the global batch `full` every rank holds."""
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        labels = full.get("labels", full["input_ids"])
        rows = labels.shape[0]
        if kind == "labels" and not shifted:
            return tok.sum() / (labels >= 0).sum().clamp_min(1).to(tok.device)
        mbs = self.micro_batch_size
        if kind == "micro" and mbs and mbs < rows:
            # The mean over the step's micro-batches of each one's mean: this rank's
            # micro-batches' mean, weighted by its share of them.
            parts = [
                t.sum() / m.sum().clamp_min(1)
                for t, m in zip(tok.split(mbs), mask.split(mbs), strict=True)
            ]
            return (
                torch.stack(parts).mean() * (len(parts) / -(-rows // mbs))
                if parts
                else tok.sum() * 0
            )
        if self.loss_fn is not None:
            count = torch.tensor(rows * tok.shape[1])
        else:
            targets = (labels if shifted else labels[:, 1:]) >= 0
            if "attention_mask" in full:
                am = full["attention_mask"] if shifted else full["attention_mask"][:, 1:]
                targets = targets & (am != 0)
            count = targets.sum()
        return tok.sum() / count.clamp_min(1).to(tok.device)

    def probe_pass(self, batch: dict[str, torch.Tensor], precision: str) -> PassStats:
        """Forward + backward with probes, no update (the fp32 reference pass)."""
        self.probe.reset()
        loss, _ = self._loss(batch, precision)
        self._backward(loss)
        stats = self.probe.collect()
        self.opt.zero_grad(set_to_none=True)
        return stats

    def evaluate(
        self, batch: dict[str, torch.Tensor], precision: str | None = None
    ) -> tuple[float, float]:
        """(loss, pre-clip grad norm) of a batch at the current state; no update, no probes
        (`precision`: another than the session's, to test what the run used)."""
        self.probe.enabled = False
        try:
            self.opt.zero_grad(set_to_none=True)
            loss, _ = self._loss(batch, precision or self.precision)
            self._backward(loss)
            if (precision or self.precision) == "bf16-params":
                self._regrad_micro(batch)
            grads = [local_tensor(p.grad) for _, p in self.params if p.grad is not None]
            norm = gr.grad_norm(grads)
            # The ranks' loss shares and squared norms, summed (one process: as they are).
            mine = torch.stack([loss.detach().double(), norm.to(loss.device).double().square()])
            total, sq = self.ranks.sum(mine).tolist()
            return total, math.sqrt(sq)
        finally:
            self.opt.zero_grad(set_to_none=True)
            self.probe.enabled = True

    def step(
        self,
        step: int,
        batch: dict[str, torch.Tensor],
        lrs: list[float],
        clip: float | None,
        update: bool = True,
    ) -> tuple[StepRecord, PassStats]:
        for g in self.opt.param_groups:  # a saved group no parameter is in is not rebuilt
            g["lr"] = lrs[self._saved[id(g["params"][0])]]
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
            verdict = (
                ls.settle(step, ls.unscale(self.opt, [p for _, p in self.params]))
                if ls is not None
                else None
            )
            if verdict != "redo":
                break
        self._regrad_micro(batch)
        g = self._gradients(clip, loss, per_sample, batch["input_ids"].shape[0])
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
            skipped, skipped_by = (
                True,
                "optimizer rule",
            )  # SkipStepAdamW: weights, moments and Adam's step stay as they were
        else:
            skipped = not math.isfinite(g.total)
            held = (
                hold_step_counter(self.opt)
                if self.skip_rule is not None and not self.skip_rule.step_increments
                else None
            )
            self.opt.step()
            if held is not None:
                restore_step_counter(self.opt, held)
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
            router=self.router,
        )
        return rec, stats

    def _gradients(
        self, clip: float | None, loss: torch.Tensor, per_sample: torch.Tensor, rows: int
    ) -> GradEvidence:
        """The step's gradient evidence over the ranks (`gradients.Layout`: one gather, one
        host read; one process on CPU: its figures as Python numbers, `Gathered.one`), then
        clipping by the whole gradient's norm (`clip_grad_norm_`'s rule). `rows`: the step's
        global batch."""
        with_grad = [(n, p) for n, p in self.params if p.grad is not None]
        one = self.shards is None  # one process: plain tensors, no shards to take
        grads = (
            [p.grad for _, p in with_grad] if one else [local_tensor(p.grad) for _, p in with_grad]
        )
        norm = gr.grad_norm(grads)
        names, ckpt, numel, groups = self._with_grad(with_grad)
        states = (
            self._states(with_grad)
            if one
            else [local_state(self.opt.state.get(p)) for _, p in with_grad]
        )
        sq = self.psg.sq
        n = per_sample.shape[0]
        head = {
            "loss": loss,
            "logit_absmax": self.logit_stats[0],
            "log_z": self.logit_stats[1],
            "logit_rows": self.logit_stats[2],
            "rows": n,
            "has_grad_sq": float(sq is not None),
            "norm": norm,
        }
        rows_of = {
            "loss": per_sample,
            "grad_sq": sq if sq is not None else per_sample.new_zeros(n),
            "tokens": self.row_tokens,
        }
        # [sum g^2, sum g^2 / v_hat, spikes, finite] per parameter: one C call on CPU, else a
        # dozen ops per block of gradients of one size, no host read (one op per parameter
        # each cost 2x as much at 32 layers: bench/RESULTS.md#replay-step)
        host = (
            paramstats.host_sums(grads, states, groups, self._counts)
            if one and self.device.type == "cpu"
            else None
        )
        if host is not None:  # one process on the host: no packing, no gather
            every = gr.Gathered.one(head, rows_of, host)
        else:
            sums = param_grad_table(grads, states, groups, sums=True).to(self.device)
            layout = gr.Layout(pad=-(-rows // self.ranks.world), params=len(with_grad))
            every = gr.gather(self.ranks, layout, layout.pack(head, rows_of, sums))
        ev = every.evidence(names, numel, ckpt)
        gr.clip_grads([p for _, p in with_grad], clip, ev.total, norm)
        return ev

    def _with_grad(
        self, with_grad: list[tuple[str, nn.Parameter]]
    ) -> tuple[list[str], list[str], list[int], list[dict]]:
        """The model names, checkpoint names, sizes and optimizer groups of the parameters
        that have a gradient, looked up once per such set: every step of a window has the
        same set, and the checkpoint-name lookup is a Python call per parameter."""
        # (every parameter, the usual step: a key without a Python call per parameter)
        key = None if len(with_grad) == len(self.params) else tuple(id(p) for _, p in with_grad)
        if self._grad_view is None or self._grad_view[0] != key:
            names = [n for n, _ in with_grad]
            self._grad_view = (
                key,
                names,
                [self.to_ckpt(n) for n in names],
                [p.numel() for _, p in with_grad],
                [self._group_of[id(p)] for _, p in with_grad],
            )
        return self._grad_view[1:]

    def _states(self, with_grad: list[tuple[str, nn.Parameter]]) -> list[dict]:
        """The optimizer's state of each of these parameters ({} where it has none), kept
        while the set of parameters (`_with_grad`'s view, looked up just before) and the
        optimizer's state mapping are the same, with as many entries: torch's optimizers
        update a parameter's state in place, create it on the parameter's first step (one
        more entry) and replace the mapping on `load_state_dict`. Each lookup is a Python
        call (a tensor's hash)."""
        st, view = self.opt.state, self._grad_view
        kept = self._state_view
        if kept is not None and kept[0] is view and kept[1] is st and kept[2] == len(st):
            return kept[3]
        # (the optimizer's own dict where it has one, even empty, so that one it fills
        # later is seen; a new {} only where it has none: making one adds an entry)
        got = [st.get(p) for _, p in with_grad]
        states = [x if x is not None else {} for x in got]
        self._state_view = (view, st, len(st), states)
        return states

    def reset_optimizer(self) -> None:
        """A fresh optimizer from here on (a resume that lost its state): every parameter's
        state dropped, so that the next step initialises it as the optimizer's first does."""
        for o in getattr(self.opt, "opts", [self.opt]):
            o.state.clear()
        self._state_view = None

    def close(self) -> None:
        self.probe.remove()
        self.psg.remove()
        if self.gates is not None:
            self.gates.remove()


# Logits up to which the C kernel (one thread) measures them even where torch has several
# threads (about 1 ms of its work); past it, only where torch has one.
_LOGITS_ONE_THREAD = 1 << 20


def _logit_figures(lg: torch.Tensor) -> tuple[torch.Tensor | float, ...]:
    """[max |logit|, mean log Z, positions] of a pass's logits (the ranks' means merge
    weighted): on CPU by one C call (`fused.Kernels.logit_figures`, the mean rounded to
    fp32 as torch's), else six torch ops on the logits' device, no host read."""
    kernels = fused.load() if lg.device.type == "cpu" else None
    if kernels is not None and (lg.numel() <= _LOGITS_ONE_THREAD or torch.get_num_threads() == 1):
        got = kernels.logit_figures(lg)
        if got is not None:
            top, total, rows = got
            return top, array("f", [total / rows])[0], rows  # the mean rounded to fp32
    with torch.no_grad():
        lo, hi = torch.aminmax(lg) if lg.numel() else (lg.new_zeros(()), lg.new_zeros(()))
        lse = torch.logsumexp(lg.float(), -1)
        absmax = torch.maximum(-lo.float(), hi.float())
        return absmax, lse.mean(), lse.new_tensor(lse.numel())


def logit_figures(lg: torch.Tensor) -> tuple[float, float]:
    """(max |logit|, mean log Z) of a pass's logits on the host: what `history` follows per
    checkpoint, measured as the replay measures each step's."""
    top, log_z, _ = _logit_figures(lg.detach())
    return float(top), float(log_z)


def check_vocab(
    model: nn.Module, batch: dict[str, torch.Tensor], step: int, vocab: int | None = None
) -> None:
    """A token id the model's embedding cannot index is bad input, said before any forward
    (`vocab`: the embedding's size, where the caller has it: `Session.vocab`)."""
    vocab = _vocab_size(model) if vocab is None else vocab
    ids = batch["input_ids"]
    if vocab is None or not ids.numel():
        return
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if hi >= vocab or lo < 0:
        bad = hi if hi >= vocab else lo
        raise ForensicsError(
            f"batch of step {step}: token id {bad} outside the model's vocabulary of {vocab}"
        )


def _vocab_size(model: nn.Module) -> int | None:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None
