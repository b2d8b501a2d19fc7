"""Inert stand-ins for the few framework classes that trainers pickle into checkpoints.

A checkpoint is untrusted input. Rather than importing (or executing) a framework's
class, the weights-only unpickler is given a stand-in with the same qualified name
that only stores what the pickle gives it. The allowlist is short on purpose: a class
that is not here is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

__all__ = [
    "InertRecord",
    "InertDict",
    "inert_globals",
    "numpy_globals",
    "safe_load_globals",
    "allowed_names",
    "dcp_inert_classes",
    "register_safe_globals",
    "register_dcp_globals",
    "ALLOWLIST",
    "DCP_ALLOWLIST",
]


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


# (module, qualname, base): dict subclasses keep dict semantics, the rest are records. The
# generic ones are here; each trainer's `checkpoint.py` registers the classes its trainer pickles
# (`register_safe_globals`), so that the allowlist is whole once `trainers` has loaded.
ALLOWLIST: tuple[tuple[str, str, type], ...] = (("argparse", "Namespace", InertRecord),)


# Records that DCP `.metadata` files pickle beside torch's own metadata classes: megatron-core
# 0.19 keeps its cached SavePlan (torch's planner records); a trainer's own records are
# registered by its `checkpoint.py` (`register_dcp_globals`). Read by their fields, never imported.
DCP_ALLOWLIST: tuple[tuple[str, str, type], ...] = tuple(
    ("torch.distributed.checkpoint.planner", n, InertRecord)
    for n in (
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
        "LoadPlan",
        "ReadItem",
        "LoadItemType",
    )
)


Entry = tuple[str, str, type]


def _stand_in(module: str, qualname: str, base: type) -> type:
    if base not in (InertRecord, InertDict):
        raise ValueError(f"{module}.{qualname}: a stand-in's base is InertRecord or InertDict")
    return type(qualname, (base,), {"__module__": module, "__qualname__": qualname})


# (module, qualname) -> its stand-in: torch.load's allowlist and the DCP metadata unpickler's.
_TORCH: dict[tuple[str, str], type] = {(m, q): _stand_in(m, q, b) for m, q, b in ALLOWLIST}
_DCP: dict[tuple[str, str], type] = {(m, q): _stand_in(m, q, b) for m, q, b in DCP_ALLOWLIST}


def _add(table: dict[tuple[str, str], type], entries: Iterable[Entry]) -> None:
    for module, qualname, base in entries:
        had = table.get((module, qualname))
        if had is not None:
            if had.__mro__[1] is not base:
                raise ValueError(
                    f"{module}.{qualname} is already allowed as a {had.__mro__[1].__name__}"
                )
            continue
        table[(module, qualname)] = _stand_in(module, qualname, base)
    allowed_names.cache_clear()


def register_safe_globals(entries: Iterable[Entry]) -> None:
    """Admit classes a trainer pickles into its torch.save files, each as an inert stand-in
    named as the original: (module, qualname, InertRecord or InertDict). Nothing is imported
    and nothing pickled is ever called; a class registered by no one is refused."""
    _add(_TORCH, entries)


def register_dcp_globals(entries: Iterable[Entry]) -> None:
    """Admit records a trainer pickles into DCP `.metadata` files (see `register_safe_globals`)."""
    _add(_DCP, entries)


def inert_globals() -> list[type]:
    """Stand-in classes, named as the originals, for torch's safe_globals."""
    return list(_TORCH.values())


def dcp_inert_classes() -> dict[tuple[str, str], type]:
    """(module, name) -> stand-in, for the DCP metadata unpickler."""
    return dict(_DCP)


# numpy kinds that hold plain numbers, bytes or text. Object ('O') and structured void ('V')
# dtypes are left out: an object array's payload is more pickle, a structured one can hold
# object fields. A pickle that builds one of them is refused at its BUILD opcode.
_PLAIN_DTYPES = (
    "Bool",
    "Int8",
    "Int16",
    "Int32",
    "Int64",
    "Long",
    "LongLong",
    "Short",
    "Byte",
    "UInt8",
    "UInt16",
    "UInt32",
    "UInt64",
    "ULong",
    "ULongLong",
    "UShort",
    "UByte",
    "Float16",
    "Float32",
    "Float64",
    "LongDouble",
    "Complex64",
    "Complex128",
    "CLongDouble",
    "Bytes",
    "Str",
    "DateTime64",
    "TimeDelta64",
)


@cache
def numpy_globals() -> list[Any]:
    """numpy arrays, dtypes and scalars of plain kinds, admitted as data.

    Every real Megatron-LM save and HF `rng_state.pth` holds `np.random.get_state()`:
    a uint32 array, its dtype and scalars. They pickle through `_reconstruct` /
    `scalar` (numpy 2 writes `numpy._core.multiarray`, numpy 1 `numpy.core.multiarray`),
    `ndarray`, `dtype`, and BUILD on the dtype's class. Those are admitted under both
    names; nothing that runs code or holds Python objects is.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a core dependency
        return []
    try:
        from numpy._core import multiarray as ma
    except ImportError:  # numpy 1
        from numpy.core import multiarray as ma  # type: ignore[no-redef]
    out: list[Any] = []
    for mod in ("numpy._core.multiarray", "numpy.core.multiarray"):
        out += [(ma._reconstruct, f"{mod}._reconstruct"), (ma.scalar, f"{mod}.scalar")]
    out += [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype")]
    dtypes = getattr(np, "dtypes", None)
    for name in _PLAIN_DTYPES:
        cls = getattr(dtypes, f"{name}DType", None) if dtypes is not None else None
        if cls is not None:
            out.append((cls, f"numpy.dtypes.{name}DType"))
    return out


def safe_load_globals() -> list[Any]:
    """Everything `torch.load(weights_only=True)` may build beyond its own defaults."""
    return [*inert_globals(), *numpy_globals()]


@cache
def allowed_names() -> frozenset[str]:
    """Qualified names of the admitted globals (for naming what a refused file wanted)."""
    names = {f"{g.__module__}.{g.__qualname__}" for g in inert_globals()}
    names |= {n for _, n in numpy_globals()}
    return frozenset(names)
