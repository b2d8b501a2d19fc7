"""Training logs: find a run's logs, read each in its trainer's format, and merge the legs of
a restarted run into one step -> metrics table.

Generic formats here: JSONL; CSV (a CSVLogger's; W&B's CSV exports, untested on a real one);
TensorBoard event files (the tensorboard extra); W&B offline runs (`.wandb`, the wandb extra);
MLflow's local stores (`mlruns/`; `mlflow.db`, MLflow 3's default). A trainer's own format
(its printed log, its per-step metrics files, its state file), where it leaves its log and how
its loggers count steps are its `logs.py`'s (trainers/<t>/), registered here (`registry`) as
`trainers` loads: code that reads logs imports `trainers` first. Shared by `triage` and the
replay (which takes each step's LR and the history before its window from here):
`read_metrics(path) -> {step: {"loss", "grad_norm", "lr", per-group LRs, "loss_scale", ...}}`,
steps as the trainer counts optimizer steps (docs/internals.md, the triage section: training
logs).
"""

from __future__ import annotations

import glob as _glob
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs.columns import (
    ALIASES,
    canonical,
    group_lrs,
    lr_columns,
    param_grad_columns,
    register_log_names,
)
from ckptforensics.logs.discover import LOGGER_STORES, find_logs, log_dirs, logger_logs, looked_for
from ckptforensics.logs.readers import Leg, MissingExtra, read_file
from ckptforensics.logs.registry import (
    FORMATS,
    fix_rows,
    register_finder,
    register_format,
    register_rows,
    register_step_key,
    register_step_rule,
)
from ckptforensics.logs.text import text_legs, text_lines  # registers JSONL and CSV

__all__ = [
    "MetricsLog",
    "LegInfo",
    "read_log",
    "read_metrics",
    "unreadable",
    "skipped_note",
    "skipped_lines",
    "find_logs",
    "logger_logs",
    "log_dirs",
    "find_metrics",
    "discover_metrics",
    "group_lrs",
    "lr_columns",
    "param_grad_columns",
    "ALIASES",
    "MissingExtra",
    "text_legs",
    "text_lines",
    "register_format",
    "register_finder",
    "register_rows",
    "register_step_key",
    "register_step_rule",
    "register_log_names",
]

Rows = dict[int, dict[str, float]]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LegInfo:
    """One leg as read: its file, its format, its steps, and the steps a later leg replaced."""

    source: str
    kind: str
    first: int
    last: int
    steps: int
    superseded: int  # of its steps, how many a later leg logged again (the later leg won)
    skipped: tuple[str, ...] = ()  # its file's lines not read, and why ("line 31: truncated JSON")


@dataclass(frozen=True, slots=True)
class MetricsLog:
    """A run's log, merged: the rows, and which files and legs made them."""

    rows: Rows
    files: list[str]
    legs: list[LegInfo] = field(default_factory=list)
    # One line per file with lines that were not read: which, and why (`skipped_note`).
    skipped: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        kinds = sorted({leg.kind for leg in self.legs})
        return "+".join(kinds) if kinds else "unknown"


def merge_legs(legs: list[Leg]) -> tuple[Rows, list[LegInfo]]:
    """One timeline from the legs of a restarted run: legs in the order they started, each
    replacing every step from its first on (a restart resumes from a checkpoint: what the
    earlier leg logged past that point is what the run undid)."""
    ordered = sorted(legs, key=lambda leg: (leg.started, leg.source, leg.order))
    rows: Rows = {}
    owner: dict[tuple[int, str], int] = {}
    lost = [0] * len(ordered)
    for i, leg in enumerate(ordered):
        if not leg.rows:
            continue
        first = min(leg.rows)
        cols = {k for v in leg.rows.values() for k in v}
        # Only the columns this leg logs: two writers of one run (a train and an eval
        # writer, the trainer's log beside a callback's) are not restarts of each other.
        for s in [s for s in rows if s >= first]:
            hit = cols & set(rows[s])
            for k in hit:
                del rows[s][k]
            if hit:
                lost[owner[(s, next(iter(hit)))]] += 1
            if not rows[s]:
                del rows[s]
        for s, v in leg.rows.items():
            rows.setdefault(s, {}).update(v)
            for k in v:
                owner[(s, k)] = i
    info = [
        LegInfo(
            leg.source, leg.kind, min(leg.rows), max(leg.rows), len(leg.rows), lost[i], leg.skipped
        )
        for i, leg in enumerate(ordered)
        if leg.rows
    ]
    return dict(sorted(rows.items())), info


