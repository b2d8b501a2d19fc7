"""The flight recorder: what the next incident's replay needs, written as the run trains.

Per step: the batch (token ids, or only sample ids and a dataset fingerprint), the LR of
every param group, the loss scale and whether the step was skipped, the clip norm, the
pre-clip grad norm and the loss, in the batch-log layout `replay` reads (`/step`,
`/input_ids`, `/attention_mask`, `/labels`, `/sample_id`, `/lr`, `/loss_scale`), one SWMR
segment per checkpoint interval and rank (`formats/segments.py`: crash-safe, a ring of the
last `keep` intervals). Every `stats_every` steps, per-parameter gradient norms, update /
weight ratios and Adam's RMS_t go to `metrics.jsonl` as `optim/grad/<param>.norm` columns
(the names `triage` reads), computed on the device with one host read per step. A spike
monitor (record/monitor.py) writes a black box on an alarm and logs the replay command.

    rec = Recorder("run/flight", checkpoint_every=500)
    for step, batch in enumerate(loader, 1):
        rec.on_batch(step, batch)                 # once per micro-batch
        loss = model(**batch).loss; loss.backward()
        rec.after_backward(model)                 # before clipping (after scaler.unscale_)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        rec.after_step(step, optimizer, loss=loss, model=model)   # before scheduler.step()
        scheduler.step(); optimizer.zero_grad()
    rec.close()

Over 400 lines: one `Recorder` whose hooks share its buffers and the batch-log layout; the
trainer adapters are record/hf.py and record/lightning.py.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptforensics.engine.replay.conventions import AGREEMENT, measure_labels
from ckptforensics.formats.segments import Segment, drop_oldest, pad_rows, segment_name
from ckptforensics.record.monitor import Spike, SpikeMonitor

__all__ = ["Recorder", "RecorderConfig"]

log = logging.getLogger(__name__)

_ROW_KEYS = ("input_ids", "attention_mask", "labels")


@dataclass
class RecorderConfig:
    """How much the recorder keeps.

    Attributes:
        every: record every n-th step's batch (1: every step; a replay needs them all).
        stats_every: per-parameter statistics every K steps (10: 1% of steps pay a
            foreach pass over the gradients and Adam state).
        checkpoint_every: the run's checkpoint cadence, which cuts segments (None: call
            `on_checkpoint`, or segments of `segment_steps`).
        segment_steps: a segment's length when the cadence is unknown.
        keep: checkpoint intervals kept (2: the interval a spike falls in and the one
            before it, whose checkpoint is the replay's *before*).
        tokens: keep token ids (False: sample ids and `fingerprint` only, rebuilt by
            `replay --data` from the run's dataset).
        fingerprint: what identifies the dataset the sample ids index (a hash, a path).
        grad_clip: the clip norm the run applies (recorded for the replay).
        micro_batch_size: rows per forward/backward, when steps accumulate gradients.
        replay_args: what the logged replay command needs besides the checkpoints and
            batches (`("--model", "train.py:build_model")` where no config.json says).
        stop_on_spike: the Trainer and Lightning callbacks stop training at an alarm (a
            plain loop gets the Spike back from `after_step` and decides: stop, or skip
            the next step as OLMo-core's SkipStepAdamW does).
    """

    every: int = 1
    stats_every: int = 10
    checkpoint_every: int | None = None
    segment_steps: int = 1000
    keep: int = 2
    tokens: bool = True
    fingerprint: str | None = None
    grad_clip: float | None = None
    micro_batch_size: int | None = None
    replay_args: tuple[str, ...] = ()
    stop_on_spike: bool = False


@dataclass
class _Pending:
    rows: list[dict[str, torch.Tensor]] = field(default_factory=list)
    sample_ids: list[torch.Tensor] = field(default_factory=list)
    grad: torch.Tensor | None = None  # per-parameter grad norms (device)
    names: list[str] | None = None


class Recorder:
    """The training-side flight recorder (see the module docstring).

    Under torchrun each rank records its own rows in its own segments (`rank`, from the
    process group when initialised); `replay` merges the ranks' rows into the global batch
    of each step, rank 0's first (the contiguous split DDP's and FSDP's samplers use).
    Only rank 0 writes `metrics.jsonl` and black boxes.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: RecorderConfig | None = None,
        *,
        monitor: SpikeMonitor | None | bool = True,
        **kw: Any,
    ) -> None:
        self.root = Path(path)
        self.cfg = config or RecorderConfig(**kw)
        self.rank, self.world = _rank_world()
        self.root.mkdir(parents=True, exist_ok=True)
        self.monitor = SpikeMonitor() if monitor is True else (monitor or None)
        self.spikes: list[Spike] = []
        self._seg: Segment | None = None
        self._seg_first: int | None = None
        self._pending = _Pending()
        self._last_scale: float | None = None
        self._last_ckpt: tuple[int, str | None] | None = None
        # The log file lives as long as the recorder (closed in `close`).
        self._metrics = None
        if self.rank == 0:
            self._metrics = open(self.root / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115

    # -- the loop's three calls ------------------------------------------------------

    def on_batch(
        self, step: int, batch: Mapping[str, Any] | torch.Tensor, sample_ids: Any = None
    ) -> None:
        """One micro-batch of `step` (call once per forward). Copies start without a sync."""
        if not self._records(step):
            return
        b = {"input_ids": batch} if isinstance(batch, torch.Tensor) else batch
        if self.cfg.tokens:
            self._pending.rows.append(
                {k: _host(b[k]) for k in _ROW_KEYS if isinstance(b.get(k), torch.Tensor)}
            )
        ids = sample_ids if sample_ids is not None else b.get("sample_id", b.get("idx"))
        if ids is not None:
            self._pending.sample_ids.append(_host(torch.as_tensor(ids)).reshape(-1))

    def after_backward(
        self, model: torch.nn.Module, scale: float | torch.Tensor | None = None
    ) -> None:
        """After the step's last backward, before clipping: the pre-clip grad norm (kept on
        the device) and, on a stats step, each parameter's grad norm. `scale` divides
        gradients still multiplied by a loss scale (call after `scaler.unscale_` instead)."""
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        if not named:
            return
        norms = torch.stack([n.float() for n in torch._foreach_norm([_local(g) for _, g in named])])
        if scale is not None:
            norms = norms / scale
        self._pending.grad = norms
        self._pending.names = [n for n, _ in named]

    def after_step(
        self,
        step: int,
        optimizer: torch.optim.Optimizer,
        *,
        loss: float | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        scaler: Any = None,
        skipped: bool | None = None,
        model: torch.nn.Module | None = None,
        lr: list[float] | None = None,
    ) -> Spike | None:
        """After `optimizer.step()` (and `scaler.update()`), before `scheduler.step()`:
        writes the step. Every device value of the step is read in one host transfer.
        `lr` gives the step's LRs where the scheduler has already moved the optimizer's."""
        p = self._pending
        self._pending = _Pending()
        if not self._records(step):
            return None
        lrs = list(lr) if lr is not None else [float(g["lr"]) for g in optimizer.param_groups]
        vals: list[torch.Tensor] = []
        vals.append(_scalar(loss))
        total = grad_norm
        if total is None and p.grad is not None:
            total = torch.linalg.vector_norm(p.grad)
        vals.append(_scalar(total))
        sc = getattr(scaler, "_scale", None) if scaler is not None else None
        vals.append(
            _scalar(
                sc
                if sc is not None
                else (scaler.get_scale() if scaler is not None and scaler.is_enabled() else None)
            )
        )
        stats_names: list[str] = []
        if step % self.cfg.stats_every == 0 and p.grad is not None and p.names is not None:
            stats = _param_stats(optimizer, model, p.names)
            stats_names = [f"optim/grad/{n}.norm" for n in p.names] + list(stats)
            vals.append(p.grad)
            vals.extend(stats.values())
        dev = next((v.device for v in vals if v.device.type != "cpu"), torch.device("cpu"))
        host = (
            torch.cat([v.reshape(-1).float().to(dev) for v in vals]).cpu().tolist()
        )  # the step's one host read
        loss_v, norm_v, scale_v = host[0], host[1], host[2]
        extra = dict(zip(stats_names, host[3:], strict=False))
        if skipped is None:
            skipped = (not math.isfinite(norm_v)) or (
                self._last_scale is not None
                and math.isfinite(scale_v)
                and scale_v < self._last_scale
            )
        self._last_scale = scale_v if math.isfinite(scale_v) else None
        self._write(step, p, lrs, loss_v, norm_v, scale_v, bool(skipped))
        # Per-group LRs under OLMo-core's names, which `triage` reads (logs._GROUP_LR).
        row = {
            "step": step,
            "loss": loss_v,
            "grad_norm": norm_v,
            "lr": lrs[0],
            **{f"optim/LR (group {i})": v for i, v in enumerate(lrs) if len(lrs) > 1},
        }
        if math.isfinite(scale_v):
            row["loss_scale"] = scale_v
        if skipped:
            row["skipped"] = 1
        row.update(extra)
        if self._metrics is not None:
            self._metrics.write(
                json.dumps(
                    {
                        k: (v if isinstance(v, int) or math.isfinite(v) else str(v))
                        for k, v in row.items()
                    }
                )
                + "\n"
            )
        spike = None
        if self.monitor is not None:
            spike = self.monitor.update(step, loss_v, norm_v if math.isfinite(norm_v) else None)
            if spike is not None:
                self.spikes.append(spike)
                self._blackbox(spike, step, model, optimizer)
        return spike

    def on_checkpoint(self, step: int, path: str | os.PathLike[str] | None = None) -> None:
        """The run saved a checkpoint at `step`: the next step opens a new segment, and the
        checkpoint is the *before* of the replay command a black box logs."""
        self._last_ckpt = (step, None if path is None else str(path))
        self._close_segment()

    def close(self) -> None:
        self._close_segment()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _records(self, step: int) -> bool:
        return step % max(1, self.cfg.every) == 0

    def _write(
        self,
        step: int,
        p: _Pending,
        lrs: list[float],
        loss: float,
        norm: float,
        scale: float,
        skipped: bool,
    ) -> None:
        # `checkpoint_every` cuts segments until the loop reports its checkpoints itself.
        every = self.cfg.checkpoint_every if self._last_ckpt is None else None
        if (
            self._seg is not None
            and self._seg_first is not None
            and every
            and (step - 1) // every != (self._seg_first - 1) // every
        ):
            self._close_segment()
        if self._seg is None:
            # The ring: at most `keep` segments, the one now opened included; the oldest go.
            drop_oldest(self.root, max(0, self.cfg.keep - 1), self.rank)
            self._seg_first = step
            attrs = {
                "rank": self.rank, "world_size": self.world, "grad_clip": self.cfg.grad_clip,
                "micro_batch_size": self.cfg.micro_batch_size or (_rows(p) if self.world > 1 or len(p.rows) > 1 else None), "dataset_fingerprint": self.cfg.fingerprint, "recorder": "ckptforensics.record/1",
                "labels_shifted": _measured_labels(p.rows),
            }  # fmt: skip
            self._seg = Segment(self.root / segment_name(step, self.rank), attrs)
        rows: dict[str, np.ndarray] = {}
        if p.rows:
            for k in p.rows[0]:
                parts = [r[k] for r in p.rows if k in r]
                width = max(x.shape[-1] for x in parts)
                rows[k] = _narrow(torch.cat([pad_rows(x, width, k) for x in parts]).numpy())
        if p.sample_ids:
            rows["sample_id"] = torch.cat(p.sample_ids).long().numpy()
        series = {
            "lr": np.asarray(lrs, dtype=np.float64), "loss": np.float64(loss), "grad_norm": np.float64(norm),
            "loss_scale": np.float64(scale), "skipped": np.int8(skipped),
        }  # fmt: skip
        self._seg.write(step, rows, series)
        if not self.cfg.checkpoint_every and self._seg.n >= self.cfg.segment_steps:
            self._close_segment()

    def _close_segment(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None

    def _blackbox(
        self,
        spike: Spike,
        step: int,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """On an alarm: the recorded batches of the last steps and the current state, in a
        folder the ring never drops, and the replay command to run (logged, and in
        incident.json). The state is *after*; *before* is the last checkpoint the run saved."""
        if self.rank != 0:
            return
        box = self.root / f"blackbox-step{spike.step}"
        box.mkdir(exist_ok=True)
        if self._seg is not None:
            self._seg.flush()
        for f in sorted(self.root.glob("segment-*.h5")):
            shutil.copy2(f, box / f.name)
        state = None
        if model is not None:
            state = box / f"state_step{step}.pt"
            tmp = state.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, state)
        before = self._last_ckpt
        cmd = ["ckptforensics", "replay"]
        if before is not None:
            cmd += ["--before", before[1] or str(before[0])]
        cmd += [
            "--after",
            str(state) if state is not None else "AFTER",
            "--batch",
            str(box),
            *self.cfg.replay_args,
        ]
        info = {"spike": asdict(spike), "recorded_step": step, "command": shlex.join(cmd)}
        tmp = box / "incident.json.tmp"
        tmp.write_text(json.dumps(info, indent=2, default=str))
        os.replace(tmp, box / "incident.json")
        log.warning(
            "spike at step %d (%s); black box %s; run: %s",
            spike.step,
            spike.why,
            box,
            info["command"],
        )


def _narrow(a: np.ndarray) -> np.ndarray:
    """Token ids as int32 (any vocabulary below 2^31, labels' -100 included): half the disk
    of int64; the reader widens them back."""
    if a.dtype == np.int64 and a.size and int(a.min()) >= -(2**31) and int(a.max()) < 2**31:
        return a.astype(np.int32)
    return a


def _measured_labels(rows: list[dict[str, torch.Tensor]]) -> bool | None:
    """Whether the loop hands its model next-token targets, measured on the segment's first
    step as the replay measures it (`replay.conventions`): the log then says what it holds.
    None where the rows do not decide (no labels, or too few positions that tell)."""

    same, nxt, n = measure_labels([r for r in rows if "input_ids" in r and "labels" in r])
    if same is None or not n:
        return None
    return True if nxt >= AGREEMENT else False if same >= AGREEMENT else None


def _rows(p: _Pending) -> int | None:
    """Rows of one forward: under gradient accumulation or torchrun the loss is averaged per
    micro-batch of each rank (the batch log's `micro_batch_size`)."""
    return int(p.rows[0]["input_ids"].shape[0]) if p.rows and "input_ids" in p.rows[0] else None


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy started without waiting (pinned + non_blocking on an accelerator); the
    step's one host read, in `after_step`, orders it before the copy is used."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return t.to("cpu", non_blocking=True)


def _local(g: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient's local shard (FSDP2): each rank records its own shard's norm."""
    return g.to_local() if hasattr(g, "to_local") else g


def _scalar(v: Any) -> torch.Tensor:
    if v is None:
        return torch.tensor([math.nan])
    if isinstance(v, torch.Tensor):
        v = v.detach()
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        return v.reshape(-1)[:1].float()
    return torch.tensor([float(v)])


def _param_stats(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, names: list[str]
) -> dict[str, torch.Tensor]:
    """Per-parameter update / weight ratio and Adam's RMS_t, as device tensors.

    For Adam(W) state (`exp_avg`, `exp_avg_sq`, `step`), the update the step just applied
    is lr * m_hat / (sqrt(v_hat) + eps) (+ lr * wd * w), and RMS_t = sqrt(mean(g^2 / v_hat))
    (StableAdamW, 2304.13013): both from the state after the step, with no copy of the
    weights. Optimizers without that state give none."""
    if model is None:
        return {}
    params = dict(model.named_parameters())
    hyper = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    ratio: list[torch.Tensor] = []
    rms: list[torch.Tensor] = []
    out_names: list[str] = []
    for n in names:
        p = params.get(n)
        st = optimizer.state.get(p) if p is not None else None
        if not st or "exp_avg_sq" not in st or p is None or p.grad is None:
            continue
        g = hyper[id(p)]
        b1, b2 = g.get("betas", (0.9, 0.999))
        t = st.get("step", 1.0)  # torch keeps it a tensor: no host read
        t = _local(t).float() if isinstance(t, torch.Tensor) else t
        v_hat = _local(st["exp_avg_sq"]).float() / (1 - b2**t)
        m_hat = _local(st["exp_avg"]).float() / (1 - b1**t)
        w = _local(p.detach()).float()
        upd = g["lr"] * (
            m_hat / (v_hat.sqrt() + g.get("eps", 1e-8)) + g.get("weight_decay", 0.0) * w
        )
        ratio.append(torch.linalg.vector_norm(upd) / torch.linalg.vector_norm(w).clamp_min(1e-12))
        gr = _local(p.grad).float()
        rms.append((gr.square() / v_hat.clamp_min(g.get("eps", 1e-8) ** 2)).mean().sqrt())
        out_names.append(n)
    if not out_names:
        return {}
    return {
        **{f"optim/update_ratio/{n}": r for n, r in zip(out_names, ratio, strict=True)},
        **{f"optim/rms_t/{n}": r for n, r in zip(out_names, rms, strict=True)},
    }
