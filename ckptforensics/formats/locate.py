"""Resolve `--before 41950` inside a run directory to the checkpoint trainers wrote for it.

The names trainers give their checkpoints are each trainer's (`STEP_NAMES` in its package,
registered here by `trainers` as it loads: code that resolves steps imports `trainers` first,
as `checkpoints` does); the plain `step_N` is this module's own."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ckptforensics.core.errors import CheckpointNotFound

__all__ = [
    "resolve_checkpoint",
    "list_checkpoints",
    "step_of_name",
    "must_exist",
    "register_step_names",
    "register_checkpoint_dirs",
    "STEP_PATTERNS",
    "CHECKPOINT_DIRS",
    "STEP_N",
]

# The names trainers write, with the step as the one group: (who writes it, the pattern), in
# `order` (`register_step_names`). Order is documentation only: a step that matches several
# entries is an error, never a silent pick.
STEP_PATTERNS: list[tuple[str, re.Pattern[str]]] = []
# (order, who, pattern) as registered; STEP_PATTERNS is built from them.
_NAMES: list[tuple[float, str, re.Pattern[str]]] = []
# Folders of the run directory (globs) where a trainer keeps its checkpoints, beside `checkpoints/`.
CHECKPOINT_DIRS: list[str] = []
# The plain name: `step-N`, `stepN`, `step_N`, a folder or a file.
STEP_N = r"^step[-_]?(\d+)(?:\.(?:pt|pth|bin|safetensors|ckpt))?$"


def register_step_names(who: str, pattern: str, *, order: float) -> None:
    """Add a name checkpoints are written under (`pattern`, the step as its one group) and who
    writes it; several writers of one pattern share its entry, named in `order`.

    Raises:
        ValueError: `who` is registered already.
    """
    if any(w == who for _, w, _ in _NAMES):
        raise ValueError(f"checkpoint names of {who!r} are already registered")
    _NAMES.append((order, who, re.compile(pattern)))
    groups: dict[str, list[tuple[float, str, re.Pattern[str]]]] = {}
    for entry in sorted(_NAMES, key=lambda e: e[0]):
        groups.setdefault(entry[2].pattern, []).append(entry)
    STEP_PATTERNS[:] = [(" / ".join(w for _, w, _ in g), g[0][2]) for g in groups.values()]


def register_checkpoint_dirs(pattern: str) -> None:
    """Add the folders (a glob in the run directory) where a trainer keeps its checkpoints."""
    if pattern not in CHECKPOINT_DIRS:
        CHECKPOINT_DIRS.append(pattern)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """All (step, path) pairs in `run_dir` whose names follow a known pattern, by step."""
    found: list[tuple[int, Path]] = []
    if not run_dir.is_dir():
        _refuse_loop(run_dir)
        return found
    # `checkpoints/` of the folder given, and the folders trainers keep them in (Lightning's
    # logger version folders: `lightning_logs/version_N/checkpoints/`).
    nested = [
        run_dir / "checkpoints",
        *(d for pattern in CHECKPOINT_DIRS for d in sorted(run_dir.glob(pattern))),
    ]
    children = [c for d in [run_dir, *nested] if d.is_dir() for c in d.iterdir()]
    for child in children:
        for _, pattern in STEP_PATTERNS:
            m = pattern.match(child.name)
            if m:
                found.append((int(m.group(1)), child))
                break
    # DeepSpeed under an HF dir or a save dir: checkpoint-N/global_stepN is one checkpoint,
    # already listed through its parent.
    return sorted(found, key=lambda sp: (sp[0], sp[1].name))


def step_of_name(path: Path) -> int | None:
    """The step a checkpoint's own name says (`step_000060.pt`, `state_step000060.pt`,
    `ckpt_60.pt`, a folder `step-60`): what a checkpoint that does not record its step is read
    at. None where the name follows no known pattern, or the patterns that match it disagree
    on its step (a name is never read two ways). Its folder's name is not asked: a file in
    `model_2/` is not step 2."""
    steps = {int(m.group(1)) for _, pattern in STEP_PATTERNS if (m := pattern.match(path.name))}
    return steps.pop() if len(steps) == 1 else None


def resolve_checkpoint(spec: str | Path, run_dir: str | Path = ".") -> Path:
    """A step number or a path -> the checkpoint path.

    Args:
        spec: a step (`"41950"`) resolved in `run_dir`, or a path taken as it is.
        run_dir: where trainers wrote their checkpoints.

    Returns:
        The checkpoint file or directory.

    Raises:
        CheckpointNotFound: no checkpoint, or several, for that step; the message lists
            what the run directory holds.
    """
    text = str(spec)
    run = Path(run_dir)
    if not text.isdigit():
        path = Path(text)
        _refuse_loop(path)
        if not path.exists():
            raise CheckpointNotFound(f"{path}: no such file or directory")
        return path
    step = int(text)
    found = list_checkpoints(run)
    matches = [p for s, p in found if s == step]
    if len(matches) == 1:
        return matches[0]
    if not run.is_dir():
        _refuse_loop(run)
        what = "is not a directory" if run.exists() else "does not exist"
        raise CheckpointNotFound(f"run directory {run} {what}; pass --run-dir or a checkpoint path")
    listing = ", ".join(p.name for _, p in found[:12]) or "no checkpoints"
    more = f" (+{len(found) - 12} more)" if len(found) > 12 else ""
    if not matches:
        raise CheckpointNotFound(
            f"no checkpoint for step {step} in {run}; found: {listing}{more}. "
            "Pass another step, --run-dir, or the checkpoint's path"
        )
    names = ", ".join(p.name for p in matches)
    raise CheckpointNotFound(f"step {step} is ambiguous in {run}: {names}; pass the path instead")


def must_exist(path: Path) -> None:
    """A path that is there and readable, or a CheckpointNotFound that says why not: missing,
    a symlink that leads nowhere (a loop, or dangling; `exists()` would only say False, and
    the user would look for a missing file), a directory on the way that cannot be entered,
    or no permission to read it."""
    try:
        path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointNotFound(
                f"{path}: a symlink loop ({e.strerror}); pass the checkpoint itself"
            ) from None
        if path.is_symlink():
            raise CheckpointNotFound(
                f"{path}: a symlink to nothing ({os.readlink(path)}); pass the checkpoint itself"
            ) from None
        if isinstance(e, FileNotFoundError):
            raise CheckpointNotFound(f"{path}: no such file or directory") from None
        raise CheckpointNotFound(f"{path}: {e.strerror or e}") from None
    need = os.R_OK | (os.X_OK if path.is_dir() else 0)
    if not os.access(path, need, effective_ids=os.access in os.supports_effective_ids):
        what = "a directory" if path.is_dir() else "a file"
        raise CheckpointNotFound(
            f"{path}: {what} this user may not read (permission denied); fix its permissions or run as its owner"
        )


def _refuse_loop(path: Path) -> None:
    """A name that is a symlink leading nowhere: said as such."""
    if path.is_symlink():
        must_exist(path)


register_step_names("step_N", STEP_N, order=4.9)
