"""Inert stand-ins for the few framework classes that trainers pickle into checkpoints.

A checkpoint is untrusted input. Rather than importing (or executing) a framework's
class, the weights-only unpickler is given a stand-in with the same qualified name
that only stores what the pickle gives it. The allowlist is short on purpose: a class
that is not here is refused.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["InertRecord", "InertDict", "inert_globals", "ALLOWLIST"]


class InertRecord:
    """Holds the pickled state of a framework object; has no behaviour."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class InertDict(dict):
    """A dict subclass stand-in (Lightning's AttributeDict and the like)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.update(state)


# (module, qualname, base): dict subclasses keep dict semantics, the rest are records.
ALLOWLIST: tuple[tuple[str, str, type], ...] = (
    ("lightning.fabric.utilities.data", "AttributeDict", InertDict),
    ("lightning_fabric.utilities.data", "AttributeDict", InertDict),
    ("pytorch_lightning.utilities.parsing", "AttributeDict", InertDict),
    ("argparse", "Namespace", InertRecord),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", InertRecord),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", InertRecord),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum", InertRecord),
    ("deepspeed.utils.tensor_fragment", "fragment_address", InertRecord),
    ("deepspeed.checkpoint.utils", "fragment_address", InertRecord),
)


@cache
def inert_globals() -> list[type]:
    """Stand-in classes, named as the originals, for torch's safe_globals."""
    out: list[type] = []
    for module, qualname, base in ALLOWLIST:
        cls = type(qualname, (base,), {"__module__": module, "__qualname__": qualname})
        out.append(cls)
    return out
