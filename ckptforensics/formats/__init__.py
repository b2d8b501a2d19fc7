"""Checkpoint readers: one module per format behind one read-only, lazy view."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

import torch

from ckptforensics.core.errors import (
    DamagedCheckpoint,
    ForensicsError,
    IncompleteCheckpoint,
    UnknownFormat,
    doing,
)
from ckptforensics.formats.base import (
    Checkpoint,
    Completeness,
    GroupHyper,
    OptimizerView,
    TensorMeta,
)
from ckptforensics.formats.dcp import dcp_completeness, is_dcp_dir, open_dcp
from ckptforensics.formats.locate import list_checkpoints, must_exist, step_of_name
from ckptforensics.formats.optstate import settle_by_evidence, view_from_ids
from ckptforensics.formats.registry import (
    CHECKERS,
    FORMATS,
    RESOLVERS,
    SNIFFERS,
    format_names,
    is_builtin,
    load_plugins,
    register,
    register_resolver,
)
from ckptforensics.formats.safetensors_file import open_safetensors, safetensors_completeness
from ckptforensics.formats.torchfile import is_torch_zip, torch_file_completeness
from ckptforensics.formats.torchsave import open_torch_file, torch_flavours
from ckptforensics.formats.verify import Verification, verify_files

__all__ = [
    "Checkpoint",
    "Completeness",
    "completeness",
    "require_complete",
    "GroupHyper",
    "OptimizerView",
    "TensorMeta",
    "open_checkpoint",
    "open_pair",
    "settle_pair",
    "FORMATS",
    "register",
    "register_resolver",
    "format_names",
    "is_builtin",
    "load_plugins",
    "sniff",
    "first_complete",
    "verify",
    "Verification",
]

log = logging.getLogger(__name__)


def _is_safetensors(path: Path) -> bool:
    if path.is_dir():
        return False
    if path.suffix == ".safetensors":
        return True
    with path.open("rb") as f:
        head = f.read(16)
    return len(head) >= 9 and head[8:9] == b"{"


register(
    "dcp", open_dcp, lambda p: p.is_dir() and is_dcp_dir(p), order=20, complete=dcp_completeness
)
register(
    "safetensors",
    open_safetensors,
    _is_safetensors,
    order=80,
    complete=safetensors_completeness,
)
# Plain torch.save files; the trainers' flavours of them register from trainers/
# (`formats.torchsave.register_flavour`).
register(
    "torch",
    lambda p: open_torch_file(p, "torch"),
    complete=lambda p: torch_file_completeness(p, "torch"),
)


def sniff(path: Path) -> str:
    """The format name for `path`: the registered sniffers in order, then a torch.save file
    (the torch-family readers tell themselves apart from the file's keys)."""
    load_plugins()
    for name, test in SNIFFERS.items():
        if test(path):
            return name
    if path.is_dir():
        if single_file(path) is not None:
            return "torch-file"
        broken = broken_links(path)
        if (
            broken
        ):  # the file that made it a checkpoint is a link to nothing (lit_model.pth -> a loop)
            raise IncompleteCheckpoint(
                f"{path}: no checkpoint layout recognised, and {'; '.join(broken)}; pass a complete checkpoint (an earlier step)"
            )

        found = list_checkpoints(path)
        if found:
            steps = [s for s, _ in found]
            shown = ", ".join(map(str, steps[:6])) + (
                f", ... {steps[-1]}" if len(steps) > 6 else ""
            )
            raise UnknownFormat(
                f"{path}: a run directory with checkpoints at steps {shown}; pass one of them, or --run-dir {path} and a step"
            )
        raise UnknownFormat(
            f"{path}: a directory that is not a known checkpoint layout "
            "(expected model*.safetensors / pytorch_model*.bin); pass the checkpoint itself"
        )
    if path.stat().st_size == 0:
        raise IncompleteCheckpoint(
            f"{path}: empty (0 bytes): a save cut off before writing it; pass a complete checkpoint (an earlier step)"
        )
    with path.open("rb") as f:
        head = f.read(16)
    # torch.save zips start with a local file header; a truncated one has lost its
    # central directory but is still a torch file (to be refused as truncated).
    if is_torch_zip(path) or head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":
        return "torch-file"
    raise UnknownFormat(f"{path}: not a safetensors, torch.save or checkpoint directory")


# One-file checkpoints that trainers write inside a step directory: nanoGPT-style loops
# (`step_N/ckpt.pt`), LitGPT (`step-00000040/lit_model.pth`), Lightning (`*.ckpt`).
SINGLE_FILES = (
    "ckpt.pt",
    "model.pt",
    "checkpoint.pt",
    "state.pt",
    "lit_model.pth",
    "model.pth",
    "checkpoint.pth",
    "state.pth",
)


def single_file(path: Path) -> Path | None:
    """The one checkpoint file of a known kind inside `path`, or None (none, or several)."""
    found = [path / n for n in SINGLE_FILES if (path / n).is_file()]
    found += [f for f in sorted(path.glob("*.ckpt")) if f.is_file()]
    return found[0] if len(found) == 1 else None


def _target(p: Path, format: str | None) -> tuple[Path, str]:
    """(the path the reader opens, the reader's name or 'torch-file')."""
    for resolve in RESOLVERS:
        p = resolve(p)
    if format is not None:
        load_plugins()
        if format not in FORMATS:
            raise UnknownFormat(f"unknown format {format!r}; known: {', '.join(sorted(FORMATS))}")
        inner = single_file(p) if p.is_dir() and format in torch_flavours() else None
        return inner or p, format
    kind = sniff(p)
    if kind == "torch-file":
        return (single_file(p) if p.is_dir() else None) or p, kind
    return p, kind


def completeness(path: str | Path, format: str | None = None) -> Completeness:
    """Whether the checkpoint at `path` is whole, by its format's rule (`Completeness`):
    every file the format requires there, readable, and as long as its own header, index or
    end record says. Cheap: sizes, headers and end records; no tensor data is read.

    Raises:
        CheckpointNotFound, UnknownFormat: nothing at `path` that a reader recognises.
    """
    p = Path(path)
    must_exist(p)
    with doing(f"checking that {p} is complete"):
        target, kind = _target(p, format)
        name = "torch" if kind == "torch-file" else kind
        check = CHECKERS.get(name)
        if check is None:
            return Completeness(
                name, f"the {name} reader (a plugin) states no completeness rule", checked=False
            )
        c = check(target)
        broken = [
            b
            for b in broken_links(target)
            if not any(q.startswith(b.split(":")[0]) for q in c.problems)
        ]
        return dataclasses.replace(c, problems=(*c.problems, *broken)) if broken else c


def broken_links(path: Path) -> list[str]:
    """Symlinks inside a checkpoint directory that lead nowhere (loops, dangling): damage,
    whatever the file's role; a reader that looks for the name would take it for absent."""
    if not path.is_dir() or path.is_symlink():
        return []
    out = []
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            p = Path(d) / n
            if p.is_symlink():
                try:
                    p.stat()
                except OSError as e:
                    what = (
                        "a symlink loop"
                        if e.errno == errno.ELOOP
                        else f"a symlink to nothing ({os.readlink(p)})"
                    )
                    out.append(f"{p.relative_to(path).as_posix()}: {what}")
    return sorted(out)


def require_complete(path: str | Path, format: str | None = None) -> Completeness:
    """`completeness`, raising IncompleteCheckpoint (what is missing, the fix) unless whole."""
    c = completeness(path, format)
    if c.checked and not c.complete:
        if all("not readable" in p for p in c.problems):
            raise IncompleteCheckpoint(
                f"{path}: unreadable {c.format} checkpoint: {'; '.join(c.problems)}. Fix its permissions, or pass another"
            )
        raise IncompleteCheckpoint(
            f"{path}: incomplete {c.format} checkpoint: {'; '.join(c.problems)}. Pass a complete checkpoint (an earlier step)"
        )
    return c


def open_checkpoint(
    path: str | Path, format: str | None = None, *, check: bool = True
) -> Checkpoint:
    """Open any supported checkpoint read-only and lazily.

    Args:
        path: file or directory.
        format: force a reader by name (see FORMATS); sniffed when None.
        check: refuse an incomplete checkpoint first (`require_complete`: a save that
            died half-way, a file cut short), naming what is missing.

    Raises:
        CheckpointNotFound, UnknownFormat, IncompleteCheckpoint, CorruptCheckpoint,
        UnsafeCheckpoint, OptimizerMappingError.
    """
    p = Path(path)
    must_exist(p)
    if check:
        require_complete(p, format)
    with doing(f"reading checkpoint {p}"):
        target, kind = _target(p, format)
        ck = open_torch_file(target) if kind == "torch-file" else FORMATS[kind](target)
    _step_from_name(ck, p)
    return ck


def _step_from_name(ck: Checkpoint, path: Path) -> None:
    """A checkpoint that does not record its step is read at the step its name says
    (`step_000060.pt`, `ckpt_60.pt`): own loops save the weights and the optimizer alone."""
    if ck.step is not None:
        return
    step = step_of_name(path)
    if step is not None:
        ck.scalars["global_step"] = step
        ck.notes.append(
            f"step {step} read from the name {path.name!r} (the file does not record it)"
        )


def settle_pair(a: Checkpoint, b: Checkpoint) -> None:
    """Map optimizer ids that one checkpoint alone leaves ambiguous, from the pair's updates.

    Ids are positions in the run's param groups, the same in both checkpoints; the
    assignment whose Adam directions (m/(sqrt(v)+eps) at *before* and *after*) best explain
    the weight change a -> b is applied to both.

    Raises:
        OptimizerMappingError: the updates do not single one out (names the tensors).
    """
    pend_a, pend_b = a.pending_optimizer, b.pending_optimizer
    if a is b or pend_a is None or pend_b is None:
        return

    def delta(name: str) -> torch.Tensor:
        return (
            b.tensor(b.aliases.get(name, name)).double()
            - a.tensor(a.aliases.get(name, name)).double()
        )

    ids, label = settle_by_evidence(pend_b, delta, pend_b.osd, pend_a.osd)
    for ck, pend in ((a, pend_a), (b, pend_b)):
        ck.optimizer = view_from_ids(pend, ids, label)
        ck.pending_optimizer = None
        ck.notes = [n for n in ck.notes if "map ambiguously" not in n]
        ck.notes.append(f"optimizer ids: {label}")


def open_pair(
    a: str | Path, b: str | Path, format: str | None = None
) -> tuple[Checkpoint, Checkpoint]:
    """Open *before* and *after* and settle what only the pair can (see `settle_pair`)."""
    ca = open_checkpoint(a, format)
    try:
        cb = open_checkpoint(b, format)
        try:
            settle_pair(ca, cb)
        except BaseException:
            cb.close()
            raise
    except BaseException:
        ca.close()
        raise
    return ca, cb


def first_complete(candidates: list[tuple[int, Path]]) -> tuple[tuple[int, Path] | None, list[str]]:
    """The first checkpoint of `candidates` (in the order given: newest first for a
    rollback) that is complete by its format's rule (`formats.completeness`), and a note
    for each one passed over: a save that died half-way is the commonest state of the
    newest checkpoint after a crash, and must never be the one to roll back to.

    Returns:
        ((step, path) or None when none is complete, notes naming what each skipped one lacks).
    """

    skipped: list[str] = []
    for step, path in candidates:
        try:
            c = completeness(path)
        except ForensicsError as e:  # nothing a reader recognises: a save that died at once
            skipped.append(f"{path.name} skipped: {e}")
            continue
        if c.complete or not c.checked:
            return (step, path), skipped
        skipped.append(f"{path.name} skipped: incomplete ({'; '.join(c.problems)})")
    return None, skipped


def verify(path: str | Path, format: str | None = None) -> Verification:
    """Every file of the checkpoint at `path` read whole: each zip member (torch.save files:
    optimizer.pt, ckpt.pt, .ckpt, .pth; DCP's chunks) against the CRC-32 its zip records, in
    one sequential read (`formats.verify`). Files whose format carries no checksum
    (safetensors, JSON, DCP's metadata) are named as such: only their structure
    (`completeness`) was checked.

    Raises:
        CheckpointNotFound, UnknownFormat: nothing at `path` that a reader recognises.
        DamagedCheckpoint: a member fails its CRC-32 (the first named, with how many).
    """
    p = Path(path)
    must_exist(p)
    with doing(f"verifying {p}"):
        target, _ = _target(p, format)
        v = verify_files(target)
    if v.damaged:
        more = len(v.damaged) - 1
        raise DamagedCheckpoint(v.damaged[0] + (f" ({more} more damaged members)" if more else ""))
    return v
