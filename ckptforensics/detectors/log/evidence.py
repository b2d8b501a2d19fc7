"""What the log rules read: the settings (`TriageConfig`), the record of an onset (`Onset`),
and the log's evidence judged once (`log_evidence`: the loss and grad-norm curves against
their trends, the columns never computed, whether the log is an excerpt), with the steps of
its printed lines (`printed_lines`), which the excerpt rules, the combiner and the noise
summary all count by."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ckptforensics.core.stats import CURVE_MIN_HISTORY, LOSS_FOLLOW, trend_z

Rows = dict[int, dict[str, float]]


@dataclass(kw_only=True, slots=True)
class TriageConfig:
    """Spike detection settings (docs/signatures.md#log-onset).

    Attributes:
        window: steps of history a step is compared with (OLMo-core: 128).
        z: robust z that marks a spike (OLMo-core: 6).
        loss_factor: a loss this many times the window median is a spike whatever z (Megatron: 10).
        min_history: steps of quiet a parameter's gradient needs before its return counts.
        judge_after: steps of a curve's own history needed before a step is judged
            (`stats.CURVE_MIN_HISTORY`).
        margin: extra steps the rollback checkpoint must precede the onset by.
        follow: steps within which the loss must follow a grad-norm spike or a loss-scale
            backoff for it to count as an onset (`stats.LOSS_FOLLOW`).
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
    rule: str = (
        "trend"  # which rule decided (docs/signatures.md#log-onset): trend, megatron-10x, ...
    )
    # An overflow, or a held start, set aside for a later onset the log dates better
    # (`onsets._overflow_yields`, `_yields_to_lr_jump`, `_held_start_at_gradient`): that onset's step.
    # It may still be the incident's first sign: the rollback goes before it.
    yields_to: int | None = None


@dataclass(frozen=True, slots=True)
class Curve:
    """One logged signal judged against its own trend (`stats.trend_z`), once."""

    key: str
    steps: list[int]
    values: list[float]
    z: np.ndarray
    level: np.ndarray


@dataclass(frozen=True, slots=True)
class LogEvidence:
    """What the log detectors read: the rows, the loss and grad-norm curves judged once,
    and whether a loss scaler ran (its overflows are routine): a loss-scale column, or updates
    the log shows skipped (`skipped_overflows`)."""

    rows: Rows
    loss: Curve
    grad_norm: Curve
    scaled: bool
    loss_level: Curve  # the loss judged `above_level` too (stats.trend_z)
    ignored_columns: tuple[str, ...] = ()  # constant zero on every row: never computed
    excerpt: bool = False  # the log starts mid-run (its first step past `judge_after`)


LogDetector = Callable[[LogEvidence, TriageConfig], list[Onset]]


def _curve(rows: Rows, key: str, cfg: TriageConfig, above_level: bool = False) -> Curve:
    # A grad norm of exactly 0 is no measurement (a run that never computes it prints 0.000).
    steps = [s for s in rows if key in rows[s] and not (key == "grad_norm" and rows[s][key] == 0)]
    vals = [rows[s][key] for s in steps]
    z, level = trend_z(
        vals, z=cfg.z, window=cfg.window, min_history=cfg.judge_after, above_level=above_level
    )
    return Curve(key, steps, vals, z, level)


def _constant_zero(rows: Rows, key: str) -> bool:
    vals = [r[key] for r in rows.values() if key in r]
    return bool(vals) and all(v == 0 for v in vals)


# Updates a log shows skipped before its loss scaler counts as running without a loss-scale
# column: one is a single event (a trainer that skips a NaN step), two a scaler's routine.
SKIPS_FOR_SCALER = 2


def skipped_overflows(rows: Rows) -> int:
    """Logged steps whose grad norm is non-finite and whose next logged loss is finite: updates
    the trainer skipped, as a loss scaler does on an overflow (an applied non-finite update
    leaves every later loss non-finite). An fp16 HF Trainer, or an own loop logging to
    TensorBoard or W&B, records its scaler only this way: no loss-scale column (held-out draw
    12115: twelve such steps, the last seven steps before the log's end and named an onset)."""
    steps = sorted(rows)
    return sum(
        1
        for a, b in zip(steps, steps[1:], strict=False)
        if not math.isfinite(rows[a].get("grad_norm", 0.0))
        and math.isfinite(rows[b].get("loss", math.nan))
    )


def log_evidence(rows: Rows, cfg: TriageConfig) -> LogEvidence:
    """The curves judged once. A column that is 0 on every row was never computed (a
    Megatron-DeepSpeed run prints "grad norm: 0.000" when its engine did not compute one):
    it is left out, and said so (docs/signatures.md#log-zero-column)."""
    zero = tuple(k for k in ("grad_norm", "loss_scale") if _constant_zero(rows, k))
    if zero:
        rows = {s: {k: v for k, v in r.items() if k not in zero} for s, r in rows.items()}
    scaled = (
        any("loss_scale" in r for r in rows.values()) or skipped_overflows(rows) >= SKIPS_FOR_SCALER
    )
    first = min(rows) if rows else 0
    return LogEvidence(
        rows,
        _curve(rows, "loss", cfg),
        _curve(rows, "grad_norm", cfg),
        scaled,
        _curve(rows, "loss", cfg, above_level=True),
        zero,
        first > cfg.judge_after,
    )


# What a printed iteration line carries, one of them at least: a line whose every iteration
# was skipped prints no loss but its loss scale and skip counts (held-out log draw 9876: the
# loss-scale collapse on such lines was never read once lines were counted by their loss).
_LINE_KEYS = ("loss", "loss_scale", "skipped", "nan_iterations")


def printed_lines(ev: LogEvidence) -> list[int]:
    """The steps of the log's printed lines: rows with a loss, a loss scale or skip counts (a
    Megatron line's next-step LR makes a row of its own, and is not a line)."""
    return [s for s, r in ev.rows.items() if any(k in r for k in _LINE_KEYS)]


def grad_up(ev: LogEvidence, cfg: TriageConfig, steps: Iterable[int]) -> bool:
    """Whether the grad norm confirms an excursion on any of `steps`: z/2 or more on its trend
    (the half z at which the trend rule lets the grad norm confirm a loss spike), or not
    finite. False where the log has no grad norm there. The one bar the blip, held and shift
    rules ask of the gradient."""
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    zs = [float(g[s]) for s in steps if s in g]
    return any(not math.isfinite(z) or z >= cfg.z / 2 for z in zs)
