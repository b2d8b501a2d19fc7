"""Resolve `--before 41950` inside a run directory to the checkpoint trainers wrote for it."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ckptforensics.core.errors import CheckpointNotFound

__all__ = [
    "resolve_checkpoint",
    "list_checkpoints",
    "must_exist",
    "STEP_PATTERNS",
]

# The names trainers write, with the step as the one group. Order is documentation only:
# a step that matches several entries is an error, never a silent pick.
STEP_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("HF Trainer", re.compile(r"^checkpoint-(\d+)$")),
    ("DeepSpeed", re.compile(r"^global_step(\d+)$")),
    ("Megatron", re.compile(r"^iter_(\d+)$")),
    (
        "torchtitan / OLMo-core / step_N",
        re.compile(r"^step[-_]?(\d+)(?:\.(?:pt|pth|bin|safetensors|ckpt))?$"),
    ),
    ("Lightning", re.compile(r"^.*step=(\d+).*\.ckpt$")),
)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """All (step, path) pairs in `run_dir` whose names follow a known pattern, by step."""
    found: list[tuple[int, Path]] = []
    if not run_dir.is_dir():
        _refuse_loop(run_dir)
        return found
    # Lightning's default layout keeps them in the logger's version folder:
    # `lightning_logs/version_N/checkpoints/` (or `checkpoints/` of the folder given).
    nested = [
        run_dir / "checkpoints",
        *sorted(run_dir.glob("lightning_logs/version_*/checkpoints")),
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
