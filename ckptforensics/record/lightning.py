"""The flight recorder as a Lightning `Callback` (lightning installed).

    from ckptforensics.record.lightning import lightning_callback
    trainer = L.Trainer(..., callbacks=[lightning_callback("out/flight")])

Lightning hands callbacks the batch (`on_train_batch_start`, every micro-batch) and the
step's loss (`on_train_batch_end`); `on_before_optimizer_step` runs once the gradients are
accumulated and before Lightning clips them, so the grad norms recorded are pre-clip, and
the LRs are the ones the step uses (the scheduler steps after it). A batch that is a
tensor is the step's `input_ids` (labels = inputs, the causal-LM convention); a dict keeps
its `input_ids`, `attention_mask` and `labels`. `ModelCheckpoint` saves cut the segments
(`on_save_checkpoint`), and the Trainer's `gradient_clip_val` is recorded as the clip.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ckptforensics.record.recorder import Recorder, RecorderConfig

__all__ = ["lightning_callback"]


def lightning_callback(path: str | os.PathLike[str], **kw: Any) -> Any:
    """A Lightning Callback recording into `path` (RecorderConfig fields as keywords)."""
    from lightning.pytorch.callbacks import Callback

    class RecorderCallback(Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.rec: Recorder | None = None
            self._opt: Any = None  # the optimizer of a step whose gradients are accumulated
            self._lr: list[float] = []  # that step's LRs, before the scheduler moves them
            self._accum = 1

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            clip = getattr(trainer, "gradient_clip_val", None)
            accum = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
            self.rec = Recorder(
                Path(path), RecorderConfig(grad_clip=float(clip) if clip else None, **kw)
            )
            self._accum = accum

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if self.rec is None:
                return
            b = {"input_ids": batch, "labels": batch} if isinstance(batch, torch.Tensor) else batch
            if self._accum > 1 and self.rec.cfg.micro_batch_size is None:
                self.rec.cfg.micro_batch_size = int(b["input_ids"].shape[0])
            self.rec.on_batch(int(trainer.global_step) + 1, b)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.rec is not None:
                self.rec.after_backward(pl_module)
                self._opt = optimizer
                self._lr = [float(g["lr"]) for g in optimizer.param_groups]

        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if self.rec is None or self._opt is None:
                return  # mid-accumulation: the step is not done
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            opt, self._opt = self._opt, None
            spike = self.rec.after_step(
                int(trainer.global_step),
                getattr(opt, "optimizer", opt),
                loss=loss,
                model=pl_module,
                lr=self._lr,
            )
            if spike is not None and self.rec.cfg.stop_on_spike:
                trainer.should_stop = True

        def on_save_checkpoint(
            self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]
        ) -> None:
            if self.rec is not None:
                self.rec.on_checkpoint(int(trainer.global_step))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if self.rec is not None:
                self.rec.close()

    return RecorderCallback()
