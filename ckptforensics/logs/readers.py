"""One reader per log format: a file (or run folder) -> its legs, each step -> metrics as the
trainer named them (`columns.canonical` adds our names afterwards).

A leg is what one process wrote between a start and a stop. A file holds one leg, or
several where the trainer appends after a restart (Megatron's printed log under `tee -a`,
a JSONL the loop reopens in append mode): a step logged again for a column it already has
starts a new leg there (`_split_legs`).

One reader per format, each a few dozen lines, in one module (just past 400 lines): they
share the leg splitting, the number parsing and the one dispatch at the bottom.

Over 400 lines: one small reader per log format behind one dispatch table; the table is the
contract, and it reads in one file.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sqlite3
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs.columns import IGNORED_TAG_SUFFIXES

__all__ = ["Leg", "read_file", "MissingExtra", "MEGATRON_LINE"]

Rows = dict[int, dict[str, float]]


class MissingExtra(ForensicsError):
    """A log format whose reader needs an optional package that is not installed."""


@dataclass(frozen=True, slots=True)
class Leg:
    """What one run of the trainer logged: its rows, where from, and when it started.

    Attributes:
        source: the file (or run folder) it was read from.
        rows: step -> {column: value}, steps as the trainer counts optimizer steps.
        started: wall-clock start (seconds since the epoch) where the format records one
            (TensorBoard, W&B, MLflow), else the file's modification time.
        order: position within its file (0 for the first leg).
        kind: the format ("megatron", "tensorboard", "wandb", ...).
    """

    source: str
    rows: Rows
    started: float
    order: int
    kind: str


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def _split_legs(seq: list[tuple[int, dict[str, float]]]) -> list[Rows]:
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


def _numbers(r: dict[str, object], skip: tuple[str, ...] = ()) -> dict[str, float]:
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


# ---------------------------------------------------------------- JSONL, CSV, HF, OLMo-core
def _jsonl(path: Path) -> list[Rows]:
    seq = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict) and "step" in r:
            seq.append((int(r["step"]), _numbers(r, ("step",))))
    return _split_legs(seq)


# W&B's chart export ("Export CSV"): "Step" plus "<run name> - <key>" and its "__MIN" /
# "__MAX" band columns; its run-table export (`run.history()`): "_step" and the keys.
_WANDB_EXPORT = re.compile(r"^(?:.+ - )?(.+?)(?:__MIN|__MAX)?$")


def _csv(path: Path, lightning: bool) -> list[Rows]:
    records = list(csv.DictReader(path.read_text().splitlines()))
    if not records:
        return []
    cols = set(records[0])
    # LitGPT logs each iteration at logger step iter_num - 1; its checkpoints count
    # optimizer steps (step_count = iter_num without gradient accumulation).
    litgpt = {"iter", "iter_time", "remaining_time"} <= cols
    wandb_chart = "Step" in cols and any(" - " in c for c in cols)
    trainer_step = _trainer_step_key(cols)
    col = (
        "iter"
        if litgpt
        else "Step"
        if wandb_chart
        else trainer_step or ("step" if "step" in cols else "_step" if "_step" in cols else None)
    )
    if col is None:
        raise ForensicsError(
            f"{path}: a CSV log needs a step column (step, _step, Step, iter or a trainer's global_step)"
        )
    # Lightning's CSVLogger: an `epoch` column on every row (its logger connector adds it).
    shift = (
        1
        if (not litgpt and "epoch" in cols and "step" in cols and lightning)
        or trainer_step == "trainer/global_step"
        else 0
    )
    seq = []
    for r in records:
        if r.get(col) in (None, ""):
            continue
        vals = _numbers(
            {k: v for k, v in r.items() if k and not k.endswith(("__MIN", "__MAX"))},
            ("step", col, "Step", "_step", "_runtime", "_timestamp"),
        )
        if wandb_chart:
            vals = {_WANDB_EXPORT.match(k).group(1): v for k, v in vals.items()}  # type: ignore[union-attr]
        seq.append((int(float(r[col])) + shift, vals))
    return _split_legs(seq)


def _trainer_state(path: Path) -> list[Rows]:
    state = json.loads(path.read_text())
    rows: Rows = {}
    for r in state.get("log_history", []):
        if "step" in r:
            d = rows.setdefault(int(r["step"]), {})
            d.update(_numbers(r, ("step",)))
            if "learning_rate" in r:
                d["lr"] = float(r["learning_rate"])
    return [rows]


OLMO_METRICS = re.compile(r"^metrics_step(\d+)\.json$")


def _olmo_metrics(folder: Path) -> list[Rows]:
    """OLMo-core's MetricSaverCallback: one `metrics_step{N}.json` per step in the save folder."""
    rows: Rows = {}
    for f in folder.iterdir():
        m = OLMO_METRICS.match(f.name)
        if m:
            rows[int(m.group(1))] = _numbers(json.loads(f.read_text()))
    return [rows]


