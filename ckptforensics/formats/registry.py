"""The format registry: each reader's opener, sniffer and completeness rule by name, the
resolvers of save dirs that stand for one of their checkpoints, and third-party readers from
entry points. `formats` registers the generic readers; each trainer's `checkpoint.py` its own."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ckptforensics.formats.base import Checker, Checkpoint

__all__ = [
    "FORMATS",
    "SNIFFERS",
    "CHECKERS",
    "RESOLVERS",
    "register",
    "register_resolver",
    "load_plugins",
    "is_builtin",
    "format_names",
]

log = logging.getLogger("ckptforensics.formats")

Opener = Callable[[Path], Checkpoint]


Sniffer = Callable[[Path], bool]


FORMATS: dict[str, Opener] = {}


# name -> sniffer, in the order `sniff` asks them (the most specific layout first).
SNIFFERS: dict[str, Sniffer] = {}


# name -> its completeness rule (`Completeness`); readers without one are not judged.
CHECKERS: dict[str, Checker] = {}


# path -> the checkpoint it stands for (a trainer's save dir and its tracker file).
Resolver = Callable[[Path], Path]


RESOLVERS: list[Resolver] = []


ENTRY_POINT_GROUP = "ckptforensics.formats"


# The readers registered by the package itself (generic ones here, trainers' layouts by
# `trainers`), as against plugins'.
_BUILTIN: set[str] = set()


_plugins_loading = False


# sniffer name -> its place in `SNIFFERS` (see `register`'s `order`).
_ORDER: dict[str, float] = {}


def register(
    name: str,
    opener: Opener,
    sniff: Sniffer | None = None,
    *,
    first: bool = False,
    order: float | None = None,
    complete: Checker | None = None,
) -> None:
    """Add a reader: `opener(path) -> Checkpoint`, and optionally `sniff(path) -> bool`,
        which `sniff()` asks before the generic safetensors / torch.save checks (`first`: before
        every registered one; `order`: its place among the package's own readers, lower asked first —
    a trainer's layout that would otherwise pass for a generic one asks before it; plugins come
    after them unless `first`), and
        `complete(path) -> Completeness`, the format's rule for a whole checkpoint (sizes,
        headers, end records: cheap). A second reader under the same name is a programming error."""
    if name in FORMATS:
        raise ValueError(f"format {name!r} is already registered")
    FORMATS[name] = opener
    if not _plugins_loading:
        _BUILTIN.add(name)
    if complete is not None:
        CHECKERS[name] = complete
    if sniff is not None:
        items = list(SNIFFERS.items())
        SNIFFERS.clear()
        rank = _ORDER.get(items[0][0], 0) - 1 if first and items else order
        _ORDER[name] = rank if rank is not None else max(_ORDER.values(), default=0) + 1
        items.append((name, sniff))
        SNIFFERS.update(sorted(items, key=lambda kv: _ORDER[kv[0]]))


def register_resolver(fn: Resolver) -> None:
    """Add `fn(path) -> path`: a save directory that stands for one of its checkpoints (a
    Megatron save dir for the iteration its tracker names), asked before sniffing."""
    RESOLVERS.append(fn)


_plugins_loaded = False


def load_plugins() -> list[str]:
    """Register third-party readers from the `ckptforensics.formats` entry points: each
    names a callable that is given `register`. Loaded once; returns the formats it added.
    A plugin that fails to load is logged and skipped, never fatal to the built-ins."""
    global _plugins_loaded, _plugins_loading
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    _plugins_loading = True
    from importlib.metadata import entry_points

    before = set(FORMATS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()(register)
        except Exception as e:  # a broken plugin must not take the built-in readers down
            log.warning("format plugin %s (%s) did not load: %s", ep.name, ep.value, e)
    _plugins_loading = False
    return sorted(set(FORMATS) - before)


def is_builtin(name: str) -> bool:
    return name in _BUILTIN


def format_names() -> list[str]:
    """Every reader's name (built-ins and plugins): what `--format` accepts."""
    load_plugins()
    return sorted(FORMATS)
