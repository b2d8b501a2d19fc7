"""Training logs -> spike onsets, the rollback checkpoint, and the commands to run next."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ForensicsError
from .locate import list_checkpoints

__all__ = ["TriageConfig", "Onset", "TriageResult", "read_metrics", "triage"]


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
        elif path.suffix == ".csv":
            for r in csv.DictReader(path.read_text().splitlines()):
                if r.get("step") not in (None, ""):
                    rows.setdefault(int(float(r["step"])), {}).update(
                        {k: float(v) for k, v in r.items() if k and k != "step" and v not in ("", None) and _is_number(v)}
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
    for ours, theirs in keys.items():
        for d in rows.values():
            if theirs in d:
                d[ours] = d[theirs]
    return dict(sorted(rows.items()))


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
        short = tag.split("/")[-1]
        for ev in acc.Scalars(tag):
            rows.setdefault(int(ev.step), {})[short] = float(ev.value)
    return rows


@dataclass(kw_only=True, slots=True)
class TriageConfig:
    """Spike detection settings (DESIGN §4 spike onset row).

    Attributes:
        window: steps of history a step is compared with (OLMo-core: 128).
        z: robust z that marks a spike (OLMo-core: 6).
        loss_factor: a loss this many times the window median is a spike whatever z (Megatron: 10).
        min_history: steps of history needed before a step can be judged.
        margin: extra steps the rollback checkpoint must precede the onset by.
    """

    window: int = 128
    z: float = 6.0
    loss_factor: float = 10.0
    min_history: int = 8
    margin: int = 0


@dataclass(frozen=True, slots=True)
class Onset:
    """A detected event: the step, which signal, and how far past its threshold."""

    step: int
    signal: str
    value: float
    baseline: float
    robust_z: float
    message: str


@dataclass(slots=True)
class TriageResult:
    metrics_file: str
    steps: int
    onsets: list[Onset] = field(default_factory=list)
    first_bad_step: int | None = None
    rollback: str | None = None
    rollback_step: int | None = None
    after: str | None = None
    after_step: int | None = None
    drift: str | None = None
    commands: list[str] = field(default_factory=list)


def _robust(hist: np.ndarray) -> tuple[float, float]:
    med = float(np.median(hist))
    mad = float(np.median(np.abs(hist - med))) * 1.4826
    return med, max(mad, 0.02)


def _spikes(rows: dict[int, dict[str, float]], key: str, cfg: TriageConfig) -> list[Onset]:
    """Steps whose log10(value) is a robust outlier against the previous `window` steps."""
    steps = [s for s in rows if key in rows[s]]
    vals = [rows[s][key] for s in steps]
    out = []
    hist: list[float] = []
    for s, v in zip(steps, vals, strict=True):
        lv = math.log10(v) if math.isfinite(v) and v > 0 else math.inf
        if len(hist) >= cfg.min_history:
            med, mad = _robust(np.array(hist[-cfg.window :]))
            z = (lv - med) / mad if math.isfinite(lv) else math.inf
            factor = (not math.isfinite(v)) or (key == "loss" and v >= cfg.loss_factor * 10**med)
            if z > cfg.z or factor:
                out.append(Onset(s, key, v, 10**med, z, f"{key} {v:.4g} at step {s} vs {10**med:.4g} (robust z {z:.1f} over {min(len(hist), cfg.window)} steps)"))
                continue  # a spike does not enter the baseline
        if math.isfinite(lv):
            hist.append(lv)
    return out


def _lr_jumps(rows: dict[int, dict[str, float]]) -> list[Onset]:
    """Logged LR rising faster than a linear warmup from zero can (2x step ratio)."""
    out = []
    steps = [s for s in rows if "lr" in rows[s]]
    for a, b in zip(steps, steps[1:], strict=False):
        la, lb = rows[a]["lr"], rows[b]["lr"]
        if la > 0 and lb / la > 2 * max(1.0, b / max(a, 1)):
            out.append(Onset(b, "lr", lb, la, math.inf, f"lr jumps {lb / la:.0f}x at step {b} ({la:.3g} -> {lb:.3g})"))
    return out


def _scale_drops(rows: dict[int, dict[str, float]]) -> list[Onset]:
    out = []
    steps = [s for s in rows if "loss_scale" in rows[s]]
    for a, b in zip(steps, steps[1:], strict=False):
        sa, sb = rows[a]["loss_scale"], rows[b]["loss_scale"]
        if sb < sa:
            out.append(Onset(a, "loss_scale", sb, sa, math.inf, f"loss scale backs off after step {a} ({sa:g} -> {sb:g}): that step overflowed"))
    return out


def triage(metrics: Path, run_dir: Path | None, cfg: TriageConfig | None = None, keys: dict[str, str] | None = None) -> TriageResult:
    """Find the first bad step in a training log and the checkpoint to roll back to."""
    cfg = cfg or TriageConfig()
    rows = read_metrics(metrics, keys)
    if not rows:
        raise ForensicsError(f"{metrics}: no rows with a step")
    res = TriageResult(metrics_file=str(metrics), steps=len(rows))
    # The grad norm is the seed signal (it moves first); loss, LR and loss scale follow.
    res.onsets = sorted(
        _spikes(rows, "grad_norm", cfg) + _spikes(rows, "loss", cfg) + _lr_jumps(rows) + _scale_drops(rows),
        key=lambda o: (o.step, ["lr", "loss_scale", "grad_norm", "loss"].index(o.signal)),
    )
    if res.onsets:
        res.first_bad_step = res.onsets[0].step
        res.drift = _drift(rows, res.first_bad_step, cfg)
    ckpts = list_checkpoints(run_dir) if run_dir is not None else []
    if res.first_bad_step is not None and ckpts:
        # The checkpoint of step c holds the state after c's update: safe only if c < onset.
        safe = [(s, p) for s, p in ckpts if s < res.first_bad_step - cfg.margin]
        later = [(s, p) for s, p in ckpts if s >= res.first_bad_step]
        if safe:
            res.rollback_step, res.rollback = safe[-1][0], str(safe[-1][1])
        if later:
            res.after_step, res.after = later[0][0], str(later[0][1])
    if res.rollback_step is not None and run_dir is not None:
        after = f" --after {res.after_step}" if res.after_step is not None else ""
        batch = run_dir / "batches.h5"
        bflag = f" --batch {batch}" if batch.is_file() else " --batch BATCH_LOG"
        res.commands = [
            f"ckptforensics diff --run-dir {run_dir} --before {res.rollback_step}{after} --out incident/",
            f"ckptforensics replay --run-dir {run_dir} --before {res.rollback_step}{after}{bflag} --model MODEL --out incident/",
            f"ckptforensics bisect --run-dir {run_dir} --before {res.rollback_step}{after}{bflag} --model MODEL --out incident/",
        ]
    return res


def _drift(rows: dict[int, dict[str, float]], onset: int, cfg: TriageConfig) -> str | None:
    """Slow grad-norm growth before the onset: the last quarter window's median vs the window's."""
    g = [rows[s]["grad_norm"] for s in rows if s < onset and "grad_norm" in rows[s] and math.isfinite(rows[s]["grad_norm"])][-cfg.window :]
    if len(g) < 2 * cfg.min_history:
        return None
    recent, older = float(np.median(g[-max(len(g) // 4, cfg.min_history) :])), float(np.median(g))
    if recent > 2 * older:
        return f"grad norm drifted up {recent / older:.1f}x over the steps before the onset"
    return None


def as_dict(res: TriageResult) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(res)