# ---------------------------------------------------------------- Megatron's printed log
# megatron/training/training.py training_log(): " [date] iteration {:8d}/{:8d} | consumed
# samples: {:12d} | ... | learning rate: {:.6E} | global batch size: {:5d} | lm loss: {:.6E}
# | loss scale: {:.1f} | grad norm: {:.3f} | ... | number of skipped iterations: {:3d} |
# number of nan iterations: {:3d} |" (older Megatron-LM and Megatron-DeepSpeed: no date,
# "learning rate: {:.3E}", plus "consumed tokens", "actual seqlen", "samples per second",
# "TFLOPs"). Each line is printed every --log-interval iterations; its losses average the
# interval's advanced (not skipped) iterations; "iteration N" counts iterations done.
MEGATRON_LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_FIELD = re.compile(r"\s*([^|:]+?)\s*:\s*([-+0-9.eEinfa]+)\s*$")


def megatron_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(iteration, {field: value}) of one printed iteration line, or None."""
    m = MEGATRON_LINE.search(line)
    if not m:
        return None
    vals: dict[str, float] = {}
    for part in m.group(3).split("|"):
        f = _FIELD.match(part)
        if f:
            try:
                vals[f.group(1)] = float(f.group(2))
            except ValueError:
                continue
    return int(m.group(1)), vals


def _megatron_text(path: Path) -> list[Rows]:
    seq = []
    with path.open(errors="replace") as f:
        for line in f:
            got = megatron_line(line)
            if got is not None:
                # An interval whose iterations were all skipped averages no loss: Megatron-LM
                # prints its 0.0 (`if avg >= 0.0`), which is no loss.
                if got[1].get("lm loss") == 0.0:
                    del got[1]["lm loss"]
                seq.append(got)
    return _split_legs(seq)


def is_megatron_text(path: Path) -> bool:
    """A text file with at least one Megatron iteration line in its first 256 KiB."""
    try:
        with path.open(errors="replace") as f:
            head = f.read(1 << 18)
    except OSError:
        return False
    return any(MEGATRON_LINE.search(line) and "|" in line for line in head.splitlines())


# ---------------------------------------------------------------- TensorBoard
def _tensorboard(path: Path) -> tuple[Rows, float]:
    """Every scalar of one event file, by tensorboard's own reader (all points: its default
    keeps a 10,000-point reservoir sample of each tag). (rows, first event's wall time)."""
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
    for tag in tags.get("scalars", []):
        if tag.endswith(IGNORED_TAG_SUFFIXES):
            continue
        # Whole tags: `train/loss` and `eval/loss` are different curves, and
        # `optim/LR (group 1)` names its group; `columns.ALIASES` maps the known ones.
        for ev in acc.Scalars(tag):
            rows.setdefault(int(ev.step), {})[tag] = float(ev.value)
            start = min(start, ev.wall_time)
    for tag in tags.get("tensors", []):  # tf.summary.scalar (TF2) writes scalars as tensors
        if tag.endswith(IGNORED_TAG_SUFFIXES):
            continue
        for ev in acc.Tensors(tag):
            if ev.tensor_proto.dtype in (1, 2) and not ev.tensor_proto.tensor_shape.dim:
                from tensorboard.util import tensor_util

                rows.setdefault(int(ev.step), {})[tag] = float(
                    tensor_util.make_ndarray(ev.tensor_proto)
                )
                start = min(start, ev.wall_time)
    return rows, start if math.isfinite(start) else _mtime(path)


# ---------------------------------------------------------------- W&B offline runs
# A `.wandb` file is W&B's transaction log: a 7-byte header (":W&B", 0xBEE1, version 0),
# then LevelDB's log format (32 KiB blocks of records: crc32 of type+data, length, type
# FULL/FIRST/MIDDLE/LAST), each record a `wandb_internal_pb2.Record` protobuf. wandb >= 0.19
# reads it in its Go core only (the Python `wandb.sdk.internal.datastore` that did is gone),
# so the framing is read here and every record is decoded by the wandb package's own
# protobuf classes.
_W_BLOCK, _W_HEAD = 32768, 7
# The trainer's own step, where it logs one: W&B's `_step` counts log() calls.
_TRAINER_STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step", "iteration")


def _trainer_step_key(cols: set[str] | dict[str, object]) -> str | None:
    return next((k for k in _TRAINER_STEP_KEYS if k in cols), None)


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
    # The trainer's step where it logs one (HF: train/global_step; Lightning's WandbLogger:
    # trainer/global_step, one behind its optimizer steps, as its CSV), else W&B's _step.
    key = _trainer_step_key({k for r in seq for k in r}) or "_step"
    shift = 1 if key == "trainer/global_step" else 0
    rows: Rows = {}
    for r in seq:
        if key in r:
            rows.setdefault(int(r[key]) + shift, {}).update(
                {k: v for k, v in r.items() if not k.startswith("_") and k != key}
            )
    return rows, start if math.isfinite(start) else _mtime(path)


# ---------------------------------------------------------------- MLflow file store
def _mlflow_run(run: Path) -> tuple[Rows, float]:
    """One MLflow run folder (`mlruns/<experiment>/<run>/`): `metrics/<key>` files of
    `timestamp value step` lines (nested keys in sub-folders), as MLflow's FileStore writes them."""
    rows: Rows = {}
    start = math.inf
    base = run / "metrics"
    for f in sorted(p for p in base.rglob("*") if p.is_file()):
        key = f.relative_to(base).as_posix()
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) < 2:
                continue
            ts, value = float(parts[0]) / 1000.0, float(parts[1])
            step = int(parts[2]) if len(parts) > 2 else 0
            rows.setdefault(step, {})[key] = value
            start = min(start, ts)
    return rows, start if math.isfinite(start) else _mtime(run)


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


