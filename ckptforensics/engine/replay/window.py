"""The replay's plan, resolved once from the run's files: the window's steps, its batches
(logged or rebuilt), LR per step and group, clipping candidates, precision, loss; and one
run of the window under it. What a trainer adds (its batches from `--data`, its clip) is
asked of its framework (trainers/).

Over 400 lines: the plan's resolution and the collator choice evaluate the same `Plan`
(a candidate's first step is a session of it), and split they would pass it back and forth."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptforensics.checkpoints import open_checkpoint, open_pair
from ckptforensics.core.errors import ForensicsError, doing
from ckptforensics.core.stats import LOSS_FOLLOW
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.compare import compare_after
from ckptforensics.engine.replay.conventions import CallConvention, LabelConvention, settle_labels
from ckptforensics.engine.replay.model import (
    LossNorm,
    load_callable,
    set_padding_rows,
)
from ckptforensics.engine.replay.records import ReplayConfig, ReplayResult
from ckptforensics.engine.replay.rowstats import window_row_stats
from ckptforensics.engine.replay.session import Session, check_vocab
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.batches import BatchSource, open_batches, with_rows
from ckptforensics.logs import find_metrics, group_lrs, log_dirs, read_metrics
from ckptforensics.trainers import SkipRule, hook, open_dataset, require_rebuilt_match, skip_rule
from ckptforensics.trainers.settings import run_settings

__all__ = ["Plan", "plan", "choose_batches", "run_window", "run_precision", "optimizer_name"]

log = logging.getLogger(__name__)


def run_precision(cfg: ReplayConfig, ckpt: Checkpoint) -> tuple[str, str]:
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

    found = next(
        (f for f in (find_metrics(d) for d in log_dirs(cfg.before)) if f is not None), None
    )
    if found is None and cfg.batch is not None:
        # A flight recorder's directory (or a black box inside one) keeps the run's log too.
        for d in (Path(cfg.batch), Path(cfg.batch).parent):
            if (d / "metrics.jsonl").is_file():
                return d / "metrics.jsonl"
    return found


def _lr_plan(
    steps: list[int], ckpt: Checkpoint, batches: BatchSource, logged: dict[int, dict[str, float]]
) -> tuple[dict[int, list[float]], str]:
    """LR per step and group: batch log -> training log -> constant from *before*."""
    assert ckpt.optimizer is not None
    base = [g.lr for g in ckpt.optimizer.groups]
    if all(s in batches.lr for s in steps):
        return {
            s: batches.lr[s] if len(batches.lr[s]) == len(base) else [batches.lr[s][0]] * len(base)
            for s in steps
        }, "batch log /lr"
    per_group = {s: group_lrs(logged.get(s, {}), len(base)) for s in steps}
    if all(v is not None for v in per_group.values()):
        return {
            s: list(v) for s, v in per_group.items() if v is not None
        }, "training log, LR per group"
    if all("lr" in logged.get(s, {}) for s in steps):
        # A single logged LR: groups keep the ratio to it they had at *before*.
        ref = logged[steps[0]]["lr"]
        ratios = [b / ref if ref > 0 else 1.0 for b in base]
        return {
            s: [logged[s]["lr"] * r for r in ratios] for s in steps
        }, "training log lr (group ratios from before)"
    return {s: list(base) for s in steps}, "constant: the LR stored in before"


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
    skip: SkipRule | None = None  # an optimizer that skips steps (OLMo-core)
    # tied embeddings' padding rows as calibrated on the log (`settle.settle_padding`)
    padding: dict[str, int | None] | None = None
    padding_source: str = ""
    # A variant's fresh optimizer from this step on (`variants`: a resume that lost its state).
    fresh_from: int | None = None

    def config(self, clip: float | None, clip_source: str) -> dict[str, dict[str, Any]]:
        """replay.config: every assumption with its source (the report states it: replay.config)."""
        cfg = self.cfg
        return {
            "precision": {"value": self.precision, "source": self.precision_source},
            **(
                {"loss_scale": self.scale.describe()}
                if self.scale is not None and self.precision == "fp16"
                else {}
            ),
            "lr": {"value": {s: self.lrs[s] for s in self.steps}, "source": self.lr_source},
            "clip": {"value": clip, "source": clip_source},
            "loss": {
                "value": cfg.loss
                or f"causal LM cross-entropy on the logits; {self.loss_norm.source if self.loss_norm else 'mean over target tokens'}",
                "source": "--loss"
                if cfg.loss
                else (
                    "the run's trainer"
                    if self.loss_norm and self.loss_norm.kind != "targets"
                    else "default"
                ),
            },
            "labels": {"value": self.labels.describe(), "source": self.labels.source},
            "call": {
                "value": self.call.describe if self.call else None,
                "source": "the forward's signature and one forward of the first batch; checked on the first step against the log",
            },
            "optimizer": (
                self.skip.config()
                if self.skip is not None
                else {
                    "value": optimizer_name(self.a)
                    + (
                        f", fresh from step {self.fresh_from}"
                        if self.fresh_from is not None
                        else ""
                    ),
                    "source": "checkpoint optimizer state (its family's own class)"
                    + (
                        "; dropped at the resume the step counters show"
                        if self.fresh_from is not None
                        else ""
                    ),
                }
            ),  # fmt: skip
            "model": {
                "value": self.model_source or cfg.model or "config.json",
                "source": _model_source(cfg.model, self.model_source),
            },
            "batches": {
                "value": self.batches.describe,
                "source": "--data, rebuilt; the first replayed step's loss and grad norm match the log"
                if self.batches.rebuilt
                else "--batch",
            },
            "metrics": {
                "value": str(self.metrics_file) if self.metrics_file else None,
                "source": "discovered"
                if self.metrics_file and cfg.metrics is None
                else "--metrics",
            },
            **(
                {"distributed": {"value": ranks.describe(), "source": "torchrun"}}
                if (ranks := distributed.current()) is not None
                else {}
            ),
            **(
                {
                    "activations": {
                        "value": "recomputed per block in the backward pass",
                        "source": "--checkpoint-activations",
                    }
                }
                if cfg.checkpoint_activations
                else {}
            ),
        }

    def baseline(self) -> dict[int, dict[str, float]]:
        """The run's own logged history, up to 128 steps before the window (OLMo-core's window)."""
        first = self.steps[0]
        return {s: self.logged[s] for s in range(first - 128, first) if s in self.logged}

    def following(self) -> dict[int, dict[str, float]]:
        """The run's logged steps right after the window, as many as a signal's loss may take
        to follow it (`LOSS_FOLLOW`), up to the first step the log lacks."""
        out: dict[int, dict[str, float]] = {}
        for s in range(self.steps[-1] + 1, self.steps[-1] + 1 + LOSS_FOLLOW):
            if s not in self.logged:
                break
            out[s] = self.logged[s]
        return out

    def session(self) -> Session:
        # Under torchrun each rank reads its own rows: a rank that cannot stops them all.
        first = (self.steps[0], self.batches.batch(self.steps[0]))
        sess = distributed.agree(
            distributed.current(),
            lambda: Session(
                self.cfg,
                self.a,
                self.precision,
                self.loss_fn,
                self.labels,
                self.batches.micro_batch_size,
                first,
                self.scale,
                self.skip.fresh() if self.skip is not None else None,
            ),  # fmt: skip
        )
        if self.padding:
            set_padding_rows(sess.model, self.padding)
        sess.model_source += self.padding_source
        self.model_source, self.loss_norm, self.call = sess.model_source, sess.loss_norm, sess.call
        return sess


def optimizer_name(a: Checkpoint) -> str:
    """The rebuilt optimizer's classes, as `replay.config` states them."""
    if a.optimizer is None:
        return "none"
    names = {
        "adam": "AdamW",
        "lion": "lion_pytorch.Lion",
        "muon": "torch.optim.Muon",
        "sgd": "torch.optim.SGD",
        "adam8bit": "bitsandbytes.optim.AdamW8bit",
    }
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
    a, b = (
        open_pair(cfg.before, cfg.after)
        if cfg.after is not None
        else (open_checkpoint(cfg.before), None)
    )
    if a.step is None:
        raise ForensicsError(f"{cfg.before}: the checkpoint does not record its step; pass --step")
    if steps is None:
        if b is not None:
            if b.step is None or b.step <= a.step:
                raise ForensicsError(
                    f"{cfg.after}: its step ({b.step}) must come after before's ({a.step})"
                )
            steps = list(range(a.step + 1, b.step + 1))
        else:
            steps = [cfg.step if cfg.step is not None else a.step + 1]
    candidates = _batches(cfg, a)
    batches = candidates[0]
    # Several candidates (the collators an HF run may have used): the window and its labels
    # once one is chosen (`choose_batches`).
    window = (
        [batches.batch(s) for s in steps] if len(candidates) == 1 else []
    )  # fail early on a missing step
    labels = settle_labels(window, batches.labels_shifted, cfg.labels, batches.describe)
    mfile = _metrics_file(cfg)
    logged = read_metrics(mfile) if mfile is not None else {}
    precision, psrc = run_precision(cfg, a)
    if a.optimizer is None and a.pending_optimizer is not None:
        raise ForensicsError(
            f"{a.pending_optimizer.source}: optimizer ids map ambiguously ({', '.join(sorted(a.pending_optimizer.ambiguous)[:3])} ...); pass --after so the pair's updates settle the mapping"
        )
    if a.optimizer is None:
        raise ForensicsError(
            f"{cfg.before}: no optimizer state; replay needs it to reproduce the update"
        )
    lrs, lsrc = _lr_plan(steps, a, batches, logged)
    loss_fn = load_callable(cfg.loss, "--loss") if cfg.loss else None
    clips: list[tuple[float | None, str]]
    if cfg.clip is not None:
        clips = [(cfg.clip if cfg.clip > 0 else None, "--clip")]
    elif (found := run_settings(a, batches)).clip_source is not None:
        clips = [(found.clip, found.clip_source)]
    elif b is not None:
        clips = [(None, "calibrated: none"), (1.0, "calibrated: 1.0")]
    elif sum(s in logged for s in steps) >= 2:  # the loss of a step after the first shows the clip
        clips = [
            (None, "calibrated against the log: none"),
            (1.0, "calibrated against the log: 1.0"),
        ]
    else:
        clips = [(None, "assumed: none (no after and no log to calibrate against)")]
    scale = mp.scale_plan(a, b, steps, batches.loss_scale, logged) if precision == "fp16" else None
    skip = skip_rule(a, logged, steps[0])
    p = Plan(
        cfg,
        a,
        b,
        steps,
        batches,
        lrs,
        lsrc,
        clips,
        precision,
        psrc,
        loss_fn,
        logged,
        mfile,
        labels,
        scale=scale,
        skip=skip,
    )
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

    step = p.steps[0]
    logged = p.logged.get(step)
    if not logged or "loss" not in logged:
        raise ForensicsError(
            f"the rebuilt batches cannot be checked: the log has no loss for step {step} to tell the collators apart; pass --collator or --batch"
        )
    missed: list[str] = []
    session: Session | None = None
    try:
        with torch.random.fork_rng(
            devices=[torch.device(p.cfg.device)] if p.cfg.device == "cuda" else []
        ):
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
                    session = (
                        p.session()
                    )  # the model called as its trainer calls it, from this window
                session.labels = labels
                loss, grad = session.evaluate(window[0])
                try:
                    require_rebuilt_match(step, (loss, grad), logged, p.precision)
                except ForensicsError:
                    missed.append(
                        f"{name}: loss {loss:.4g}"
                        + (f", grad norm {grad:.4g}" if "grad_norm" in logged else "")
                    )
                    continue
                passed = f"; passed over: {'; '.join(missed)}" if missed else ""
                return dataclasses.replace(
                    c, describe=f"{c.describe}: its step {step} lands on the log{passed}"
                )
    finally:
        if session is not None:
            session.close()
    want = f"loss {logged['loss']:.4g}" + (
        f", grad norm {logged['grad_norm']:.4g}" if "grad_norm" in logged else ""
    )
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
            raise ForensicsError(
                f"{cfg.batch}: the log keeps sample ids, not tokens: pass --data (the dataset they index) as well"
            )

        return [with_rows(src, open_dataset(cfg.data), f"--data {cfg.data}")]
    if cfg.data is None:
        raise ForensicsError(
            "pass --batch (the batches the run consumed) or --data (the run's training data: HF Trainer, Megatron and OLMo-core runs)"
        )
    rebuild = hook(a, "batches")  # which trainers' data `--data` rebuilds: trainers/
    found = rebuild(cfg.data, a, cfg.collator) if rebuild is not None else None
    if found is None:
        raise ForensicsError(
            f"{a.path}: --data rebuilds HF Trainer runs' batches; this is a {a.format} checkpoint: pass --batch"
        )
    return found