def _paths(path: Path | str) -> list[Path]:
    """A file, a folder (the logs `find_logs` finds in it) or a glob -> the log files."""
    p = Path(path)
    if any(c in str(path) for c in "*?["):
        found = [Path(f) for f in sorted(_glob.glob(str(path), recursive=True))]
        files = [f for f in found if f.is_file() or (f / "meta.yaml").is_file()]
        if not files:
            raise ForensicsError(f"{path}: no training log matches")
        return files
    if p.is_dir():
        if (p / "meta.yaml").is_file() and (p / "metrics").is_dir():  # one MLflow run
            return [p]
        if any(p.glob("run-*.wandb")):  # one W&B run folder (wandb/latest-run, say)
            # latest-run is the run: every leg of its id (a resumed run keeps its id), as the
            # wandb/ folder gives them.
            legs = logger_logs(p.parent) if p.name == "latest-run" else []
            ids = {f.stem for f in p.glob("run-*.wandb")}
            return [f for f in legs if f.stem in ids] or sorted(p.glob("run-*.wandb"))
        # A logger's own folder in the run (wandb/, mlruns/, lightning_logs/, runs/): what the
        # run folder's places find inside it; a store the run folder's walk skips, first.
        files = (
            (logger_logs(p) or find_logs(p))
            if p.name in LOGGER_STORES
            else (find_logs(p) or logger_logs(p))
        )
        if not files:
            raise ForensicsError(
                f"{p}: no training log in this folder (see `ckptforensics triage --help` for the formats read)"
            )
        return files
    if not p.is_file():
        raise ForensicsError(f"{p}: no such training log")
    return [p]


def skipped_note(source: str, skipped: tuple[str, ...] | list[str], shown: int = 5) -> str:
    """One line on a file's lines not read: '{file}: 2 lines skipped (line 31: truncated
    JSON; line 45: not UTF-8 text (binary bytes))', the first `shown` of them named."""
    more = f"; {len(skipped) - shown} more" if len(skipped) > shown else ""
    n = len(skipped)
    return f"{source}: {n} line{'s' if n != 1 else ''} skipped ({'; '.join(skipped[:shown])}{more})"


def read_log(path: Path | str, keys: dict[str, str] | None = None) -> MetricsLog:
    """The run's log at `path` (a file, a run's log folder, or a glob), every leg merged.
    Every line that parses is read; the lines that do not (a truncated JSON line, bytes that
    are not UTF-8) are skipped, logged as a warning and listed (`MetricsLog.skipped`,
    `LegInfo.skipped`).

    Args:
        path: the log.
        keys: our name -> the log's column name (e.g. {"loss": "train/loss"}).

    Raises:
        ForensicsError: no log there, an unreadable or unknown format, a log none of whose
            lines reads; MissingExtra (a ForensicsError) when the format's reader needs a
            package not installed.
    """
    files = _paths(path)
    legs = [leg for f in files for leg in read_file(f)]
    rows, info = merge_legs(legs)
    if any(f.shared and f.name in {leg.kind for leg in legs} for f in FORMATS):
        # Again on the merged timeline: a convention that reads a neighbouring step (Megatron's
        # LR, logged a step early) has, at a restarted leg's first step, only the earlier leg's
        # row to read (the checkpoint the restart loaded left the scheduler where that row says).
        rows = fix_rows(rows)
    canonical(rows, keys)
    notes = [skipped_note(leg.source, leg.skipped) for leg in legs if leg.skipped]
    if not rows and notes:
        said = (
            notes[0].removeprefix(f"{files[0]}: ")
            if len(notes) == 1 and len(files) == 1
            else "; ".join(notes)
        )
        raise ForensicsError(f"{path}: no line reads as a training log: {said}")
    for note in notes:
        _warn_once(f"training log {note}; the rest read")
    _SKIPPED[str(path)] = notes
    return MetricsLog(rows, [str(f) for f in files], info, notes)


def read_metrics(path: Path | str, keys: dict[str, str] | None = None) -> Rows:
    """step -> metrics from a training log (`read_log`'s rows): our names `loss`,
    `grad_norm`, `lr`, `loss_scale`, `skipped` beside the log's own columns.

    For the commands whose log is optional (replay, whatif, bisect, audit: the log checks
    and informs them, they run without it): a log that cannot be read is logged as a
    warning and read as no rows (`unreadable` says why). `read_log` raises instead."""
    try:
        return read_log(path, keys).rows
    except ForensicsError as e:
        _warn_once(f"{e}; going on without the training log")
        return {}


# What was said already: a command reads its log more than once (a what-if's variants, the
# bisection's replays); a damaged line is said once.
_SAID: set[str] = set()
# The lines skipped when each log was last read (`read_log`'s notes), by the path as given.
_SKIPPED: dict[str, list[str]] = {}


def skipped_lines(path: Path | str) -> list[str]:
    """The notes on the lines skipped when the log at `path` was last read in this process
    (`MetricsLog.skipped`; [] when none were, or it was not read): what a command that read
    it through `read_metrics` says in its report."""
    return list(_SKIPPED.get(str(path), []))


def _warn_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        log.warning("%s", message)


def unreadable(path: Path | str) -> str | None:
    """Why the training log at `path` cannot be read (`read_log`'s one line), None when it can."""
    try:
        read_log(path)
    except ForensicsError as e:
        return str(e)
    return None


def find_metrics(run_dir: Path) -> Path | None:
    """The run's training log: the file when there is one, the folder when the run's log is
    several files (legs of a restarted run; `read_metrics` merges them), None when none."""
    files = find_logs(run_dir)
    if not files:
        return None
    return files[0] if len(files) == 1 else run_dir


def discover_metrics(run_dir: Path) -> Path:
    """`find_metrics`, or a one-line error naming what was looked for."""
    found = find_metrics(run_dir)
    if found is None:
        raise ForensicsError(
            f"no training log in {run_dir} (looked for {looked_for()}); pass --metrics"
        )
    return found
