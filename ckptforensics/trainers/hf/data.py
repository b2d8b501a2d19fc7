"""Batches of an HF Trainer run rebuilt from its own data pipeline (`--data`), not a batch log.

The Trainer's order is a function of what the run recorded: its sampler (a
`RandomSampler` that accelerate makes seedable: epoch e is drawn from a generator seeded
with `data_seed` (else the seed the Trainer set, `seed`) + e), the per-device batch size,
gradient accumulation and `dataloader_drop_last` (`training_args.bin`, read inertly).
transformers' own `Trainer` builds that dataloader here (its column removal, sampler and
collator), so the order is the library's, not a copy of it; the sampler's indices are
walked to step s without loading, collating or computing the batches before it.

The collator is the run's: `--collator`, else each standard one in turn (the run records
none; the tokenizer the Trainer saved beside the checkpoint gives the pad id), and the
replay keeps the first whose first step lands on the log (`window.choose_batches`). The
rebuilt batches are checked before they are trusted: the first replayed step's loss, from
*before*, must match the logged loss of that step (`require_rebuilt_match`).

The collator candidates are `replay.hfcollators`'s; the walk from optimizer step to dataset
indices and the step's collated batch are `replay.hfsteps`'s.
"""

from __future__ import annotations

import inspect
import logging
import tempfile
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.callables import load_callable
from ckptforensics.core.paths import resolve_recorded
from ckptforensics.formats.batches import BatchError, BatchSource
from ckptforensics.trainers.base import (
    REBUILT_GRAD_RTOL,
    REBUILT_LOSS_RTOL,
    require_rebuilt_match,
)
from ckptforensics.trainers.hf.collators import (
    STANDARD_COLLATORS,
    ActiveCollator,
    Collator,
    given_collator,
    standard_collators,
)
from ckptforensics.trainers.hf.steps import StepPlan

__all__ = [
    "trainer_batches",
    "require_rebuilt_match",
    "REBUILT_LOSS_RTOL",
    "REBUILT_GRAD_RTOL",
    "STANDARD_COLLATORS",
    "Collator",
]

log = logging.getLogger(__name__)

# TrainingArguments fields that shape the training dataloader's order and batches.
_DATA_FIELDS = (
    "seed", "data_seed", "per_device_train_batch_size", "gradient_accumulation_steps", "dataloader_drop_last",
    "train_sampling_strategy", "group_by_length", "length_column_name", "remove_unused_columns", "label_names",
)  # fmt: skip


