"""An HF Trainer run's optimizer steps walked through its rebuilt dataloader: each step's
dataset indices, epoch by epoch and process by process as the Trainer's loop and
accelerate's shards consume them, and the step's batch collated by a candidate collator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptforensics.formats.batches import BatchError
from ckptforensics.trainers.hf.collators import ActiveCollator, Collator

__all__ = ["StepPlan"]


class StepPlan:
    """Optimizer step -> the dataset indices of its micro-batches, epoch by epoch, as the
    Trainer's loop consumes them (accumulating `accum` micro-batches; the last update of
    an epoch takes what is left). With `world` processes, process r takes the sampler's
    micro-batches r, r + world, ... (accelerate's `BatchSamplerShard`) and an update is
    every process's `accum` micro-batches, process 0's first."""

    def __init__(
        self, loader: Any, accum: int, world: int = 1, active: ActiveCollator | None = None
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
