"""Batches of an HF Trainer run rebuilt from its own data pipeline (`--data`), not a batch log.

The Trainer's order is a function of what the run recorded: its sampler (a
`RandomSampler` that accelerate makes seedable: epoch e is drawn from a generator seeded
with `data_seed` (else the seed the Trainer set, `seed`) + e), the per-device batch size,
gradient accumulation and `dataloader_drop_last` (`training_args.bin`, read inertly).
transformers' own `Trainer` builds that dataloader here (its column removal, sampler and
collator), so the order is the library's, not a copy of it; the sampler's indices are
walked to step s without loading, collating or computing the batches before it.

The rebuilt batches are checked before they are trusted (`engine.check_rebuilt`): the
first replayed step's loss, from *before*, must match the logged loss of that step.
"""

from __future__ import annotations

import inspect
import logging
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

from ..errors import ForensicsError
from .batches import BatchError, BatchSource

__all__ = ["trainer_batches", "require_rebuilt_match", "REBUILT_LOSS_RTOL", "REBUILT_GRAD_RTOL"]

# The first replayed step's loss (and pre-clip grad norm, where logged) from a rebuilt
# batch against the log. The same batch from the same weights lands within float noise
# (fixtures/hf_data_run.py: 2e-7 relative, every step of the window); the fixture's data
# shuffled differently gives another batch 1.1% off in loss: batch-to-batch spread is
# about a percent, so the loss bar is a tenth of it in fp32, and half of it in bf16/fp16,
# whose kernels differ across devices by a few 1e-4. Grad norms spread far more between
# batches (tens of percent) and less across devices: 1%.
REBUILT_LOSS_RTOL = {"fp32": 1e-3, "bf16": 5e-3, "fp16": 5e-3}
REBUILT_GRAD_RTOL = 1e-2

log = logging.getLogger(__name__)

# TrainingArguments fields that shape the training dataloader's order and batches.
_DATA_FIELDS = (
    "seed", "data_seed", "per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_drop_last",
    "train_sampling_strategy", "group_by_length", "length_column_name", "remove_unused_columns", "label_names",
)  # fmt: skip


