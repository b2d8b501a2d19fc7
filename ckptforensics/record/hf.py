"""The flight recorder as a transformers `TrainerCallback` (the `hf` extra).

    from ckptforensics.record.hf import hf_callback
    trainer = Trainer(..., callbacks=[hf_callback("out/flight")])

The Trainer hands callbacks no batch and no loss, so the callback reads both off the model:
a forward pre-hook keeps each training micro-batch's `input_ids`, `attention_mask` and
`labels` (in the order the Trainer fed them), a forward hook its `loss`. With
`num_items_in_batch` passed to the model (the Trainer's default for models that take loss
kwargs) a micro-batch's loss is its share of the step's sum, so the step's loss is their
sum, as the Trainer logs it; otherwise their mean. Callbacks run after the Trainer clipped
(`on_pre_optimizer_step` follows `_clip_grad_norm`): the grad norms recorded are the
clipped gradients' (the pre-clip norm is in the Trainer's own log, `trainer_state.json`,
which `triage` reads). Checkpoints (`on_save`) cut the recorder's segments.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ckptforensics.record.recorder import Recorder, RecorderConfig

__all__ = ["hf_callback"]


def hf_callback(path: str | os.PathLike[str], **kw: Any) -> Any:
    """A TrainerCallback recording into `path` (RecorderConfig fields as keywords)."""
    from transformers import TrainerCallback

    class RecorderCallback(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.rec: Recorder | None = None
            self._losses: list[torch.Tensor] = []
            self._summed = False
            self._handles: list[Any] = []
            self._step = 1  # the optimizer step the micro-batches being fed belong to

        def on_train_begin(
            self,
            args: Any,
            state: Any,
            control: Any,
            model: torch.nn.Module | None = None,
            **_: Any,
        ) -> None:
            accum = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
            cfg = RecorderConfig(
                grad_clip=float(args.max_grad_norm) if getattr(args, "max_grad_norm", 0) else None,
                micro_batch_size=int(args.per_device_train_batch_size) if accum > 1 else None,
                **kw,
            )  # fmt: skip
            self.rec = Recorder(Path(path), cfg)
            if model is not None:
                self._handles = [
                    model.register_forward_pre_hook(self._batch, with_kwargs=True),
                    model.register_forward_hook(self._loss, with_kwargs=True),
                ]

        def _batch(
            self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> None:
            if self.rec is None or not module.training:
                return
            b = {
                k: kwargs[k]
                for k in ("input_ids", "attention_mask", "labels")
                if isinstance(kwargs.get(k), torch.Tensor)
            }
            if "input_ids" not in b and args and isinstance(args[0], torch.Tensor):
                b["input_ids"] = args[0]
            if "input_ids" in b:
                self.rec.on_batch(self._step, b)
                self._summed = kwargs.get("num_items_in_batch") is not None

        def _loss(
            self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
        ) -> None:
            loss = getattr(out, "loss", None)
            if module.training and isinstance(loss, torch.Tensor):
                self._losses.append(loss.detach())

        def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            self._step = int(state.global_step) + 1

        def on_pre_optimizer_step(
            self,
            args: Any,
            state: Any,
            control: Any,
            model: torch.nn.Module | None = None,
            **_: Any,
        ) -> None:
            if self.rec is not None and model is not None:
                self.rec.after_backward(model)

        def on_optimizer_step(
            self,
            args: Any,
            state: Any,
            control: Any,
            optimizer: Any = None,
            model: torch.nn.Module | None = None,
            **_: Any,
        ) -> None:
            if self.rec is None or optimizer is None:
                return
            losses, self._losses = self._losses, []
            loss = None
            if losses:
                total = torch.stack([x.float().reshape(()) for x in losses])
                loss = total.sum() if self._summed else total.mean()
            opt = getattr(
                optimizer, "optimizer", optimizer
            )  # accelerate's AcceleratedOptimizer wraps the torch one
            spike = self.rec.after_step(self._step, opt, loss=loss, model=model)
            if spike is not None and self.rec.cfg.stop_on_spike:
                control.should_training_stop = True

        def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            if self.rec is not None:
                self.rec.on_checkpoint(
                    int(state.global_step),
                    Path(args.output_dir) / f"checkpoint-{state.global_step}",
                )

        def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
            for h in self._handles:
                h.remove()
            if self.rec is not None:
                self.rec.close()

    return RecorderCallback()
