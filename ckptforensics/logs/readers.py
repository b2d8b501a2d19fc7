"""The generic log formats, one reader each: a file (or run folder) -> its legs, each step ->
metrics as the trainer named them (`columns.canonical` adds our names afterwards), and the one
dispatch (`read_file`) over the formats registered (`registry`: these, the text logs of
`logs.text`, and each trainer's own from its `logs.py`).

A leg is what one process wrote between a start and a stop. A file holds one leg, or
several where the trainer appends after a restart (a printed log under `tee -a`, a JSONL the
loop reopens in append mode): a step logged again for a column it already has starts a new
leg there (`split_legs`).
"""

from __future__ import annotations

import json
import math
import sqlite3
import struct
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs.columns import IGNORED_TAG_SUFFIXES
from ckptforensics.logs.registry import (
    FORMATS,
    Leg,
    Rows,
    fix_rows,
    register_format,
    register_step_key,
    step_key,
    step_rule,
)

__all__ = [
    "Leg",
    "read_file",
    "MissingExtra",
    "split_legs",
    "numbers",
    "file_legs",
    "mtime",
    "mlflow_run_name",
]


class MissingExtra(ForensicsError):
    """A log format whose reader needs an optional package that is not installed."""


def mtime(path: Path) -> float:
    """The file's modification time (seconds since the epoch): when a format records no start."""
    return path.stat().st_mtime


def split_legs(seq: list[tuple[int, dict[str, float]]]) -> list[Rows]:
    """Rows in file order -> legs: a step lower than the row before, or a step logged again
    for a column it already has, is a restart logging from its checkpoint (the later leg
    wins when legs merge)."""
    legs: list[Rows] = [{}]
    prev = None
    for step, vals in seq:
        cur = legs[-1]
        if prev is not None and (step < prev or (step in cur and set(vals) & set(cur[step]))):
            legs.append({})
            cur = legs[-1]
        cur.setdefault(step, {}).update(vals)
        prev = step
    return [leg for leg in legs if leg]


def numbers(r: dict[str, object], skip: tuple[str, ...] = ()) -> dict[str, float]:
    """The numeric values of a record (numbers, and strings that parse as one; no booleans),
    less the keys in `skip`."""
    out = {}
    for k, v in r.items():
        if not k or k in skip or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = float(v)
        elif isinstance(v, str) and v.strip():
            try:
                out[k] = float(v)
            except ValueError:
                continue
    return out


def file_legs(path: Path, read: Callable[[Path], list[Rows]], kind: str) -> list[Leg]:
    """The legs `read` finds in one file, each started at the file's modification time."""
    t = mtime(path)
    return [Leg(str(path), rows, t, i, kind) for i, rows in enumerate(read(path))]