def _dataset(spec: str) -> Any:
    """`--data`: a `datasets` dataset saved with `save_to_disk` (a DatasetDict's `train`
    split), or `module:function()` returning the training dataset."""
    path = Path(spec)
    if path.exists():
        try:
            import datasets
        except ImportError:
            raise BatchError("--data DIR needs the datasets package (pip install 'ckptforensics[hf]')") from None
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise BatchError(f"--data {spec}: not a dataset saved with save_to_disk ({str(e).splitlines()[0][:160]})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise BatchError(f"--data {spec}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
            ds = ds["train"]
        return ds
    if ":" in spec:
        from .model import load_callable

        return load_callable(spec, "--data")()
    raise BatchError(f"--data {spec}: no such directory, and not a module:function")


def _arguments(record: dict[str, Any], tmp: str) -> Any:
    """TrainingArguments with the run's data settings; the rest default (nothing is
    trained: output goes to a scratch dir, no reporting, CPU)."""
    from transformers import TrainingArguments

    accepted = set(inspect.signature(TrainingArguments.__init__).parameters)
    kept = {k: record[k] for k in _DATA_FIELDS if k in record and k in accepted and record[k] is not None}
    return TrainingArguments(output_dir=tmp, report_to=[], use_cpu=True, dataloader_num_workers=0, **kept)


class _Signature(torch.nn.Module):
    """Stands in for the model in the Trainer: only its `forward` signature is read (the
    columns the Trainer keeps), so the real model need not exist twice."""

    def __init__(self, forward: Any) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        if forward is not None:
            self.forward = types.MethodType(forward, self)  # type: ignore[method-assign]


def _model_forward(config: dict[str, Any] | None) -> Any:
    """The run's model class's `forward`, from config.json's `architectures` (no model built)."""
    names = (config or {}).get("architectures") or []
    try:
        import transformers
    except ImportError:
        return None
    cls = getattr(transformers, names[0], None) if names else None
    return getattr(cls, "forward", None)


def trainer_batches(data: str, record: dict[str, Any] | None, config: dict[str, Any] | None, world_size: int = 1) -> BatchSource:
    """The batch of every optimizer step, as the run's Trainer drew it from `data`.

    Args:
        data: `--data` (a `save_to_disk` dir or `module:function`).
        record: the run's TrainingArguments fields (training_args.bin, inert).
        config: the checkpoint's config.json (its `architectures` name the model class,
            whose forward signature decides the columns the Trainer keeps).
        world_size: processes the run trained on (one `rng_state_<rank>.pth` each). With
            several, accelerate hands process r the sampler's micro-batches r, r + W, ...
            (`BatchSamplerShard`); the step's global batch is every process's micro-batches,
            process 0's first (what a torchrun replay's rank blocks take back apart).

    Raises:
        BatchError: no training_args.bin, a multi-process run that normalised its loss
            per process, or unreadable data.
    """
    if not record:
        raise BatchError("--data needs the run's training_args.bin in the checkpoint (the batch size, seed and accumulation)")
    if world_size > 1 and record.get("average_tokens_across_devices") is False:
        raise BatchError(
            f"this run trained on {world_size} processes with average_tokens_across_devices=False: each process divided its loss by its own "
            "tokens, which a replay of the global batch does not reproduce; pass --batch"
        )
    try:
        from transformers import Trainer, default_data_collator
    except ImportError:
        raise BatchError("--data needs transformers (pip install 'ckptforensics[hf]')") from None
    ds = _dataset(data)
    if not hasattr(ds, "__len__"):
        raise BatchError(f"--data {data}: an iterable dataset has no sampler to rebuild; pass --batch")
    state = torch.random.get_rng_state()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = _arguments(record, tmp)
            trainer = Trainer(model=_Signature(_model_forward(config)), args=args, train_dataset=ds, data_collator=default_data_collator)
            loader = trainer.get_train_dataloader()
        except (TypeError, ValueError, KeyError) as e:
            raise BatchError(f"--data {data}: the Trainer cannot build the run's dataloader ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
        finally:
            torch.random.set_rng_state(state)
    accum = int(record.get("gradient_accumulation_steps") or 1)
    plan = _StepPlan(loader, accum, world_size)
    procs = f", {world_size} processes" if world_size > 1 else ""
    src = BatchSource(describe=f"{data} (rebuilt: the Trainer's sampler, seed {record.get('data_seed') or record.get('seed')}{procs})", get=plan.batch)
    src.micro_batch_size = int(record.get("per_device_train_batch_size") or 8)
    src.rebuilt = True
    src.sample_ids = plan.ids
    return src


class _StepPlan:
    """Optimizer step -> the dataset indices of its micro-batches, epoch by epoch, as the
    Trainer's loop consumes them (accumulating `accum` micro-batches; the last update of
    an epoch takes what is left). With `world` processes, process r takes the sampler's
    micro-batches r, r + world, ... (accelerate's `BatchSamplerShard`) and an update is
    every process's `accum` micro-batches, process 0's first."""

    def __init__(self, loader: Any, accum: int, world: int = 1) -> None:
        self.loader, self.accum, self.world = loader, accum, world
        self.epochs: list[list[list[list[int]] | None]] = []  # epoch -> update -> micro-batch -> indices (None: not rebuilt)
        self.ids: dict[int, list[int]] = {}  # step -> dataset index of each row, as fetched

    def _epoch(self, e: int) -> list[list[list[int]]]:
        while len(self.epochs) <= e:
            n = len(self.epochs)
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(n)
            sampler = self.loader.batch_sampler
            if hasattr(sampler, "sampler") and hasattr(sampler.sampler, "set_epoch"):
                sampler.sampler.set_epoch(n)
            micro = [list(b) for b in sampler]
            if not micro:
                raise BatchError("the rebuilt dataloader is empty (the dataset is smaller than one batch with drop_last)")
            self.epochs.append(self._updates(micro))
        return self.epochs[e]

    def _updates(self, micro: list[list[int]]) -> list[list[list[int]] | None]:
        w = self.world
        if w == 1:
            return [micro[i : i + self.accum] for i in range(0, len(micro), self.accum)]
        # accelerate evens out an epoch whose micro-batches do not split into whole rounds
        # (or whose last one is short) by reusing the epoch's first rows: those last
        # updates are not rebuilt (None), the others are.
        whole = len(micro) // w * w
        if whole and len(micro[whole - 1]) < len(micro[0]):
            whole -= w
        per_rank = [micro[r:whole:w] for r in range(w)]
        n = len(per_rank[0])
        updates: list[list[list[int]] | None] = [[b for r in range(w) for b in per_rank[r][i : i + self.accum]] for i in range(0, n, self.accum)]
        if whole < len(micro):  # the epoch's last update takes what is left, evened out by accelerate
            if n % self.accum:
                updates[-1] = None
            else:
                updates.append(None)
        return updates

    def indices(self, step: int) -> list[list[int]]:
        if step < 1:
            raise BatchError(f"no batch for step {step}: optimizer steps count from 1")
        e, k = 0, step - 1
        while k >= len(self._epoch(e)):
            k -= len(self._epoch(e))
            e += 1
        update = self._epoch(e)[k]
        if update is None:
            raise BatchError(
                f"step {step} is the last update of epoch {e + 1}, whose micro-batches accelerate evened out across the "
                f"{self.world} processes by reusing the epoch's first rows: not rebuilt; pass --batch"
            )
        return update

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        micro = self.indices(step)
        self.ids[step] = [i for idx in micro for i in idx]
        parts = [self.loader.collate_fn([self.loader.dataset[i] for i in idx]) for idx in micro]
        keys = [k for k in ("input_ids", "attention_mask", "labels") if all(k in p for p in parts)]
        width = max(p["input_ids"].shape[1] for p in parts)
        fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {k: torch.cat([_pad(torch.as_tensor(p[k]), width, fill[k]) for p in parts]) for k in keys}


def _pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Right-pad a micro-batch to the step's widest (dynamic padding pads per micro-batch);
    pads carry mask 0 and label -100, so no loss or attention reads them."""
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def require_rebuilt_match(step: int, replayed: tuple[float, float], logged: dict[str, float] | None, precision: str) -> None:
    """The rebuilt batch of the first replayed step must give the loss (and the grad norm,
    where logged) the log recorded; else a one-line error and nothing is diagnosed."""
    loss, grad = replayed
    if not logged or "loss" not in logged:
        raise ForensicsError(f"the rebuilt batches cannot be checked: the log has no loss for step {step}; pass --batch")
    checks = [("loss", loss, logged["loss"], REBUILT_LOSS_RTOL.get(precision, 5e-3))]
    if "grad_norm" in logged:
        checks.append(("grad norm", grad, logged["grad_norm"], REBUILT_GRAD_RTOL))
    for what, mine, theirs, tol in checks:
        if not abs(mine - theirs) <= tol * abs(theirs):
            raise ForensicsError(
                f"the rebuilt batch of step {step} gives {what} {mine:.5g}, the log says {theirs:.5g} (tolerance {tol:.1%}): "
                "the data pipeline differs (dataset, collator, seed or sampler); pass --batch with the batches the run consumed"
            )
