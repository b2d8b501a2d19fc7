"""The read-only, lazy Checkpoint view every format reader provides, and its records.

Over 400 lines: the Checkpoint protocol and its records, the one seam every reader
implements, kept together so the contract reads in one file.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import mmap
import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import doing
from ckptforensics.optim.hyper import GroupHyper

__all__ = [
    "Completeness",
    "Checker",
    "file_problem",
    "json_problem",
    "rel_name",
    "TensorMeta",
    "GroupHyper",
    "OptimizerView",
    "Checkpoint",
    "release_pages",
    "prefetch_pages",
    "LazyState",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of a stored tensor, known without reading its data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(slots=True)
class OptimizerView:
    """Optimizer state keyed by parameter name.

    Attributes:
        kind: the family ('adam', 'lamb', 'lion', 'adafactor', 'muon', 'sgd', 'adam8bit'),
            two joined by '+' when a checkpoint holds two optimizers ('muon+adam'), or
            'unknown:<state keys>' for an optimizer the tool does not know.
        state: name -> {"exp_avg", "exp_avg_sq", "step", ...}; tensors may be lazy (mmap).
        hyper: name -> its group's hyper-parameters.
        groups: one GroupHyper per param group, in order.
        mapping: how ids were mapped to names ('param_names', 'single group', ...).
    """

    kind: str
    state: dict[str, dict[str, Any]]
    hyper: dict[str, GroupHyper]
    groups: list[GroupHyper]
    mapping: str = ""


@dataclass
class Checkpoint:
    """A read-only, lazy view of one checkpoint: the contract every reader fills.

    Readers (built-in or plugin) declare tensors with `add_tensor(name, meta, load)`
    without reading their data, and may `remove_tensor` one they find is a duplicate;
    `tensor(name)` materialises lazily (memory-mapped where the format allows).

    Attributes:
        path: what was opened.
        format: reader name ('hf-trainer', 'safetensors', 'torch', 'nanogpt', 'lightning').
        scalars: global_step, loss_scale, scaler and scheduler state, when present.
        config: model config when the checkpoint carries one.
        optimizer: the optimizer view, or None for weights-only checkpoints.
        notes: what the reader could not do, said plainly (goes into reports).
        file_backed: every tensor is a clean file mapping, so `release` may drop pages.
        aliases: tied names left out of `names()` -> the name that holds the data.
        pending_optimizer: optimizer state whose ids only a pair of checkpoints can map
            (same-shaped tensors in several groups); see `formats.settle_pair`.
        layout: a tensor computed from stored ones (`regroup`: a library's in-memory
            layout of what it stored, e.g. fused experts) -> the stored names it came from.
    """

    path: Path
    format: str
    _meta: dict[str, TensorMeta] = field(default_factory=dict, repr=False)
    _get: dict[str, Any] = field(default_factory=dict, repr=False)
    scalars: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] | None = None
    optimizer: OptimizerView | None = None
    notes: list[str] = field(default_factory=list)
    file_backed: bool = False
    aliases: dict[str, str] = field(default_factory=dict)
    pending_optimizer: Any = None
    layout: dict[str, list[str]] = field(default_factory=dict)
    _hidden: dict[str, Any] = field(default_factory=dict, repr=False)
    _built: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)
    _closers: list[Any] = field(default_factory=list, repr=False)

    def add_tensor(self, name: str, meta: TensorMeta, load: Callable[[], torch.Tensor]) -> None:
        """Declare a model tensor: its shape and dtype now, its data when `load()` is
        called (the reader's contract: nothing is read before `tensor(name)`)."""
        self._meta[name] = meta
        self._get[name] = load

    def regroup(
        self,
        derived: dict[
            str,
            tuple[list[str], TensorMeta, Callable[[Callable[[str], torch.Tensor]], torch.Tensor]],
        ],
    ) -> None:
        """Replace stored tensors by tensors computed from them: name -> (its stored sources,
        its meta, a builder called with a reader of the sources). Each takes its first
        source's place in `names()`; the sources leave `names()` but stay readable by the
        builders; `layout` records where each came from. A built tensor is fresh memory,
        not a file mapping: `release` leaves it alone."""
        first = {sources[0]: target for target, (sources, _, _) in derived.items()}
        gone = {s for sources, _, _ in derived.values() for s in sources}
        meta, get = dict(self._meta), dict(self._get)
        self._hidden.update({s: get[s] for s in gone})
        self._meta, self._get = {}, {}
        for name in meta:
            if name in first:
                target = first[name]
                sources, m, build = derived[target]
                self._meta[target] = m
                self._get[target] = functools.partial(self._build, target, build)
                self.layout[target] = list(sources)
            elif name not in gone:
                self._meta[name], self._get[name] = meta[name], get[name]

    def _build(
        self, name: str, build: Callable[[Callable[[str], torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        t = build(lambda source: self._hidden[source]())
        lo = t.data_ptr()
        self._built[name] = (lo, lo + t.numel() * t.element_size())
        return t

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a model tensor of this name."""
        return name in self._meta

    def remove_tensor(self, name: str) -> None:
        """Drop a declared tensor (a reader that finds it is a duplicate, a tied head)."""
        del self._meta[name], self._get[name]

    def names(self) -> list[str]:
        """Model tensor names, in the checkpoint's own order."""
        return list(self._meta)

    def meta(self, name: str) -> TensorMeta:
        """Shape and dtype without reading data."""
        return self._meta[name]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor, lazily read (mmap-backed where possible); never written to."""
        with doing(f"reading tensor {name} of {self.path}"):
            return self._get[name]()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of a tensor (a torchrun rank's shard), as a copy.

        A reader whose loader has `rows` reads only the chunks that hold them (DCP); an
        mmap-backed tensor pages in only the rows sliced; other formats read it whole.
        """
        return read_rows(self._get[name], start, stop)

    def state_rows(self, name: str, field: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one optimizer state tensor of `name` (see `rows`)."""
        st = self.optim_state(name)
        return (
            st.rows(field, start, stop)
            if isinstance(st, LazyState)
            else read_rows(st[field], start, stop)
        )

    @property
    def step(self) -> int | None:
        """Global (trainer) step of this checkpoint, when the format records it."""
        s = self.scalars.get("global_step")
        return int(s) if s is not None else None

    def optim_state(self, name: str) -> dict[str, Any]:
        """Optimizer state of a parameter by name ({} when it has none)."""
        if self.optimizer is None:
            return {}
        return self.optimizer.state.get(name, {})

    def hyper(self, name: str) -> GroupHyper | None:
        """Hyper-parameters of the param group holding `name`."""
        if self.optimizer is None:
            return None
        return self.optimizer.hyper.get(name)

    def forget(self, name: str) -> None:
        """Drop the optimizer state built for `name` (lazily read formats: DCP, DeepSpeed,
        torch_dist): a streaming diff then holds one tensor's state at a time."""
        st = self.optim_state(name)
        if isinstance(st, LazyState):
            st.forget()

    def release(self, t: torch.Tensor) -> None:
        """Let the OS drop pages of a streamed slice of this checkpoint's tensors."""
        if self.file_backed and not any(lo <= t.data_ptr() < hi for lo, hi in self._built.values()):
            release_pages(t)

    def prefetch(self, name: str) -> None:
        """Read a tensor and its optimizer state into memory now (call from a helper thread)."""
        if not self.file_backed:
            return
        prefetch_pages(self.tensor(name))
        for v in self.optim_state(name).values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                prefetch_pages(v)

    def close(self) -> None:
        for c in self._closers:
            try:
                c()
            except Exception:  # closing is best effort; nothing to lose
                log.debug("close failed", exc_info=True)
        self._closers.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PAGE = mmap.PAGESIZE
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None


def _madvise(t: torch.Tensor, advice: int, outward: bool) -> None:
    if _libc is None or t.numel() == 0 or t.device.type != "cpu":
        return
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if outward:
        lo, hi = start // _PAGE * _PAGE, (end + _PAGE - 1) // _PAGE * _PAGE
    else:
        lo, hi = (start + _PAGE - 1) // _PAGE * _PAGE, end // _PAGE * _PAGE
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), advice)


def prefetch_pages(t: torch.Tensor) -> None:
    """Ask the OS to read a file-backed tensor's pages now (madvise WILLNEED).

    Called from a helper thread (ctypes drops the GIL), it reads the next tensor from
    disk while the main thread computes on the current one, so a cold checkpoint
    streams near disk speed rather than fault by fault.
    """
    _madvise(t, _MADV_WILLNEED, outward=True)


def release_pages(t: torch.Tensor) -> None:
    """Drop the resident pages of a *file-backed, never-written* mmap tensor.

    Streaming a multi-GB checkpoint through mmap otherwise leaves every touched page
    resident until the mapping closes. Only whole pages inside the tensor are dropped;
    clean private file pages are re-read from the file if touched again, so this
    loses nothing. Readers call it only on tensors they mapped from a file.
    """
    _madvise(t, _MADV_DONTNEED, outward=False)


class LazyState(dict):
    """One parameter's optimizer state whose tensors are read on first access.

    Values are callables building the tensor (from chunks or rank partitions) or plain
    values; a built tensor is kept, so a diff reading exp_avg twice reads it once.
    """

    def __init__(self, build: dict[str, Any]) -> None:
        super().__init__(build)
        self._cache: dict[str, Any] = {}

    def __getitem__(self, k: str) -> Any:
        if k not in self._cache:
            v = super().__getitem__(k)
            self._cache[k] = v() if callable(v) else v
        return self._cache[k]

    def get(self, k: str, default: Any = None) -> Any:
        return self[k] if k in self else default  # noqa: SIM401 - must build lazily via __getitem__

    def forget(self) -> None:
        """Drop the built tensors (they are rebuilt on the next access)."""
        self._cache.clear()

    def rows(self, k: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of one state tensor, without building the rest where
        its loader reads by rows (see `Checkpoint.rows`)."""
        if k in self._cache:
            return self._cache[k][start:stop].clone()
        return read_rows(dict.__getitem__(self, k), start, stop)

    def values(self) -> Any:  # type: ignore[override]
        return [self[k] for k in self]

    def items(self) -> Any:  # type: ignore[override]
        return [(k, self[k]) for k in self]


def read_rows(load: Any, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) from a tensor loader: its own `rows(start, stop)` when it has one,
    else the whole tensor sliced (mmap-backed tensors page in only those rows)."""
    if hasattr(load, "rows"):
        return load.rows(start, stop)
    t = load() if callable(load) else load
    return t[start:stop].clone()


@dataclass(frozen=True, slots=True)
class Completeness:
    """Whether a checkpoint on disk is whole, judged cheaply: every file its format requires
    is there, readable, and as long as its own header, index or end record says (no tensor
    data is read). A save that died half-way is the commonest state of the newest checkpoint
    after a crash; this is how it is told apart from a finished one.

    Attributes:
        format: the reader's name ('hf-trainer', 'dcp', ...).
        rule: what a complete checkpoint of this format is, in one sentence.
        problems: what is missing or cut short, each naming its file; empty when complete.
        checked: False for a reader without a rule (a plugin): nothing was judged.
    """

    format: str
    rule: str
    problems: tuple[str, ...] = ()
    checked: bool = True

    @property
    def complete(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """'complete' / 'incomplete: a; b' / 'not checked (...)', for one line of output."""
        if not self.checked:
            return f"not checked ({self.rule})"
        return "complete" if self.complete else "incomplete: " + "; ".join(self.problems)


# A format's completeness rule: the checkpoint path (file or directory) -> its verdict.
Checker = Callable[[Path], Completeness]


def file_problem(path: Path, root: Path | None = None) -> str | None:
    """What keeps `path` from being a whole, readable file, or None: missing, a symlink
    that leads nowhere (dangling or a loop), not a regular file, unreadable, or empty.
    Named relative to `root` when given."""
    name = rel_name(path, root)
    try:
        st = path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"{name}: a symlink loop"
        if path.is_symlink():
            return f"{name}: a symlink to nothing ({os.readlink(path)})"
        return f"{name} missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{name}: not a regular file"
    if not os.access(path, os.R_OK, effective_ids=os.access in os.supports_effective_ids):
        return f"{name}: not readable (permission denied)"
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        return f"{name}: not readable ({e.strerror or e})"
    if st.st_size == 0:
        return f"{name}: empty (0 bytes)"
    return None


def json_problem(path: Path, root: Path | None = None) -> str | None:
    """`file_problem`, or a JSON file cut short (or not JSON at all)."""
    bad = file_problem(path, root)
    if bad is not None:
        return bad
    try:
        json.loads(path.read_bytes())
    except (UnicodeDecodeError, ValueError):
        return f"{rel_name(path, root)}: cut short or not JSON"
    return None


def rel_name(path: Path, root: Path | None) -> str:
    """`path` relative to `root` (the checkpoint), as problems name their files."""
    if root is None:
        return str(path)
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)
