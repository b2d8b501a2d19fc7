"""The collators an HF Trainer run may have used, as `replay.hfdata` tries them: the standard
ones of causal-LM runs (those that need a tokenizer only with the run's), or the run's own
(`--collator`); and the one data_collator the rebuilt Trainer is built with, which calls
whichever candidate is collating."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptforensics.core.callables import load_callable
from ckptforensics.formats.batches import BatchError

__all__ = [
    "STANDARD_COLLATORS",
    "Collator",
    "standard_collators",
    "given_collator",
    "ActiveCollator",
]

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


def standard_collators(tok: Any, tok_src: str) -> list[Collator]:
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


def given_collator(spec: str, tok: Any, tok_src: str) -> Collator:
    """`--collator module:obj`: the collator the run passed to `Trainer(data_collator=...)`,
    or a factory whose one required argument is `tokenizer` (or `processing_class`), called
    with the run's tokenizer (`tok_src`: where it was found, or why there is none)."""

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


class ActiveCollator:
    """The data_collator the Trainer is built with: it calls whichever candidate is
    collating, so one dataloader (one sampler walk) serves every candidate, each wrapped as
    the Trainer wraps its collator (column removal for non-`datasets` data)."""

    def __init__(self) -> None:
        self.fn: Callable[[list[dict[str, Any]]], Any] | None = None

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        assert self.fn is not None
        return self.fn(features)