# Megatron-LM logs, at iteration N, the LR its scheduler has just set: the one iteration N + 1
# uses (train(): training_log(..., get_canonical_lr_for_logging(optimizer.param_groups)) after
# train_step's opt_param_scheduler.step). Measured on fixtures/megatron_log_run.py: a fault
# from iteration 30 on shows in the line of iteration 29.
MEGATRON_LR = ("learning rate", "learning-rate")


def megatron_lr(rows: Rows) -> Rows:
    """`lr` of each step from Megatron's LR column one step earlier (its first step has none)."""
    col = next((c for c in MEGATRON_LR if any(c in r for r in rows.values())), None)
    if col is None:
        return rows
    last = max(rows)
    for s, v in [(s, r[col]) for s, r in rows.items() if col in r and s < last]:
        rows.setdefault(s + 1, {})["lr"] = v
    return dict(sorted(rows.items()))


# ---------------------------------------------------------------- dispatch
def lightning_log(path: Path) -> bool:
    """A log in a Lightning logger's version folder (`hparams.yaml` beside it, or
    `lightning_logs/version_N`). Lightning logs a training step's metrics under
    `global_step` before that step's optimizer step counts, so optimizer step s is logged
    as s - 1 (measured on a CSVLogger run: the first step's loss sits at step 0); its
    checkpoints count completed steps."""
    return (path.parent / "hparams.yaml").is_file() or (
        path.parent.parent.name == "lightning_logs" and path.parent.name.startswith("version_")
    )


def read_file(path: Path) -> list[Leg]:
    """The legs of one log file (or MLflow run folder / W&B run folder).

    Raises:
        ForensicsError: unreadable or unknown format; MissingExtra: its reader's package is absent.
    """
    try:
        if path.is_dir():
            if (path / "metrics").is_dir() and (path / "meta.yaml").is_file():
                rows, t = _mlflow_run(path)
                return [Leg(str(path), rows, t, 0, "mlflow")]
            found = sorted(path.glob("run-*.wandb"))
            if found:
                return read_file(found[0])
            raise ForensicsError(f"{path}: a folder that is neither an MLflow run nor a W&B run")
        if path.name.startswith("events.out.tfevents"):
            rows, t = _tensorboard(path)
            if lightning_log(path):
                rows = {s + 1: v for s, v in rows.items()}
            return [Leg(str(path), megatron_lr(rows), t, 0, "tensorboard")]
        if path.suffix == ".db":
            return _mlflow_sqlite(path)
        if path.suffix == ".wandb":
            rows, t = _wandb(path)
            return [Leg(str(path), megatron_lr(rows), t, 0, "wandb")]
        if OLMO_METRICS.match(path.name):
            return [
                Leg(str(path.parent), r, _mtime(path), 0, "olmo-core")
                for r in _olmo_metrics(path.parent)
            ]
        t = _mtime(path)
        if path.suffix == ".csv":
            legs, kind = _csv(path, lightning_log(path)), "csv"
        elif path.suffix == ".json":
            legs, kind = _trainer_state(path), "trainer_state"
        elif is_megatron_text(path):
            legs, kind = _megatron_text(path), "megatron"
        else:
            legs, kind = _jsonl(path), "jsonl"
        return [Leg(str(path), megatron_lr(r), t, i, kind) for i, r in enumerate(legs)]
    except (
        OSError,
        UnicodeDecodeError,
        ValueError,
        json.JSONDecodeError,
        struct.error,
        sqlite3.Error,
    ) as e:
        raise ForensicsError(f"{path}: not a readable training log ({e})") from None