# ---------------------------------------------------------------- TensorBoard
def _tensorboard(path: Path) -> tuple[Rows, float, set[str]]:
    """Every scalar of one event file, by tensorboard's own reader (all points: its default
    keeps a 10,000-point reservoir sample of each tag). (rows, first event's wall time, the
    tags read)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise MissingExtra(
            f"{path}: reading TensorBoard event files needs the tensorboard package (pip install 'ckptforensics[tensorboard]')"
        ) from None
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    rows: Rows = {}
    start = math.inf
    tags = acc.Tags()
    read: set[str] = set()
    for tag in tags.get("scalars", []):
        if tag.endswith(IGNORED_TAG_SUFFIXES):
            continue
        read.add(tag)
        # Whole tags: `train/loss` and `eval/loss` are different curves, and
        # `optim/LR (group 1)` names its group; `columns.ALIASES` maps the known ones.
        for ev in acc.Scalars(tag):
            rows.setdefault(int(ev.step), {})[tag] = float(ev.value)
            start = min(start, ev.wall_time)
    for tag in tags.get("tensors", []):  # tf.summary.scalar (TF2) writes scalars as tensors
        if tag.endswith(IGNORED_TAG_SUFFIXES):
            continue
        read.add(tag)
        for ev in acc.Tensors(tag):
            if ev.tensor_proto.dtype in (1, 2) and not ev.tensor_proto.tensor_shape.dim:
                from tensorboard.util import tensor_util

                rows.setdefault(int(ev.step), {})[tag] = float(
                    tensor_util.make_ndarray(ev.tensor_proto)
                )
                start = min(start, ev.wall_time)
    return rows, start if math.isfinite(start) else mtime(path), read


def _tensorboard_legs(path: Path) -> list[Leg]:
    """One event file's leg, its steps moved to optimizer steps where a logger counts them
    behind (`step_rule`)."""
    rows, t, tags = _tensorboard(path)
    _, behind = step_rule(path, "tensorboard", tags)
    if behind:
        rows = {s + behind: v for s, v in rows.items()}
    return [Leg(str(path), rows, t, 0, "tensorboard")]


# ---------------------------------------------------------------- W&B offline runs
# A `.wandb` file is W&B's transaction log: a 7-byte header (":W&B", 0xBEE1, version 0),
# then LevelDB's log format (32 KiB blocks of records: crc32 of type+data, length, type
# FULL/FIRST/MIDDLE/LAST), each record a `wandb_internal_pb2.Record` protobuf. wandb >= 0.19
# reads it in its Go core only (the Python `wandb.sdk.internal.datastore` that did is gone),
# so the framing is read here and every record is decoded by the wandb package's own
# protobuf classes.
_W_BLOCK, _W_HEAD = 32768, 7


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ForensicsError(f"{path}: not a W&B transaction log (no :W&B header)")
    out, buf, i = [], b"", _W_HEAD
    while i + _W_HEAD <= len(data):
        left = _W_BLOCK - i % _W_BLOCK
        if left < _W_HEAD:  # a block's trailer: zero padding
            i += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[i : i + _W_HEAD])
        if kind == 0 and n == 0:  # preallocated tail of a run still being written
            break
        body = data[i + _W_HEAD : i + _W_HEAD + n]
        i += _W_HEAD + n
        if len(body) < n or zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            break  # a torn last record (the run was killed mid-write): keep what precedes it
        buf += body
        if kind in (1, 4):  # FULL or LAST
            out.append(buf)
            buf = b""
    return out


def _wandb(path: Path) -> tuple[Rows, float]:
    try:
        from wandb.proto import wandb_internal_pb2 as pb
    except ImportError:
        raise MissingExtra(
            f"{path}: reading W&B run files needs the wandb package (pip install 'ckptforensics[wandb]')"
        ) from None
    seq: list[dict[str, float]] = []
    start = math.inf
    for raw in _wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row: dict[str, float] = {}
        for item in rec.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            try:
                v = json.loads(item.value_json)
            except json.JSONDecodeError:
                continue
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[key] = float(v)
            elif v in ("NaN", "Infinity", "-Infinity"):
                row[key] = float(v.replace("Infinity", "inf"))
        if "_step" not in row:
            row["_step"] = float(rec.history.step.num)
        start = min(start, row.get("_timestamp", math.inf))
        seq.append(row)
    # The trainer's own step where it logs one (`step_key`), else W&B's _step (which counts
    # log() calls).
    key, shift = step_key({k for r in seq for k in r}) or ("_step", 0)
    rows: Rows = {}
    for r in seq:
        if key in r:
            rows.setdefault(int(r[key]) + shift, {}).update(
                {k: v for k, v in r.items() if not k.startswith("_") and k != key}
            )
    return rows, start if math.isfinite(start) else mtime(path)


def _wandb_legs(path: Path) -> list[Leg]:
    rows, t = _wandb(path)
    return [Leg(str(path), rows, t, 0, "wandb")]


# ---------------------------------------------------------------- MLflow file store
def _mlflow_run(run: Path) -> tuple[Rows, float, list[str]]:
    """One MLflow run folder (`mlruns/<experiment>/<run>/`): `metrics/<key>` files of
    `timestamp value step` lines (nested keys in sub-folders), as MLflow's FileStore writes them.
    (rows, start, the lines skipped: a torn or undecodable line, named by its file and number)."""
    rows: Rows = {}
    start = math.inf
    skipped: list[str] = []
    base = run / "metrics"
    for f in sorted(p for p in base.rglob("*") if p.is_file()):
        key = f.relative_to(base).as_posix()
        for n, raw in enumerate(f.read_bytes().splitlines(), 1):
            parts = raw.split()
            if len(parts) < 2:
                continue
            try:
                ts, value = float(parts[0]) / 1000.0, float(parts[1])
                step = int(parts[2]) if len(parts) > 2 else 0
            except ValueError:
                skipped.append(f"metrics/{key} line {n}: not 'timestamp value step'")
                continue
            rows.setdefault(step, {})[key] = value
            start = min(start, ts)
    return rows, start if math.isfinite(start) else mtime(run), skipped


def _mlflow_sqlite(db: Path) -> list[Leg]:
    """MLflow's SQL store (`sqlite:///mlflow.db`, MLflow 3's default): the newest active run
    and the earlier runs of its experiment and name, one leg each (tables `runs` and `metrics`
    as MLflow's SqlAlchemyStore lays them out: key, value, timestamp, run_uuid, step, is_nan)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)  # read-only: an input is never written
    try:
        runs = con.execute(
            "SELECT run_uuid, name, experiment_id, start_time FROM runs WHERE lifecycle_stage = 'active'"
        ).fetchall()
        if not runs:
            return []
        _, name, exp, _ = max(runs, key=lambda r: r[3] or 0)
        legs = []
        for uuid, rname, rexp, start in runs:
            if rname != name or rexp != exp:
                continue
            rows: Rows = {}
            for key, value, step, is_nan in con.execute(
                "SELECT key, value, step, is_nan FROM metrics WHERE run_uuid = ?", (uuid,)
            ):
                rows.setdefault(int(step), {})[key] = math.nan if is_nan else float(value)
            legs.append(Leg(f"{db}#{uuid}", rows, (start or 0) / 1000.0, 0, "mlflow"))
        return legs
    finally:
        con.close()


def mlflow_run_name(run: Path) -> str:
    """The run's name (tag mlflow.runName), or its id."""
    tag = run / "tags" / "mlflow.runName"
    return tag.read_text().strip() if tag.is_file() else run.name


# ---------------------------------------------------------------- dispatch
def read_file(path: Path) -> list[Leg]:
    """The legs of one log file (or MLflow run folder / W&B run folder): the first registered
    format that claims the file reads it (`registry.FORMATS`).

    Raises:
        ForensicsError: unreadable or unknown format; MissingExtra: its reader's package is absent.
    """
    try:
        if path.is_dir():
            if (path / "metrics").is_dir() and (path / "meta.yaml").is_file():
                rows, t, skipped = _mlflow_run(path)
                return [Leg(str(path), rows, t, 0, "mlflow", tuple(skipped))]
            found = sorted(path.glob("run-*.wandb"))
            if found:
                return read_file(found[0])
            raise ForensicsError(f"{path}: a folder that is neither an MLflow run nor a W&B run")
        fmt = next(f for f in FORMATS if f.claims(path))
        legs = fmt.read(path)
        return [replace(leg, rows=fix_rows(leg.rows)) for leg in legs] if fmt.shared else legs
    except (
        OSError,
        UnicodeDecodeError,
        ValueError,
        json.JSONDecodeError,
        struct.error,
        sqlite3.Error,
    ) as e:
        raise ForensicsError(f"{path}: not a readable training log ({e})") from None


# The generic formats, among which each trainer's `logs.py` places its own (order 40-70).
register_format("tensorboard", lambda p: p.name.startswith("events.out.tfevents"), _tensorboard_legs, order=10)  # fmt: skip
register_format("mlflow", lambda p: p.suffix == ".db", _mlflow_sqlite, order=20, shared=False)
register_format("wandb", lambda p: p.suffix == ".wandb", _wandb_legs, order=30)
# A step column of no trainer's own (each trainer's `logs.py` adds its own before these).
register_step_key("global_step", 0, order=30)
register_step_key("iteration", 0, order=40)
