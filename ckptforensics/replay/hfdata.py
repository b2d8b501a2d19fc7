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
"""

from __future__ import annotations

import inspect
import logging
import tempfile
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import ForensicsError
from .batches import BatchError, BatchSource
from .paths import resolve_recorded

__all__ = [
    "trainer_batches",
    "require_rebuilt_match",
    "REBUILT_LOSS_RTOL",
    "REBUILT_GRAD_RTOL",
    "STANDARD_COLLATORS",
    "Collator",
]

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
        from .model import load_callable

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


# The collators of causal-LM Trainer runs, tried in this order when the run does not say
# which it used (transformers 5.24's Trainer records none: training_args.bin is the
# TrainingArguments, and `Trainer._save` writes the model, the processing_class and the args;
# the collator is code). The last two need the run's tokenizer (its pad id and padding side),
# which the Trainer does save beside each checkpoint when it had one (`processing_class`, or
# the collator's own `tokenizer` when there was none).
STANDARD_COLLATORS = (
    "default_data_collator",
    "DataCollatorForLanguageModeling(mlm=False)",
    "DataCollatorWithPadding",
)


@dataclass(frozen=True, slots=True)
class Collator:
    """A collator candidate: what it is (for `replay.config`), the function, and a short
    name (for one-line errors)."""

    name: str
    fn: Callable[[list[dict[str, Any]]], Any]
    short: str = ""


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


def _standard(tok: Any, tok_src: str) -> list[Collator]:
    """`STANDARD_COLLATORS` that can be built: those needing a tokenizer only with one."""
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithPadding,
        default_data_collator,
    )

    out = [Collator("default_data_collator", default_data_collator, "default_data_collator")]
    if tok is None:
        return out
    pad = f"pad id {tok.pad_token_id}, {tok.padding_side} padding; {tok_src}"
    out.append(
        Collator(
            f"DataCollatorForLanguageModeling(mlm=False; {pad})",
            DataCollatorForLanguageModeling(tok, mlm=False),
            "DataCollatorForLanguageModeling(mlm=False)",
        )
    )
    out.append(
        Collator(
            f"DataCollatorWithPadding({pad})",
            DataCollatorWithPadding(tok),
            "DataCollatorWithPadding",
        )
    )
    return out


def _given(spec: str, tok: Any, tok_src: str) -> Collator:
    """`--collator module:obj`: the collator the run passed to `Trainer(data_collator=...)`,
    or a factory whose one required argument is `tokenizer` (or `processing_class`), called
    with the run's tokenizer (`tok_src`: where it was found, or why there is none)."""
    from .model import load_callable

    obj = load_callable(spec, "--collator")
    try:
        required = [
            p.name
            for p in inspect.signature(obj).parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        required = []
    if required not in (["tokenizer"], ["processing_class"]):
        return Collator(f"{spec} (--collator)", obj, f"{spec} (--collator)")
    if tok is None:
        raise BatchError(f"--collator {spec} takes the run's tokenizer: {tok_src}")
    try:
        built = obj(tok)
    except Exception as e:  # the user's factory failing on the run's tokenizer is bad input
        raise BatchError(
            f"--collator {spec}: building it with {tok_src} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        ) from None
    return Collator(
        f"{spec}(tokenizer) (--collator; pad id {tok.pad_token_id}, {tok.padding_side} padding; {tok_src})",
        built,
        f"{spec}(tokenizer) (--collator)",
    )


class _Active:
    """The data_collator the Trainer is built with: it calls whichever candidate is
    collating, so one dataloader (one sampler walk) serves every candidate, each wrapped as
    the Trainer wraps its collator (column removal for non-`datasets` data)."""

    def __init__(self) -> None:
        self.fn: Callable[[list[dict[str, Any]]], Any] | None = None

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        assert self.fn is not None
        return self.fn(features)


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
    collators = [_given(collator, tok, tok_src)] if collator else _standard(tok, tok_src)
    active = _Active()
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
    plan = _StepPlan(loader, accum, world_size, active)
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


class _StepPlan:
    """Optimizer step -> the dataset indices of its micro-batches, epoch by epoch, as the
    Trainer's loop consumes them (accumulating `accum` micro-batches; the last update of
    an epoch takes what is left). With `world` processes, process r takes the sampler's
    micro-batches r, r + world, ... (accelerate's `BatchSamplerShard`) and an update is
    every process's `accum` micro-batches, process 0's first."""

    def __init__(
        self, loader: Any, accum: int, world: int = 1, active: _Active | None = None
    ) -> None:
        self.loader, self.accum, self.world, self.active = loader, accum, world, active
        self.epochs: list[
            list[list[list[int]] | None]
        ] = []  # epoch -> update -> micro-batch -> indices (None: not rebuilt)
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
                raise BatchError(
                    "the rebuilt dataloader is empty (the dataset is smaller than one batch with drop_last)"
                )
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
        updates: list[list[list[int]] | None] = [
            [b for r in range(w) for b in per_rank[r][i : i + self.accum]]
            for i in range(0, n, self.accum)
        ]
        if whole < len(
            micro
        ):  # the epoch's last update takes what is left, evened out by accelerate
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

    def batch(self, step: int, collator: Collator) -> dict[str, torch.Tensor]:
        micro = self.indices(step)
        self.ids[step] = [i for idx in micro for i in idx]
        if self.active is not None:
            self.active.fn = collator.fn
        try:
            parts = [self.loader.collate_fn([self.loader.dataset[i] for i in idx]) for idx in micro]
        except (
            Exception
        ) as e:  # the collator's failure on these rows (its own code): this candidate does not fit
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            name = collator.short or collator.name
            err = BatchError(
                f"collator {name} cannot collate the rows of step {step} ({type(e).__name__}: {msg})"
            )
            err.brief = f"{name} cannot collate ({type(e).__name__}: {msg[:80]})"  # type: ignore[attr-defined]  # for choose_batches' one line
            raise err from None
        if any(not isinstance(p, Mapping) or "input_ids" not in p for p in parts):
            raise BatchError(
                f"collator {collator.short or collator.name} gives no input_ids for step {step}"
            )
        keys = [k for k in ("input_ids", "attention_mask", "labels") if all(k in p for p in parts)]
        width = max(p["input_ids"].shape[1] for p in parts)
        fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
        return {
            k: torch.cat([_pad(torch.as_tensor(p[k]), width, fill[k]) for p in parts]) for k in keys
        }


def _pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Right-pad a micro-batch to the step's widest (dynamic padding pads per micro-batch);
    pads carry mask 0 and label -100, so no loss or attention reads them."""
    return (
        t
        if t.shape[1] == width
        else torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
    )


def require_rebuilt_match(
    step: int, replayed: tuple[float, float], logged: dict[str, float] | None, precision: str
) -> None:
    """The rebuilt batch of the first replayed step must give the loss (and the grad norm,
    where logged) the log recorded; else a one-line error and nothing is diagnosed."""
    loss, grad = replayed
    if not logged or "loss" not in logged:
        raise ForensicsError(
            f"the rebuilt batches cannot be checked: the log has no loss for step {step}; pass --batch"
        )
    checks = [("loss", loss, logged["loss"], REBUILT_LOSS_RTOL.get(precision, 5e-3))]
    if "grad_norm" in logged:
        checks.append(("grad norm", grad, logged["grad_norm"], REBUILT_GRAD_RTOL))
    for what, mine, theirs, tol in checks:
        if not abs(mine - theirs) <= tol * abs(theirs):
            raise ForensicsError(
                f"the rebuilt batch of step {step} gives {what} {mine:.5g}, the log says {theirs:.5g} (tolerance {tol:.1%}): "
                "the data pipeline differs (dataset, collator, seed or sampler); pass --batch with the batches the run consumed"
            )
