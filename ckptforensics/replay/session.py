"""One replay session: the model, optimizer and probes rebuilt from *before*, stepping the
window's batches as the run's trainer did (one process is a world of one; under torchrun
each rank its rows and shards)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ForensicsError
from ..formats.base import Checkpoint
from . import distributed, skipstep
from . import precision as mp
from .conventions import CallConvention, LabelConvention, call_model, detect_call
from .model import (
    build_model,
    build_optimizer,
    load_weights,
    padding_rows_trained,
    trainer_loss_norm,
)
from .probes import ModuleProbe, PassStats, param_grad_stats, param_grad_sums
from .records import GradEvidence, ReplayConfig, StepRecord, local_state, local_tensor
from .samples import PerSampleGrad, per_token_loss

__all__ = ["Session", "check_vocab"]

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
        skip_rule: skipstep.SkipRule | None = None,
    ) -> None:
        self.cfg = cfg
        self.ranks = distributed.current()
        self.device = torch.device(cfg.device) if self.ranks is None else self.ranks.device
        if self.ranks is not None and precision == "fp16":
            # GradScaler's inf check is per rank: ranks could disagree on skipping a step.
            raise ForensicsError(
                "an fp16 (loss-scaled) replay runs in one process for now: run it without torchrun"
            )
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
        self.bf16_params = (
            mp.BF16Params([p for _, p in self.model.named_parameters() if p.requires_grad])
            if precision == "bf16-params" and self.ranks is None
            else None
        )
        # Megatron --bf16: each micro-batch's bf16 gradient summed in fp32 (`_regrad_micro`).
        self.micro_fp32 = mp.fp32_micro_batches(a) if self.bf16_params is not None else None
        if first is not None:  # the calling convention, from the window's first batch
            check_vocab(self.model, first[1], first[0])
            self.call = self._detect_call(first[1])
        self.skip_rule = skip_rule  # OLMo-core's SkipStepAdamW: the steps it skipped
        # fp16: the run's loss scale (precision.LossScaler); without a plan, the
        # checkpoint's scaler state or GradScaler's default start.
        self.loss_scaler = (
            mp.LossScaler(self.device, scale_plan or mp.scale_plan(a, None, [a.step or 0], {}, {}))
            if precision == "fp16"
            else None
        )
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

    def _loss(
        self, batch: dict[str, torch.Tensor], precision: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        loss = (
            self._normalise(masked, mask, labels, shifted)
            if self.ranks is None
            else self._share(masked, mask, full, shifted)
        )
        with torch.no_grad():
            lg = logits.detach()
            lo, hi = torch.aminmax(lg) if lg.numel() else (lg.new_zeros(()), lg.new_zeros(()))
            lse = torch.logsumexp(lg.float(), -1)
            absmax = torch.maximum(-lo.float(), hi.float())
            # One rank: [max |logit|, mean log Z]; ranks: the sum and count to merge.
            self.logit_stats = (
                torch.stack([absmax, lse.mean()])
                if self.ranks is None
                else torch.stack([absmax, lse.sum(), lse.new_tensor(lse.numel())])
            )
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

    def _normalise(
        self, tok: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, shifted: bool
    ) -> torch.Tensor:
        """The step's loss as its trainer averaged it (`trainer_loss_norm`)."""
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        if kind == "labels" and not shifted:
            return tok.sum() / (labels >= 0).sum().clamp_min(1)
        if kind == "micro" and self.micro_batch_size and self.micro_batch_size < tok.shape[0]:
            parts = [
                (t.sum() / m.sum().clamp_min(1))
                for t, m in zip(
                    tok.split(self.micro_batch_size), mask.split(self.micro_batch_size), strict=True
                )
            ]
            return torch.stack(parts).mean()
        return tok.sum() / mask.sum().clamp_min(1)

    def _share(
        self, tok: torch.Tensor, mask: torch.Tensor, full: dict[str, torch.Tensor], shifted: bool
    ) -> torch.Tensor:
        """This rank's share of the step's loss: `_normalise` with the whole batch's
        denominator (counted from the global batch every rank holds)."""
        kind = self.loss_norm.kind if self.loss_fn is None else "targets"
        labels = full.get("labels", full["input_ids"])
        rows = labels.shape[0]
        if kind == "labels" and not shifted:
            return tok.sum() / (labels >= 0).sum().clamp_min(1).to(tok.device)
        if kind == "micro" and self.micro_batch_size and self.micro_batch_size < rows:
            parts = [
                t.sum() / m.sum().clamp_min(1)
                for t, m in zip(
                    tok.split(self.micro_batch_size), mask.split(self.micro_batch_size), strict=True
                )
            ]
            return (
                torch.stack(parts).sum() / -(-rows // self.micro_batch_size)
                if parts
                else tok.sum() * 0
            )
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
            if self.ranks is not None:  # the ranks' loss shares and squared norms, summed
                sq = (
                    torch.stack([g.float().pow(2).sum() for g in grads]).sum()
                    if grads
                    else torch.zeros(())
                )
                total = self.ranks.sum(
                    torch.stack([loss.detach().float().cpu(), sq.double().cpu().float()]).double()
                )
                return float(total[0]), math.sqrt(float(total[1]))
            norm = (
                float(
                    torch.linalg.vector_norm(
                        torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
                    )
                )
                if grads
                else 0.0
            )
            return float(loss.detach()), norm
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
            verdict = (
                ls.settle(step, ls.unscale(self.opt, [p for _, p in self.params]))
                if ls is not None
                else None
            )
            if verdict != "redo":
                break
        self._regrad_micro(batch)
        with_grad = [(n, p) for n, p in self.params if p.grad is not None]
        if self.ranks is None:
            g = self._gradients(with_grad, clip, loss, per_sample)
        else:
            g = self._gradients_ranks(
                with_grad, clip, loss, per_sample, batch["input_ids"].shape[0]
            )
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
                skipstep.hold_step_counter(self.opt)
                if self.skip_rule is not None and not self.skip_rule.step_increments
                else None
            )
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

    def _gradients(
        self,
        with_grad: list[tuple[str, nn.Parameter]],
        clip: float | None,
        loss: torch.Tensor,
        per_sample: torch.Tensor,
    ) -> GradEvidence:
        """The step's gradient evidence in one process, then clipping (one host read)."""
        grads = [p.grad for _, p in with_grad]
        finite = (
            torch.stack([torch.isfinite(g).all() for g in grads]).cpu()
            if grads
            else torch.ones(0, dtype=torch.bool)
        )
        bad = tuple(n for (n, _), ok in zip(with_grad, finite.tolist(), strict=True) if not ok)
        table = (
            torch.stack([self._grad_stats(p) for _, p in with_grad]).cpu().tolist()
            if with_grad
            else []
        )  # one sync
        total = torch.nn.utils.clip_grad_norm_(
            [p for _, p in self.params], clip if clip else float("inf")
        )
        sq = self.psg.sq
        logit_absmax, log_z = self.logit_stats.cpu().tolist()
        return GradEvidence(
            loss=float(loss.detach()),
            total=float(total),
            nonfinite=bad,
            rms={self.to_ckpt(n): row[0] for (n, _), row in zip(with_grad, table, strict=True)},
            rms_t={
                self.to_ckpt(n): row[1]
                for (n, _), row in zip(with_grad, table, strict=True)
                if math.isfinite(row[1])
            },
            spikes={
                self.to_ckpt(n): int(row[2])
                for (n, _), row in zip(with_grad, table, strict=True)
                if row[2] > 0
            },
            sample_loss=tuple(per_sample.detach().float().cpu().tolist()),
            sample_grad_sq=tuple(sq.cpu().tolist()) if sq is not None else None,
            logit_absmax=logit_absmax,
            log_z=log_z,
            sample_tokens=tuple(int(x) for x in self.row_tokens.cpu().tolist()),
        )

    def _gradients_ranks(
        self,
        with_grad: list[tuple[str, nn.Parameter]],
        clip: float | None,
        loss: torch.Tensor,
        per_sample: torch.Tensor,
        rows: int,
    ) -> GradEvidence:
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
        head = torch.cat(
            [
                loss.detach().float().reshape(1),
                self.logit_stats.float(),
                torch.tensor([float(n), float(sq is not None)], device=dev),
            ]
        )
        samples = torch.zeros(3, pad, device=dev)
        samples[0, :n] = per_sample.detach().float()
        if sq is not None:
            samples[1, :n] = sq.float()
        samples[2, :n] = self.row_tokens.float()
        rows = [
            torch.cat(
                [
                    param_grad_sums(
                        local_tensor(p.grad),
                        local_state(self.opt.state.get(p)),
                        self._group_of[id(p)],
                    ),
                    torch.isfinite(local_tensor(p.grad)).all().float().reshape(1),
                ]
            )
            for _, p in with_grad
        ]
        table = torch.stack(rows) if rows else torch.zeros(0, 4, device=dev)
        flat = torch.cat([head, samples.reshape(-1), table.reshape(-1)]).double()
        every = self.ranks.gather(flat).cpu()  # the step's one collective: [W, len(flat)]
        h = len(head)
        heads, smp, tab = (
            every[:, :h],
            every[:, h : h + 3 * pad].reshape(-1, 3, pad),
            every[:, h + 3 * pad :].reshape(self.ranks.world, -1, 4),
        )
        counts = heads[:, 4].long().tolist()
        sums = tab[..., :3].sum(0)  # [P, 3]
        ok = tab[..., 3].amin(0)
        total = float(sums[:, 0].sum().sqrt()) if len(with_grad) else 0.0
        if clip and total > 0:
            coef = clip / (total + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
            if coef < 1:
                torch._foreach_mul_([local_tensor(p.grad) for _, p in with_grad], coef)
        numel = [p.numel() for _, p in with_grad]
        return GradEvidence(
            loss=float(heads[:, 0].sum()),
            total=total,
            nonfinite=tuple(
                nm for (nm, _), good in zip(with_grad, ok.tolist(), strict=True) if not good
            ),
            rms={
                self.to_ckpt(nm): math.sqrt(float(r[0]) / max(k, 1))
                for (nm, _), r, k in zip(with_grad, sums, numel, strict=True)
            },
            rms_t={
                self.to_ckpt(nm): math.sqrt(float(r[1]) / max(k, 1))
                for (nm, _), r, k in zip(with_grad, sums, numel, strict=True)
                if math.isfinite(float(r[1]))
            },
            spikes={
                self.to_ckpt(nm): int(r[2])
                for (nm, _), r in zip(with_grad, sums, strict=True)
                if r[2] > 0
            },
            sample_loss=tuple(
                float(x) for w, c in enumerate(counts) for x in smp[w, 0, :c].tolist()
            ),
            sample_grad_sq=tuple(
                float(x) for w, c in enumerate(counts) for x in smp[w, 1, :c].tolist()
            )
            if bool(heads[:, 5].all())
            else None,
            logit_absmax=float(heads[:, 1].max()),
            log_z=float(heads[:, 2].sum() / heads[:, 3].sum().clamp_min(1)),
            sample_tokens=tuple(
                int(x) for w, c in enumerate(counts) for x in smp[w, 2, :c].tolist()
            ),
        )

    def close(self) -> None:
        self.probe.remove()
        self.psg.remove()


def check_vocab(model: nn.Module, batch: dict[str, torch.Tensor], step: int) -> None:
    """A token id the model's embedding cannot index is bad input, said before any forward."""
    vocab = _vocab_size(model)
    ids = batch["input_ids"]
    if vocab is not None and ids.numel() and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
        raise ForensicsError(
            f"batch of step {step}: token id {bad} outside the model's vocabulary of {vocab}"
        )


def _vocab_size(model: nn.Module) -> int | None:
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    return None
