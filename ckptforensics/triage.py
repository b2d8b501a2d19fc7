"""Training logs -> spike onsets, the rollback checkpoint, and the commands to run next."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ForensicsError
from .locate import list_checkpoints
from .logs import find_metrics, group_lrs, lr_columns, param_grad_columns, read_metrics
from .tensors import CURVE_MIN_HISTORY, LOSS_FOLLOW, loss_follows, lr_growth_limit, trend_z

__all__ = ["TriageConfig", "Onset", "TriageResult", "read_metrics", "find_metrics", "triage", "lr_columns", "group_lrs", "param_grad_columns"]

@dataclass(kw_only=True, slots=True)
class TriageConfig:
    """Spike detection settings (docs/signatures.md#log-onset).

    Attributes:
        window: steps of history a step is compared with (OLMo-core: 128).
        z: robust z that marks a spike (OLMo-core: 6).
        loss_factor: a loss this many times the window median is a spike whatever z (Megatron: 10).
        min_history: steps of quiet a parameter's gradient needs before its return counts.
        judge_after: steps of a curve's own history needed before a step is judged
            (`tensors.CURVE_MIN_HISTORY`).
        margin: extra steps the rollback checkpoint must precede the onset by.
        follow: steps within which the loss must follow a grad-norm spike or a loss-scale
            backoff for it to count as an onset (`tensors.LOSS_FOLLOW`).
    """

    window: int = 128
    z: float = 6.0
    loss_factor: float = 10.0
    min_history: int = 8
    judge_after: int = CURVE_MIN_HISTORY
    margin: int = 0
    follow: int = LOSS_FOLLOW


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
    ignored: list[Onset] = field(default_factory=list)  # grad-norm blips / backoffs the loss did not follow
    first_bad_step: int | None = None
    rollback: str | None = None
    rollback_step: int | None = None
    after: str | None = None
    after_step: int | None = None
    drift: str | None = None
    commands: list[str] = field(default_factory=list)
    timeline: dict[str, list[float]] = field(default_factory=dict)  # step, loss, grad_norm, checkpoints


@dataclass(frozen=True, slots=True)
class _Curve:
    """One logged signal judged against its own trend (`tensors.trend_z`), once."""

    key: str
    steps: list[int]
    values: list[float]
    z: np.ndarray
    level: np.ndarray


def _curve(rows: dict[int, dict[str, float]], key: str, cfg: TriageConfig) -> _Curve:
    steps = [s for s in rows if key in rows[s]]
    vals = [rows[s][key] for s in steps]
    z, level = trend_z(vals, z=cfg.z, window=cfg.window, min_history=cfg.judge_after)
    return _Curve(key, steps, vals, z, level)


def _spikes(c: _Curve, cfg: TriageConfig) -> list[Onset]:
    """Steps whose log10(value) leaves the run's own trend, or a loss `loss_factor` times
    its baseline whatever the noise (Megatron-LM's 10x rule)."""
    key = c.key
    out = []
    for s, v, zi, base in zip(c.steps, c.values, c.z, c.level, strict=True):
        factor = (not math.isfinite(v)) or (key == "loss" and math.isfinite(base) and v >= cfg.loss_factor * base)
        if zi > cfg.z or factor:
            out.append(Onset(s, key, v, float(base), float(zi), f"{key} {v:.4g} at step {s} vs {base:.4g} on its trend (robust z {zi:.1f})"))
    return out


def _followed(onset: Onset, steps: list[int], z_loss: np.ndarray, z_grad: np.ndarray | None, cfg: TriageConfig, scaled: bool = False) -> bool:
    """A grad-norm spike or a loss-scale backoff starts an incident only where the loss
    follows (`tensors.loss_follows`): a grad-norm blip the loss ignores, and dynamic loss
    scaling's routine backoff (every growth_interval steps), are normal operation."""
    i = next((k for k, s in enumerate(steps) if s >= onset.step), len(steps))
    # An overflow under a loss scaler (a backoff, an inf grad norm) is routine by design:
    # at the end of the log it needs the loss to say otherwise.
    routine = onset.signal == "loss_scale" or (onset.signal == "grad_norm" and not math.isfinite(onset.value) and scaled)
    return loss_follows(z_loss, i, cfg.z, cfg.follow, z_grad, benefit=not routine)


def _lr_jumps(rows: dict[int, dict[str, float]]) -> list[Onset]:
    """Any logged LR (the main one or a group's) rising faster than a linear warmup from
    zero can (2x the step ratio); one onset per step, naming the columns that jumped."""
    cols = sorted({k for r in rows.values() for k in lr_columns(r)})
    jumps: dict[int, list[tuple[str, float, float]]] = {}
    for col in cols:
        steps = [s for s in rows if col in rows[s]]
        for a, b in zip(steps, steps[1:], strict=False):
            la, lb = rows[a][col], rows[b][col]
            if la > 0 and lb / la > lr_growth_limit(a, b):
                jumps.setdefault(b, []).append((col, la, lb))
    out = []
    for b, hits in sorted(jumps.items()):
        col, la, lb = max(hits, key=lambda h: h[2] / h[1])
        where = "" if col == "lr" else f" in {col}" + (f" (and {len(hits) - 1} more)" if len(hits) > 1 else "")
        out.append(Onset(b, "lr", lb, la, math.inf, f"lr jumps {lb / la:.0f}x at step {b}{where} ({la:.3g} -> {lb:.3g})"))
    return out


def _gradient_returns(rows: dict[int, dict[str, float]], cfg: TriageConfig) -> list[Onset]:
    """A parameter whose gradient norm sat >= 1000x below its peers' for `min_history`
    steps and comes back >= 1000x at once, to within 100x of its peers. Adam's second
    moment has decayed meanwhile, so its next updates are sign-like and lr-sized
    (Molybog et al. 2023, Adam instability)."""
    param_of = {k: v for r in rows.values() for k, v in param_grad_columns(r).items()}  # column -> parameter
    cols = sorted(param_of)
    if len(cols) < 3:
        return []
    first: dict[str, tuple[int, float, int]] = {}  # module -> (step, jump, quiet steps)
    ratio_hist: dict[str, list[float]] = {c: [] for c in cols}
    for s, row in rows.items():
        vals = {c: row[c] for c in cols if c in row and math.isfinite(row[c])}
        if len(vals) < 3:
            continue
        peers = float(np.median(list(vals.values())))
        if peers <= 0:
            continue
        for c, v in vals.items():
            r = v / peers
            h = ratio_hist[c]
            if len(h) >= cfg.min_history:
                quiet = float(np.median(h[-cfg.min_history :]))
                # Back to within 100x of its peers: a gradient that stays tiny moves Adam's
                # v as little as it moves the update.
                if quiet < 1e-3 and r >= 1e3 * quiet and r >= 1e-2:
                    first.setdefault(param_of[c].rsplit(".", 1)[0], (s, r / max(quiet, 1e-30), len(h)))
            h.append(r)
    return [
        Onset(
            s,
            "param_grad",
            jump,
            0.0,
            math.inf,
            f"{mod}: its gradient sat >= 1000x below its peers' for {n} steps and returns {jump:.0e}x at step {s}; "
            "Adam's second moment has decayed, so its next updates are sign-like (Adam instability)",
        )
        for mod, (s, jump, n) in first.items()
    ]


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
    # The grad norm is the seed signal (it moves first), but only where the loss follows.
    lc, gc = _curve(rows, "loss", cfg), _curve(rows, "grad_norm", cfg)
    loss = _spikes(lc, cfg)
    seeds = _spikes(gc, cfg) + _scale_drops(rows)
    z_grad = gc.z if gc.steps == lc.steps else None  # aligned with the loss steps, or not used
    scaled = any("loss_scale" in r for r in rows.values())
    kept = [o for o in seeds if not lc.steps or _followed(o, lc.steps, lc.z, z_grad, cfg, scaled)]
    res.ignored = [o for o in seeds if o not in kept]
    res.onsets = sorted(
        kept + loss + _lr_jumps(rows) + _gradient_returns(rows, cfg),
        key=lambda o: (o.step, ["lr", "param_grad", "loss_scale", "grad_norm", "loss"].index(o.signal)),
    )
    if res.onsets:
        res.first_bad_step = res.onsets[0].step
        res.drift = _drift(rows, res.first_bad_step, cfg)
    ckpts = list_checkpoints(run_dir) if run_dir is not None else []
    res.timeline = {
        "step": list(rows),
        "loss": [rows[s].get("loss", math.nan) for s in rows],
        "grad_norm": [rows[s].get("grad_norm", math.nan) for s in rows],
        "checkpoints": [s for s, _ in ckpts],
    }
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
