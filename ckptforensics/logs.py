"""Training logs: find the run's log and read it into step -> metrics, whatever wrote it.

JSONL / CSV (Lightning's and LitGPT's CSVLogger), HF `trainer_state.json`, OLMo-core's
`metrics_step{N}.json`, TensorBoard events (the tensorboard extra). Shared by `triage`
and the replay (which takes each step's LR and the history before its window from here).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from .errors import ForensicsError
from .locate import list_checkpoints

__all__ = ["read_metrics", "find_metrics", "discover_metrics", "group_lrs", "lr_columns", "param_grad_columns"]

# Per-group LR: OLMo-core's "optim/LR (group 0)", Lightning's LearningRateMonitor
# "lr-AdamW/pg1" (1-based); per-parameter grad norms: OLMo's "optim/grad/<param>.norm",
# or "grad_norm/<param>".
_GROUP_LR = (re.compile(r"^optim/LR \(group (\d+)\)$"), re.compile(r"^lr-[^/]+/pg(\d+)$"))
_PARAM_GRAD = re.compile(r"^(?:optim/grad/|grad_norm/|grad/|grad_[\d.]+_norm/)(.+?)(?:\.norm)?$")


def lr_columns(row: dict[str, float]) -> list[str]:
    """The row's LR columns: `lr` and every per-group LR the trainer logged."""
    return [k for k in row if k == "lr" or any(p.match(k) for p in _GROUP_LR)]


def group_lrs(row: dict[str, float], n: int) -> list[float] | None:
    """LR of each of `n` param groups when the log has them all, else None."""
    found: dict[int, float] = {}
    for k, v in row.items():
        for i, p in enumerate(_GROUP_LR):
            m = p.match(k)
            if m:
                found[int(m.group(1)) - (1 if i == 1 else 0)] = v
    return [found[i] for i in range(n)] if n > 0 and all(i in found for i in range(n)) else None


def param_grad_columns(row: dict[str, float]) -> dict[str, str]:
    """Column -> parameter name for per-parameter gradient norms."""
    out = {}
    for k in row:
        m = _PARAM_GRAD.match(k)
        if m and "total" not in m.group(1):
            out[k] = m.group(1)
    return out


def read_metrics(path: Path, keys: dict[str, str] | None = None) -> dict[int, dict[str, float]]:
    """step -> metrics from a training log: JSONL, CSV (Lightning's CSVLogger too), HF
    `trainer_state.json` (`log_history`), or TensorBoard event files (tensorboard extra).

    Args:
        path: the log.
        keys: our name -> the log's column name (e.g. {"loss": "train/loss"}).

    Raises:
        ForensicsError: unreadable or unknown log format.
    """
    keys = keys or {}
    if not path.is_file():
        raise ForensicsError(f"{path}: no such training log")
    rows: dict[int, dict[str, float]] = {}
    try:
        if path.name.startswith("events.out.tfevents"):
            rows = _tensorboard(path)
            if _lightning_log(path):
                rows = {s + 1: v for s, v in rows.items()}
        elif _OLMO_METRICS.match(path.name):
            rows = _olmo_metrics(path.parent)
        elif path.suffix == ".csv":
            records = list(csv.DictReader(path.read_text().splitlines()))
            # LitGPT logs each iteration at logger step iter_num - 1; its checkpoints count
            # optimizer steps (step_count = iter_num without gradient accumulation).
            litgpt = bool(records) and {"iter", "iter_time", "remaining_time"} <= set(records[0])
            col = "iter" if litgpt else "step"
            # Lightning's CSVLogger: an `epoch` column on every row (its logger connector adds it).
            shift = 1 if not litgpt and records and {"epoch", "step"} <= set(records[0]) and _lightning_log(path) else 0
            for r in records:
                if r.get(col) not in (None, ""):
                    rows.setdefault(int(float(r[col])) + shift, {}).update(
                        {k: float(v) for k, v in r.items() if k and k not in ("step", col) and v not in ("", None) and _is_number(v)}
                    )
        elif path.suffix == ".json":
            state = json.loads(path.read_text())
            for r in state.get("log_history", []):
                if "step" in r:
                    d = rows.setdefault(int(r["step"]), {})
                    d.update({k: float(v) for k, v in r.items() if k != "step" and isinstance(v, (int, float))})
                    if "learning_rate" in r:
                        d["lr"] = float(r["learning_rate"])
        else:
            for line in path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(r, dict) and "step" in r:
                    rows.setdefault(int(r["step"]), {}).update({k: float(v) for k, v in r.items() if k != "step" and isinstance(v, (int, float))})
    except (OSError, UnicodeDecodeError, ValueError, json.JSONDecodeError) as e:
        raise ForensicsError(f"{path}: not a readable training log ({e})") from None
    for ours, theirs in {**dict.fromkeys(_ALIASES, ""), **keys}.items():
        for d in rows.values():
            if theirs in d:
                d[ours] = d[theirs]
            elif ours not in d:
                alias = next((a for a in _ALIASES.get(ours, ()) if a in d), None)
                if alias is not None:
                    d[ours] = d[alias]
    return dict(sorted(rows.items()))