def run_window(p: Plan, clip: float | None, progress: Callable[[str], None] | None) -> ReplayResult:
    b, steps, batches, lrs, precision = p.b, p.steps, p.batches, p.lrs, p.precision
    session = p.session()
    result = ReplayResult(config={}, precision=precision)
    window = {s: batches.batch(s) for s in steps}
    # each step's rows against the window's other steps, all at once
    row_stats = dict(
        zip(steps, window_row_stats([window[s]["input_ids"].numpy() for s in steps]), strict=True)
    )
    try:
        for s in steps:  # a token id the embedding cannot index: said before any step
            check_vocab(session.model, window[s], s, session.vocab)
        for s in steps:
            if progress is not None:
                progress(f"step {s}")
            batch = window[s]
            if s == p.fresh_from:
                session.reset_optimizer()
            with doing(f"replaying step {s}"):
                if precision != "fp32":
                    result.fp32_passes[s] = session.probe_pass(batch, "fp32")
                rec, stats = session.step(s, batch, lrs[s], clip)
            if batches.sample_ids.get(s):
                rec = dataclasses.replace(rec, sample_ids=tuple(batches.sample_ids[s]))
            result.records.append(rec)
            result.passes[s] = stats
            result.row_stats[s] = row_stats[s]
        if b is not None:
            result.matches = compare_after(session, b, lrs)
    finally:
        session.close()
    return result
