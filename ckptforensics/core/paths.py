"""Paths a run recorded relative to the directory it was launched from.

Launch scripts pass paths relative to where they run (`--data-path data/text`,
`--data-cache-path cache`, `output_dir=out/run1`, OLMo-core's `dataset.paths`), and the
trainers store them as given: Megatron-LM's args, the HF Trainer's TrainingArguments and
OLMo-core's config.json all keep the string, not the absolute path. Read back elsewhere, such
a path means nothing on its own. The launch directory is almost always the run directory or
one of its parents (the run's output sits under where it was launched), else the data sits
beside the launch directory: a relative path is tried against the run directory, each of its
parents up to the root, then `--data`'s parent, in that order, and the first that holds it is
used and stated. Never the current directory: where the tool runs says nothing about where
the run was launched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Resolved", "resolve_recorded"]


@dataclass(frozen=True, slots=True)
class Resolved:
    """A recorded path found on disk, and how (for `replay.config`)."""

    path: Path
    how: str


def _bases(run_dir: Path, data: Path | None) -> list[tuple[Path, str]]:
    run = run_dir.absolute()
    out = [(run, f"the run directory {run}")]
    out += [(p, f"the run directory's parent {p}") for p in run.parents]
    if data is not None:
        out.append((data.absolute().parent, f"--data's parent {data.absolute().parent}"))
    return out


def resolve_recorded(
    recorded: str | None,
    run_dir: Path,
    data: Path | None = None,
    holds: Callable[[Path], bool] = Path.exists,
) -> Resolved | None:
    """Where the run's recorded path is now: as recorded when absolute, else against the run
    directory, its parents, and `--data`'s parent, in that order; the first where `holds`
    is true (default: the path exists). None when none holds."""
    if not recorded:
        return None
    p = Path(recorded).expanduser()
    if p.is_absolute():
        return Resolved(p, f"{recorded} (absolute, as recorded)") if holds(p) else None
    for base, label in _bases(run_dir, data):
        cand = base / p
        if holds(cand):
            return Resolved(cand, f"{recorded} resolved against {label}")
    return None
