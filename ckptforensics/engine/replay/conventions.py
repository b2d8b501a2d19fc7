"""Conventions a replay must read from the run itself: what the labels are, how the model is called.

Trainers disagree on both and record neither. HF models take `labels == input_ids` and shift
inside the loss; Megatron, nanoGPT, LitGPT, torchtitan and OLMo-core hand the model next-token
targets (`labels[t] = input_ids[t + 1]`). karpathy/nanoGPT's `GPT.forward(idx, targets=None)`
returns `(logits, loss)`, and without targets the logits of the last position only; torchtitan's
models return logits; HF models an output object. Each is measured here from the data and
from one forward pass, never taken from an attribute alone: an attribute the data contradicts
is an error.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptforensics.core.errors import ForensicsError
from ckptforensics.trainers import convention_of

__all__ = [
    "AGREEMENT",
    "LabelConvention",
    "LabelError",
    "measure_labels",
    "settle_labels",
    "CallConvention",
    "detect_call",
    "call_model",
]

# Share of the positions that tell the conventions apart (input_ids[t] != input_ids[t + 1])
# on which labels must agree with one of them for it to decide. A real batch log agrees on
# every position (1.0: both relations are exact by construction); 1% leaves room for a
# masked or corrupted row or two without letting a mixture through.
AGREEMENT = 0.99


class LabelError(ForensicsError):
    """The batch's labels contradict what was declared, or decide no convention."""


@dataclass(frozen=True, slots=True)
class LabelConvention:
    """How a batch's `labels` relate to its `input_ids`.

    Attributes:
        shifted: labels are next-token targets (`labels[t]` is scored against the logits
            of position t); False: HF's convention (`labels[t] == input_ids[t]`, shifted
            inside the loss), or no labels at all.
        same: share of the judged positions where `labels[t] == input_ids[t]` (None: no labels).
        next: share where `labels[t] == input_ids[t + 1]`.
        positions: positions that tell the two apart (labels not ignored, not padding,
            `input_ids[t] != input_ids[t + 1]`).
        source: how it was settled, for `replay.config`.
    """

    shifted: bool
    same: float | None
    next: float | None
    positions: int
    source: str

    @property
    def name(self) -> str:
        return "shifted" if self.shifted else "unshifted"

    def describe(self) -> str:
        what = (
            "next-token targets (labels[t] = input_ids[t+1])"
            if self.shifted
            else f"the inputs, shifted inside the loss ({convention_of('unshifted_labels')})"
        )
        if self.same is None:
            return f"{what}: no labels in the batches"
        return f"{what}: labels == input_ids on {self.same:.1%}, == input_ids shifted by one on {self.next:.1%} of {self.positions} positions"


def measure_labels(
    batches: Iterable[dict[str, torch.Tensor]],
) -> tuple[float | None, float | None, int]:
    """(same, next, positions) over the batches: how often `labels[t]` equals `input_ids[t]`
    and `input_ids[t + 1]`, on the positions where the two differ and the label counts.

    Padding (attention mask 0 at t or t + 1) and ignored labels (-100, and any negative id)
    are left out; so is the last position, whose next token no batch holds, and a row's last
    scored position (the next label ignored): where a padded row ends, its input at t + 1 is
    padding while its target at t may still be the real next token.
    """
    same = nxt = total = 0
    seen_labels = False
    for b in batches:
        if "labels" not in b:
            continue
        seen_labels = True
        ids, lab = b["input_ids"].long(), b["labels"].long()
        if lab.shape != ids.shape or ids.shape[1] < 2:
            continue
        keep = (lab[:, :-1] >= 0) & (lab[:, 1:] >= 0) & (ids[:, :-1] != ids[:, 1:])
        if "attention_mask" in b:
            am = b["attention_mask"] != 0
            keep &= am[:, :-1] & am[:, 1:]
        total += int(keep.sum())
        same += int(((lab[:, :-1] == ids[:, :-1]) & keep).sum())
        nxt += int(((lab[:, :-1] == ids[:, 1:]) & keep).sum())
    if not seen_labels:
        return None, None, 0
    if total == 0:
        return math.nan, math.nan, 0
    return same / total, nxt / total, total


def settle_labels(
    batches: Iterable[dict[str, torch.Tensor]],
    declared: bool | None = None,
    flag: str | None = None,
    where: str = "the batches",
) -> LabelConvention:
    """The label convention of `batches`, measured; `declared` is what the batch log's
    `labels_shifted` attribute says (None: nothing), `flag` the user's `--labels`.

    The data decides when it agrees with one convention on >= AGREEMENT of the positions that
    tell them apart. A declaration or flag the data contradicts is an error. Where the data
    cannot decide (no such positions, or a mixture), the flag decides, else the declaration,
    else it is an error naming both figures.

    Raises:
        LabelError: contradicted, or undecided with nothing to decide it.
    """
    same, nxt, n = measure_labels(batches)
    wanted = None if flag is None else flag == "shifted"
    if same is None:  # no labels: the inputs are the targets, shifted by the loss
        if wanted:
            raise LabelError(
                f"{where}: --labels shifted, but the batches carry no labels (the inputs are the targets)"
            )
        return LabelConvention(
            False,
            None,
            None,
            0,
            "no labels in the batches: input_ids are the targets, shifted by the loss",
        )
    figures = f"labels == input_ids on {same:.1%}, == input_ids shifted by one on {nxt:.1%} of {n} positions"
    decided = True if n and nxt >= AGREEMENT else False if n and same >= AGREEMENT else None
    for said, by in ((wanted, "--labels"), (declared, "the batch log's labels_shifted attribute")):
        if said is not None and decided is not None and said != decided:
            raise LabelError(
                f"{where}: {by} says labels are {'next-token targets' if said else 'the inputs'}, but the data says otherwise "
                f"({figures}); drop it or fix the batches"
            )
    if decided is not None:
        return LabelConvention(
            decided, same, nxt, n, f"measured from the data (>= {AGREEMENT:.0%} agreement)"
        )
    if wanted is not None:
        return LabelConvention(wanted, same, nxt, n, "--labels (the data does not decide)")
    if declared is not None:
        return LabelConvention(
            declared,
            same,
            nxt,
            n,
            "the batch log's labels_shifted attribute (the data does not decide)",
        )
    raise LabelError(
        f"{where}: the labels follow neither convention ({figures}); pass --labels shifted|unshifted"
    )