def open_dataset(spec: str) -> Any:
    """`--data`: a `datasets` dataset saved with `save_to_disk` (a DatasetDict's `train`
    split), or `module:function()` returning the training dataset."""
    path = Path(spec)
    if path.exists():
        try:
            import datasets
        except ImportError:
            raise BatchError(
                "--data DIR needs the datasets package (pip install 'ckptforensics[hf]')"
            ) from None
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise BatchError(
                f"--data {spec}: not a dataset saved with save_to_disk ({str(e).splitlines()[0][:160]})"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise BatchError(
                    f"--data {spec}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})"
                )
            ds = ds["train"]
        return ds
    if ":" in spec:
        return load_callable(spec, "--data")()
    raise BatchError(f"--data {spec}: no such directory, and not a module:function")


def _arguments(record: dict[str, Any], tmp: str) -> Any:
    """TrainingArguments with the run's data settings; the rest default (nothing is
    trained: output goes to a scratch dir, no reporting, CPU)."""
    from transformers import TrainingArguments

    accepted = set(inspect.signature(TrainingArguments.__init__).parameters)
    kept = {
        k: record[k]
        for k in _DATA_FIELDS
        if k in record and k in accepted and record[k] is not None
    }
    return TrainingArguments(
        output_dir=tmp, report_to=[], use_cpu=True, dataloader_num_workers=0, **kept
    )


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


def _tokenizer(ckpt_dir: Path | None, record: dict[str, Any], data: str) -> tuple[Any, str]:
    """The run's tokenizer and where it was found, else (None, why not).

    The checkpoint dir first (the Trainer saves its processing_class in every
    checkpoint-N), then the run's `output_dir` (where a script's `tokenizer.save_pretrained`
    and the final `save_model` put it), a path recorded relative to the launch directory
    (`paths.resolve_recorded`). Only a fast tokenizer's `tokenizer.json` is read (plain
    JSON; no remote code, no pickles)."""
    places: list[tuple[Path, str]] = []
    if ckpt_dir is not None:
        places.append((ckpt_dir, f"the tokenizer saved in {ckpt_dir.name}"))
        out = record.get("output_dir")
        data_path = Path(data) if Path(data).exists() else None
        found = resolve_recorded(
            out if isinstance(out, str) else None,
            ckpt_dir.parent,
            data_path,
            holds=lambda p: (p / "tokenizer.json").is_file(),
        )
        if found is not None and found.path.absolute() != ckpt_dir.absolute():
            places.append(
                (found.path, f"the tokenizer saved in the run's output_dir ({found.how})")
            )
    for where, label in places:
        if not (where / "tokenizer.json").is_file():
            continue
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(
                str(where), local_files_only=True, trust_remote_code=False
            ), label
        except Exception as e:  # an unreadable tokenizer in untrusted input: the candidates that need it are skipped
            log.warning(
                "%s: the tokenizer does not load (%s: %s)",
                where,
                type(e).__name__,
                str(e).splitlines()[0][:160] if str(e) else "",
            )
    return (
        None,
        "no tokenizer.json in the checkpoint (the Trainer saves its processing_class there) nor in the run's output_dir",
    )


def trainer_batches(
    data: str,
    record: dict[str, Any] | None,
    config: dict[str, Any] | None,
    world_size: int = 1,
    collator: str | None = None,
    ckpt_dir: Path | None = None,
) -> list[BatchSource]:
    """The batch of every optimizer step, as the run's Trainer drew it from `data`: one
    candidate source per collator to try, in order (one when `collator` is given).

    Args:
        data: `--data` (a `save_to_disk` dir or `module:function`).
        record: the run's TrainingArguments fields (training_args.bin, inert).
        config: the checkpoint's config.json (its `architectures` name the model class,
            whose forward signature decides the columns the Trainer keeps).
        world_size: processes the run trained on (one `rng_state_<rank>.pth` each). With
            several, accelerate hands process r the sampler's micro-batches r, r + W, ...
            (`BatchSamplerShard`); the step's global batch is every process's micro-batches,
            process 0's first (what a torchrun replay's rank blocks take back apart).
        collator: `--collator module:obj`, the collator the run used; None: the standard
            ones (`STANDARD_COLLATORS`), the first whose first step lands on the log kept
            (`window.choose_batches`).
        ckpt_dir: the checkpoint dir, where the Trainer saved the run's tokenizer.

    Each candidate's `get` raises `BatchError` when its collator cannot collate the rows
    (rows of varying length under `default_data_collator`, say); its `describe` names it.

    Raises:
        BatchError: no training_args.bin, a multi-process run that normalised its loss
            per process, or unreadable data.
    """
    if not record:
        raise BatchError(
            "--data needs the run's training_args.bin in the checkpoint (the batch size, seed and accumulation)"
        )
    if world_size > 1 and record.get("average_tokens_across_devices") is False:
        raise BatchError(
            f"this run trained on {world_size} processes with average_tokens_across_devices=False: each process divided its loss by its own "
            "tokens, which a replay of the global batch does not reproduce; pass --batch"
        )
    try:
        from transformers import Trainer
    except ImportError:
        raise BatchError("--data needs transformers (pip install 'ckptforensics[hf]')") from None
    ds = open_dataset(data)
    if not hasattr(ds, "__len__"):
        raise BatchError(
            f"--data {data}: an iterable dataset has no sampler to rebuild; pass --batch"
        )
    tok, tok_src = _tokenizer(ckpt_dir, record, data)
    collators = (
        [given_collator(collator, tok, tok_src)] if collator else standard_collators(tok, tok_src)
    )
    active = ActiveCollator()
    state = torch.random.get_rng_state()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = _arguments(record, tmp)
            trainer = Trainer(
                model=_Signature(_model_forward(config)),
                args=args,
                train_dataset=ds,
                data_collator=active,
            )
            loader = trainer.get_train_dataloader()
        except (TypeError, ValueError, KeyError) as e:
            raise BatchError(
                f"--data {data}: the Trainer cannot build the run's dataloader ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
            ) from None
        finally:
            torch.random.set_rng_state(state)
    accum = int(record.get("gradient_accumulation_steps") or 1)
    plan = StepPlan(loader, accum, world_size, active)
    procs = f", {world_size} processes" if world_size > 1 else ""
    seed = record.get("data_seed") or record.get("seed")
    out = []
    for c in collators:
        src = BatchSource(
            describe=f"{data} (rebuilt: the Trainer's sampler, seed {seed}{procs}; collator {c.name})",
            get=partial(plan.batch, collator=c),
        )
        src.micro_batch_size = int(record.get("per_device_train_batch_size") or 8)
        src.rebuilt = True
        src.sample_ids = plan.ids
        src.collator = c.short or c.name
        out.append(src)
    if not collator and tok is None:
        out[0].describe += f" (the tokenizer-based collators were not tried: {tok_src})"
    return out