# What trainers call the training loss, total grad norm, LR and loss scale: OLMo-core's
# MetricSaverCallback keys, Megatron-LM's TensorBoard tags, HF Trainer's TensorBoard tags.
# Lightning's: `train_loss` as its docs' `self.log` examples name it, and the total of
# `lightning.pytorch.utilities.grad_norm`.
_ALIASES = {
    "loss": ("train/CE loss", "lm loss", "train/loss", "train_loss"),
    "grad_norm": ("optim/total grad norm", "grad-norm", "train/grad_norm", "grad_2.0_norm_total"),
    "lr": ("learning-rate", "train/learning_rate"),
    "loss_scale": ("loss-scale",),
}
_OLMO_METRICS = re.compile(r"^metrics_step(\d+)\.json$")


def _lightning_log(path: Path) -> bool:
    """A log in a Lightning logger's version folder (`hparams.yaml` beside it, or
    `lightning_logs/version_N`). Lightning logs a training step's metrics under
    `global_step` before that step's optimizer step counts, so optimizer step s is logged
    as s - 1 (measured on a CSVLogger run: the first step's loss sits at step 0); its
    checkpoints count completed steps."""
    return (path.parent / "hparams.yaml").is_file() or (path.parent.parent.name == "lightning_logs" and path.parent.name.startswith("version_"))


def _olmo_metrics(folder: Path) -> dict[int, dict[str, float]]:
    """OLMo-core's MetricSaverCallback: one `metrics_step{N}.json` per step in the save folder."""
    rows: dict[int, dict[str, float]] = {}
    for f in folder.iterdir():
        m = _OLMO_METRICS.match(f.name)
        if m:
            doc = json.loads(f.read_text())
            rows[int(m.group(1))] = {k: float(v) for k, v in doc.items() if isinstance(v, (int, float))}
    return rows


def find_metrics(run_dir: Path) -> Path | None:
    """The run's training log, in this order: metrics.jsonl / metrics.csv, the newest
    checkpoint's trainer_state.json (HF), Lightning's and LitGPT's CSVLogger files,
    OLMo-core's metrics_step{N}.json, TensorBoard events. None when there is none."""
    cands = [run_dir / "metrics.jsonl", run_dir / "metrics.csv"]
    if run_dir.name == "checkpoints":  # Lightning's version_N/checkpoints: the log is beside it
        cands.append(run_dir.parent / "metrics.csv")
    ckpts = list_checkpoints(run_dir) if run_dir.is_dir() else []
    if ckpts:
        cands.append(Path(ckpts[-1][1]) / "trainer_state.json")
    for pattern in ("lightning_logs/*/metrics.csv", "logs/csv/*/metrics.csv", "metrics_step*.json", "events.out.tfevents.*"):
        cands += sorted(run_dir.glob(pattern))
    return next((c for c in cands if c.is_file()), None)


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _tensorboard(path: Path) -> dict[int, dict[str, float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ForensicsError("reading TensorBoard event files needs the tensorboard package") from None
    acc = EventAccumulator(str(path))
    acc.Reload()
    rows: dict[int, dict[str, float]] = {}
    for tag in acc.Tags().get("scalars", []):
        # Whole tags: `train/loss` and `eval/loss` are different curves, and
        # `optim/LR (group 1)` names its group; `_ALIASES` maps the known ones.
        for ev in acc.Scalars(tag):
            rows.setdefault(int(ev.step), {})[tag] = float(ev.value)
    return rows


def discover_metrics(run_dir: Path) -> Path:
    """`find_metrics`, or a one-line error naming what was looked for."""
    found = find_metrics(run_dir)
    if found is None:
        raise ForensicsError(
            f"no training log in {run_dir} (looked for metrics.jsonl, metrics.csv, trainer_state.json, lightning_logs, "
            "LitGPT logs/csv, OLMo-core metrics_step*.json, TensorBoard events); pass --metrics"
        )
    return found

