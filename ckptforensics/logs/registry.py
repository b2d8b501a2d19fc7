"""The log registry: the formats `read_file` asks in turn, the places `find_logs` looks in turn,
and the trainers' conventions on the formats they share (the step column a logger writes, steps
counted one behind, a column logged a step early). `logs` registers the generic ones; each
trainer's `logs.py` its own as its package loads (`trainers` imports them: code that reads logs
imports `trainers` first, as `checkpoints` does for the checkpoint readers).

Each entry has an `order`, lower asked first, so that a trainer's entry takes its place among
the generic ones whichever module loads first; a second entry under one name is a programming
error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Rows",
    "Leg",
    "LogFormat",
    "Finder",
    "RunFiles",
    "FORMATS",
    "FINDERS",
    "register_format",
    "register_finder",
    "register_rows",
    "register_step_key",
    "register_step_rule",
    "fix_rows",
    "step_key",
    "step_rule",
]

Rows = dict[int, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Leg:
    """What one run of the trainer logged: its rows, where from, and when it started.

    Attributes:
        source: the file (or run folder) it was read from.
        rows: step -> {column: value}, steps as the trainer counts optimizer steps.
        started: wall-clock start (seconds since the epoch) where the format records one
            (TensorBoard, W&B, MLflow), else the file's modification time.
        order: position within its file (0 for the first leg).
        kind: the format (`LogFormat.name`: "tensorboard", "wandb", ...).
        skipped: the file's lines that were not read and why ("line 31: truncated JSON"),
            on its first leg (a file none of whose lines reads gives a leg with no rows).
    """

    source: str
    rows: Rows
    started: float
    order: int
    kind: str
    skipped: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LogFormat:
    """One log format.

    Attributes:
        name: the format, as its legs' `kind` says it.
        claims: whether a file is this format's (asked in `order`: the first that claims a
            file reads it, so a catch-all comes last).
        read: the file -> its legs.
        shared: a format several trainers write (TensorBoard, W&B, CSV, JSONL): every trainer's
            row convention (`register_rows`) applies to its rows.
        order: its place among the formats, lower asked first.
    """

    name: str
    claims: Callable[[Path], bool]
    read: Callable[[Path], list[Leg]]
    shared: bool
    order: float


class RunFiles:
    """A run folder as the finders see it: its path, and its files at most three folders down
    (checkpoint folders, hidden folders, W&B's and MLflow's stores skipped), walked once, when
    a finder first asks."""

    # Folders the walk does not enter: checkpoints are large and hold no logs of their own
    # that the finders want (a checkpoint's trainer_state.json is looked up through
    # formats.list_checkpoints).
    SKIP = re.compile(
        r"^(?:iter_\d+|global_step\d+|checkpoint-\d+|step[-_]?\d+|\..*|__pycache__|wandb|mlruns)$"
    )

    def __init__(self, path: Path) -> None:
        self.path = path
        self._files: list[Path] | None = None

    @property
    def files(self) -> list[Path]:
        if self._files is None:
            self._files = list(self._walk(self.path))
        return self._files

    def _walk(self, root: Path, depth: int = 3) -> Iterator[Path]:
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.is_file():
                yield Path(e.path)
            elif e.is_dir() and depth > 0 and not self.SKIP.match(e.name):
                yield from self._walk(Path(e.path), depth - 1)


@dataclass(frozen=True, slots=True)
class Finder:
    """One place a run's log may be.

    Attributes:
        name: what it finds.
        find: the run folder -> the files of its log there, [] when none.
        what: how the error for a run with no log names it ("" for none).
        order: its place among the finders, lower asked first (the first that finds wins).
    """

    name: str
    find: Callable[[RunFiles], list[Path]]
    what: str
    order: float


FORMATS: list[LogFormat] = []
FINDERS: list[Finder] = []
# Each trainer's convention on the rows of a shared format, in the order registered.
_ROW_FIXES: dict[str, Callable[[Rows], Rows]] = {}
# (order, key, steps behind): the trainer's own step column, where a logger logs one.
_STEP_KEYS: list[tuple[float, str, int]] = []
# (order, name, rule): a logger's step column and offset, judged from the file and its columns.
StepRule = Callable[[Path, str, set[str]], tuple[str | None, int] | None]
_STEP_RULES: list[tuple[float, str, StepRule]] = []


def register_format(
    name: str,
    claims: Callable[[Path], bool],
    read: Callable[[Path], list[Leg]],
    *,
    order: float,
    shared: bool = True,
) -> None:
    """Add a log format: `claims(path)`, asked in `order` among the others, and `read(path)
    -> legs` for the files it claims (`LogFormat`)."""
    if any(f.name == name for f in FORMATS):
        raise ValueError(f"log format {name!r} is already registered")
    FORMATS.append(LogFormat(name, claims, read, shared, order))
    FORMATS.sort(key=lambda f: f.order)


def register_finder(
    name: str, find: Callable[[RunFiles], list[Path]], *, order: float, what: str = ""
) -> None:
    """Add a place a run's log may be (`Finder`), asked in `order` among the others."""
    if any(f.name == name for f in FINDERS):
        raise ValueError(f"log finder {name!r} is already registered")
    FINDERS.append(Finder(name, find, what, order))
    FINDERS.sort(key=lambda f: f.order)


def register_rows(name: str, fix: Callable[[Rows], Rows]) -> None:
    """Add a trainer's convention on a shared format's rows: `fix(rows) -> rows` (Megatron-LM's
    LR, logged a step early, moved to the step it is for). Applied to each leg and again to the
    merged legs (`read_log`): a function of the log's own columns, so applying it twice is
    applying it once."""
    if name in _ROW_FIXES:
        raise ValueError(f"row convention {name!r} is already registered")
    _ROW_FIXES[name] = fix


def register_step_key(key: str, behind: int, *, order: float) -> None:
    """Add a trainer's own step column (`train/global_step`), which a logger that counts its
    own steps (W&B's `_step`) or none (a CSV) logs beside the metrics, and how many steps it
    runs behind the optimizer steps; the first present in `order` is the step."""
    if any(k == key for _, k, _ in _STEP_KEYS):
        raise ValueError(f"step column {key!r} is already registered")
    _STEP_KEYS.append((order, key, behind))
    _STEP_KEYS.sort(key=lambda e: e[0])


def register_step_rule(name: str, rule: StepRule, *, order: float) -> None:
    """Add a logger's step convention: `rule(path, format, columns)` -> (the step column, None
    for the format's usual one; how many steps the file runs behind the optimizer steps), or
    None where it does not apply. The first that applies, in `order`, decides."""
    if any(n == name for _, n, _ in _STEP_RULES):
        raise ValueError(f"step rule {name!r} is already registered")
    _STEP_RULES.append((order, name, rule))
    _STEP_RULES.sort(key=lambda e: e[0])


def fix_rows(rows: Rows) -> Rows:
    """A shared format's rows with every trainer's row convention applied."""
    for fix in _ROW_FIXES.values():
        rows = fix(rows)
    return rows


def step_key(cols: set[str] | dict[str, object]) -> tuple[str, int] | None:
    """(the trainer's own step column among `cols`, how many steps it runs behind), or None."""
    return next(((k, behind) for _, k, behind in _STEP_KEYS if k in cols), None)


def step_rule(path: Path, fmt: str, cols: set[str]) -> tuple[str | None, int]:
    """(the step column, None for the format's usual one; steps behind) of the first step rule
    that applies to this file, else (None, 0)."""
    for _, _, rule in _STEP_RULES:
        got = rule(path, fmt, cols)
        if got is not None:
            return got
    return None, 0