# Names a forward takes its targets under (nanoGPT `targets`, HF/torchtitan/Megatron `labels`).
_TARGET_PARAMS = ("targets", "labels", "target", "y", "tgt")


@dataclass(frozen=True, slots=True)
class CallConvention:
    """How the model is called and what it returns, found from its signature and one forward.

    Attributes:
        keywords: call as `model(input_ids=..., attention_mask=...)` (HF); else positionally.
        mask: pass the attention mask (the forward takes one and the batch has it).
        targets: the forward's targets parameter, passed so that it returns the logits of
            every position (nanoGPT returns the last position's only without them).
        ignore_index: what stands for an ignored target when `targets` is passed.
        output: 'logits' (a tensor), 'object' (`.logits`), 'tuple' (logits first).
        describe: for `replay.config`.
    """

    keywords: bool
    mask: bool
    targets: str | None
    ignore_index: int
    output: str
    describe: str


def _forward_params(model: nn.Module) -> list[inspect.Parameter]:
    try:
        return [
            p
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind is not p.VAR_KEYWORD and p.kind is not p.VAR_POSITIONAL
        ]
    except (TypeError, ValueError):
        return []


def _output_logits(out: Any) -> tuple[torch.Tensor | None, str]:
    if isinstance(out, torch.Tensor):
        return out, "logits"
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits, "object"
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0], "tuple"
    return None, "unknown"


def _targets_for(labels: torch.Tensor, shifted: bool, ignore: int) -> torch.Tensor:
    """Next-token targets in the model's own convention (a forward that takes targets expects
    them shifted, as nanoGPT's `Y = data[i + 1 : i + 1 + T]`), ignored positions as `ignore`."""
    tgt = (
        labels
        if shifted
        else torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
    )
    return torch.where(tgt < 0, torch.full_like(tgt, ignore), tgt)


def call_model(
    model: nn.Module, conv: CallConvention, batch: dict[str, torch.Tensor], shifted: bool
) -> Any:
    """One forward as the run's trainer calls it (tensors already on the model's device)."""
    ids = batch["input_ids"]
    kwargs: dict[str, torch.Tensor] = {}
    if conv.mask and "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    if conv.targets is not None:
        kwargs[conv.targets] = _targets_for(batch.get("labels", ids), shifted, conv.ignore_index)
    return model(input_ids=ids, **kwargs) if conv.keywords else model(ids, **kwargs)


def detect_call(model: nn.Module, batch: dict[str, torch.Tensor], shifted: bool) -> CallConvention:
    """Find how to call `model` so it returns the logits of every position of `batch`
    (on the model's device; run under no_grad by the caller, probes off).

    Tries, in order: the plain call (keywords when the forward names `input_ids`), then the
    call with targets (a forward returning fewer positions than it was given, nanoGPT's),
    with -100 and then -1 (nanoGPT's ignore_index) for ignored targets.

    Raises:
        ForensicsError: no call returns [B, T, V] logits; `--loss` is the way out.
    """
    params = _forward_params(model)
    names = [p.name for p in params]
    keywords = "input_ids" in names
    mask = "attention_mask" in names and "attention_mask" in batch
    targets = next((n for n in names[1:] if n in _TARGET_PARAMS), None)
    ids = batch["input_ids"]
    tried: list[str] = []
    attempts: list[tuple[str | None, int]] = [(None, -100)]
    if targets is not None:
        attempts += [(targets, -100), (targets, -1)]
    for tgt, ignore in attempts:
        conv = CallConvention(keywords, mask, tgt, ignore, "logits", "")
        try:
            out = call_model(model, conv, batch, shifted)
        except (IndexError, RuntimeError, ValueError, TypeError) as e:
            if tgt is None and not targets:
                raise ForensicsError(
                    f"the model's forward fails on the batch ({type(e).__name__}: {str(e).splitlines()[0][:160]}); pass --model or --loss"
                ) from None
            tried.append(f"{'with ' + tgt if tgt else 'plain call'} fails ({type(e).__name__})")
            continue
        logits, kind = _output_logits(out)
        if logits is not None and logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(ids.shape):
            how = ("model(input_ids=ids" if keywords else "model(ids") + (
                ", attention_mask=mask" if mask else ""
            )
            how += f", {tgt}=next-token targets)" if tgt else ")"
            ret = {
                "logits": "logits",
                "object": "an output object whose .logits",
                "tuple": "a tuple whose first item",
            }[kind]
            extra = f" (without {tgt}: {tried[0]})" if tgt and tried else ""
            return CallConvention(
                keywords,
                mask,
                tgt,
                ignore,
                kind,
                f"{how} -> {ret} [B, T, V] covers every position{extra}",
            )
        shape = f"logits {list(logits.shape)}" if logits is not None else f"a {type(out).__name__}"
        tried.append(f"{'with ' + tgt if tgt else 'plain call'} gives {shape}")
    raise ForensicsError(
        f"the model does not return logits of every position for input_ids {list(ids.shape)} ({'; '.join(tried)}); "
        "pass --loss module:function (per-token loss from the model's output)"
    )
