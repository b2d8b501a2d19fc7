"""Detectors over a training log (step -> metrics rows, `logs.read_metrics`): where an
incident starts (docs/signatures.md#log-onset).

Each detector is a pure function `(LogEvidence, TriageConfig) -> list[Onset]`. The seed
detectors (grad-norm spikes, loss-scale backoffs) raise candidates that count only where
the loss follows (`log_onsets` settles that); the onset detectors (loss spikes, LR jumps,
a gradient's return) are onsets as they stand; then the log's own tail of recovering blips
filters what a noisy log does routinely, and `log_noise` says how noisy it is.

One module past 400 lines on purpose: every rule here reads the same `LogEvidence` and
settles in one `log_onsets`, whose order of signals and filters is easier to check on one
page than across files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..logs import lr_columns, param_grad_columns
from ..stats import (
    BIWEIGHT_K,
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    CURVE_SHORT,
    LOSS_FOLLOW,
    biweight_change,
    expected_exceedances,
    family_alpha,
    family_z,
    log_curve,
    loss_follows,
    recurrence_period,
    robust_sigma,
    trend_z,
)
from ..tensors import lr_growth_limit

__all__ = [
    "undecidable_last_line",
    "TriageConfig",
    "Onset",
    "Curve",
    "LogEvidence",
    "LogDetector",
    "SEED_DETECTORS",
    "ONSET_DETECTORS",
    "log_evidence",
    "log_onsets",
]

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
    and whether a loss scaler ran (its overflows are routine)."""

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


def log_evidence(rows: Rows, cfg: TriageConfig) -> LogEvidence:
    """The curves judged once. A column that is 0 on every row was never computed (a
    Megatron-DeepSpeed run prints "grad norm: 0.000" when its engine did not compute one):
    it is left out, and said so (docs/signatures.md#log-zero-column)."""
    zero = tuple(k for k in ("grad_norm", "loss_scale") if _constant_zero(rows, k))
    if zero:
        rows = {s: {k: v for k, v in r.items() if k not in zero} for s, r in rows.items()}
    scaled = any("loss_scale" in r for r in rows.values())
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


def _spikes(c: Curve, cfg: TriageConfig) -> list[Onset]:
    """Steps whose log10(value) leaves the run's own trend, or a loss `loss_factor` times
    its baseline whatever the noise (Megatron-LM's 10x rule)."""
    key = c.key
    out = []
    for s, v, zi, base in zip(c.steps, c.values, c.z, c.level, strict=True):
        factor = (not math.isfinite(v)) or (
            key == "loss" and math.isfinite(base) and v >= cfg.loss_factor * base
        )
        if zi > cfg.z or factor:
            rule = (
                "nonfinite" if not math.isfinite(v) else "trend" if zi > cfg.z else "megatron-10x"
            )
            out.append(
                Onset(
                    s,
                    key,
                    v,
                    float(base),
                    float(zi),
                    f"{key} {v:.4g} at step {s} vs {base:.4g} on its trend (robust z {zi:.1f})",
                    rule,
                )
            )
    return out


def loss_spikes(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The loss leaving its trend, and, unless the grad norm rises with it (z/2), the level it
    has just been at too: in a steep descent the trend line runs below the recent level, and
    a loss between the two with nothing else moving may be the descent pausing (a few rows of
    a new data source in a small batch do that), not an incident."""
    out = _spikes(ev.loss, cfg)
    above = {s: z for s, z in zip(ev.loss_level.steps, ev.loss_level.z, strict=True)}
    grad = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    return [
        o
        for o in out
        if not math.isfinite(o.value)
        or o.value >= cfg.loss_factor * o.baseline
        or above.get(o.step, math.inf) > cfg.z
        or grad.get(o.step, 0.0) >= cfg.z / 2
    ]


def grad_spikes(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The grad norm leaving its trend (a seed: it moves first, but counts only where the loss follows)."""
    return _spikes(ev.grad_norm, cfg)


def scale_drops(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """A loss-scale backoff (a seed: routine unless the loss follows), dated at the first step
    the lower scale's row covers: a trainer logs the scale after its step's scaler update
    (Megatron-LM's train loop reads optimizer.get_loss_scale() after train_step, whose
    optimizer step backs the scale off on an overflow; torch's GradScaler.update() likewise
    runs before a step is logged), so the row that first shows the drop is the overflowed
    step's, or, on a log printed every k steps, closes the interval holding it."""
    out = []
    steps = [s for s in ev.rows if "loss_scale" in ev.rows[s]]
    for a, b in zip(steps, steps[1:], strict=False):
        sa, sb = ev.rows[a]["loss_scale"], ev.rows[b]["loss_scale"]
        if sb < sa:
            when = f"at step {b}" if b == a + 1 else f"between steps {a + 1} and {b}"
            out.append(
                Onset(
                    a + 1,
                    "loss_scale",
                    sb,
                    sa,
                    math.inf,
                    f"loss scale backs off ({sa:g} -> {sb:g}): a step overflowed {when}",
                    "loss-scale-backoff",
                )
            )
    return out


def skipped_iterations(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """A Megatron line counting skipped iterations: an overflow in the interval that line
    closes (a seed, routine unless the loss follows). The line is where the log shows it; a
    backoff read from the loss scale alone is dated at the first step of that interval."""
    return [
        Onset(
            s,
            "loss_scale",
            r.get("loss_scale", math.nan),
            math.nan,
            math.inf,
            f"{r['skipped']:g} skipped iteration(s) in the interval ending at iteration {s} (Megatron's count: overflows)",
            "skipped-iterations",
        )
        for s, r in ev.rows.items()
        if r.get("skipped", 0) > 0
    ]


def lr_jumps(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """Any logged LR (the main one or a group's) rising faster than a linear warmup from
    zero can (2x the step ratio); one onset per step, naming the columns that jumped. Where
    the log skips steps (Megatron's --log-interval), the jump lies somewhere after the last
    row with the old LR: the onset is the step after it, the earliest the log allows (a
    rollback must precede the fault)."""
    rows = ev.rows
    cols = sorted({k for r in rows.values() for k in lr_columns(r)})
    jumps: dict[int, list[tuple[str, float, float]]] = {}
    for col in cols:
        steps = [s for s in rows if col in rows[s]]
        for a, b in zip(steps, steps[1:], strict=False):
            la, lb = rows[a][col], rows[b][col]
            if la > 0 and lb / la > lr_growth_limit(a, b):
                jumps.setdefault(a + 1, []).append((col, la, lb, b))
    out = []
    for first, hits in sorted(jumps.items()):
        col, la, lb, b = max(hits, key=lambda h: h[2] / h[1])
        where = (
            ""
            if col == "lr"
            else f" in {col}" + (f" (and {len(hits) - 1} more)" if len(hits) > 1 else "")
        )
        when = (
            f"at step {b}"
            if b == first
            else f"between steps {first - 1} and {b} (the log skips the steps between)"
        )
        out.append(
            Onset(
                first,
                "lr",
                lb,
                la,
                math.inf,
                f"lr jumps {lb / la:.0f}x {when}{where} ({la:.3g} -> {lb:.3g})",
                "lr-growth",
            )
        )
    return out


# Logged LR values that must repeat the run's first ones for a restart to count: three
# steps of a warm-up (docs/signatures.md#lr-scheduler-restarted).
LR_RESTART_STEPS = 3


def lr_restarts(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The LR re-running its warm-up: from some step on, the logged LR repeats the run's own
    first values (a scheduler rebuilt at a resume without its state), where it had left them.
    The repeat may start a value or two in (a resume that loads the optimizer's groups after
    building the scheduler keeps the saved LR for one step): the restart is then that many
    steps earlier. A single step back at the run's first LR is a rebuilt scheduler whose
    state was loaded after its first value. Only a log that starts at the run's start with a
    warm-up can say."""
    rows = ev.rows
    steps = [s for s in sorted(rows) if "lr" in rows[s]]
    vals = [rows[s]["lr"] for s in steps]
    n = LR_RESTART_STEPS
    if len(vals) < 3 * n or not all(0 < vals[i] < vals[i + 1] for i in range(2 * n - 1)):
        return []

    def repeats(i: int) -> int | None:
        """The offset j < n of the run's start that the LR from index i repeats, if any."""
        for j in range(n):
            if i > j + n and np.allclose(vals[i : i + n], vals[j : j + n], rtol=1e-6, atol=0.0):
                return j
        return None

    def dip(i: int) -> bool:
        """One step back at the run's first LR between two steps of its schedule: a fresh
        scheduler's first value, then the saved schedule loaded over it (a resume that
        rebuilt the optimizer and its scheduler and restored only the scheduler's state)."""
        return (
            math.isclose(vals[i], vals[0], rel_tol=1e-6)
            and vals[i - 1] > 2 * vals[i]
            and vals[i + 1] > 2 * vals[i]
        )

    out = []
    i = n + 1
    while i <= len(vals) - n:
        j = repeats(i)
        if j is None and dip(i):
            b = steps[i]
            out.append(
                Onset(
                    b,
                    "lr_restart",
                    vals[i],
                    vals[i - 1],
                    math.inf,
                    f"the LR falls back to the run's first value at step {b} for one step ({vals[i - 1]:.3g} -> {vals[i]:.3g} -> {vals[i + 1]:.3g}): an optimizer and scheduler rebuilt at a resume",
                )
            )
            i += n
        elif j is not None and repeats(i - 1) is None:
            b = steps[i] - j
            out.append(
                Onset(
                    b,
                    "lr_restart",
                    vals[i],
                    vals[i - 1],
                    math.inf,
                    f"the LR re-runs its warm-up from step {b} (the run's first values again: {vals[i - 1]:.3g} -> {vals[i]:.3g}): the scheduler restarted at a resume",
                )
            )
            i += n
        i += 1
    return out


def gradient_returns(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """A parameter whose gradient norm sat >= 1000x below its peers' for `min_history`
    steps and comes back >= 1000x at once, to within 100x of its peers. Adam's second
    moment has decayed meanwhile, so its next updates are sign-like and lr-sized
    (Molybog et al. 2023, Adam instability)."""
    rows = ev.rows
    param_of = {
        k: v for r in rows.values() for k, v in param_grad_columns(r).items()
    }  # column -> parameter
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
                    first.setdefault(
                        param_of[c].rsplit(".", 1)[0], (s, r / max(quiet, 1e-30), len(h))
                    )
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
            "gradient-return",
        )
        for mod, (s, jump, n) in first.items()
    ]


def nan_iterations(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """Megatron's "number of nan iterations" above 0 on a printed line: an iteration of that
    interval had a NaN or Inf loss (training_log counts them apart from the routine
    skipped iterations of a loss-scale overflow). The line's iteration is the onset: the
    NaN lies in the interval that line closes (docs/signatures.md#log-nan-iterations)."""
    for s, r in ev.rows.items():
        n = r.get("nan_iterations", 0.0)
        if n > 0:
            return [
                Onset(
                    s,
                    "loss",
                    math.nan,
                    math.nan,
                    math.inf,
                    f"{n:g} NaN iteration(s) in the interval ending at iteration {s} (Megatron's count)",
                    "nan-iterations",
                )
            ]
    return []


# Ratio rules for an excerpt's first lines, where the trend has no history yet:
# - Megatron-LM's spiky-loss check: a value >= 10x the largest seen (rerun_state_machine
#   .is_unexpectedly_large, threshold=10 in pretrain_gpt.py's SPIKY_LOSS_FACTOR and in
#   param_and_grad_buffer.py for the grads);
# - Lightning's SpikeDetection: loss - running mean >= rtol x running mean, rtol 2 over a
#   window of 10 (lightning.fabric.utilities.spike);
# - the trend rule's own statistic on what history there is: robust z of log10(value) against
#   the excerpt's earlier lines (at least SHORT_MIN of them), the spread floored at the trend
#   rule's 4.7% (stats.CURVE_FLOOR), threshold z (OLMo-core's 6 sigma).
MEGATRON_SPIKY_FACTOR = 10.0
LIGHTNING_RTOL, LIGHTNING_WINDOW = 2.0, 10
SHORT_MIN = 3
# A loss scale at <= 1/4 of its recent maximum has halved twice with no growth between:
# overflows on consecutive steps past the scaler's hysteresis (Megatron's default 2), not the
# routine backoff of one overflow every growth interval.
SCALE_COLLAPSE = 0.25


def _short_z(prev: list[float], v: float) -> tuple[float, float]:
    """(robust z of log10(v) against the lines before it, their log10 median): the trend
    rule's statistic on what history an excerpt has, its spread floored at the trend rule's
    4.7% (stats.CURVE_FLOOR)."""
    from scipy import stats

    lp = np.log10(np.maximum(np.asarray(prev, dtype=np.float64), 1e-12))
    med = float(np.median(lp))
    scale = max(float(stats.median_abs_deviation(lp, scale="normal")), CURVE_FLOOR)
    return ((math.log10(v) - med) / scale if v > 0 else -math.inf), med


# An excerpt's loss and grad norm leaving their earlier lines together: each at z/2 (the half
# z at which the trend rule lets the grad norm confirm a loss spike, `loss_spikes`, and the
# loss answer a grad-norm one, `stats.loss_follows`), or the grad norm at z with the loss
# past every earlier line; and the loss staying past every earlier line, at z/3 or more (the
# held rule's 2 noise units, HELD_Z), on every line after it (issue 32: an onset is an
# excursion the grad norm and the following steps confirm). A
# single-rank or junk-row blip moves the loss, not the averaged gradient, and recovers on the
# next line; a hard batch moves both and recovers. Two earlier lines at least: one line is no
# spread.
JOINT_MIN = 2


# What a printed iteration line carries, one of them at least: a line whose every iteration
# was skipped prints no loss but its loss scale and skip counts (held-out log draw 9876: the
# loss-scale collapse on such lines was never read once lines were counted by their loss).
_LINE_KEYS = ("loss", "loss_scale", "skipped", "nan_iterations")


def _lines(ev: LogEvidence) -> list[int]:
    """The steps of the log's printed lines: rows with a loss, a loss scale or skip counts (a
    Megatron line's next-step LR makes a row of its own, and is not a line)."""
    return [s for s, r in ev.rows.items() if any(k in r for k in _LINE_KEYS)]


def short_joint(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """An excerpt's first lines where loss and grad norm leave the earlier lines together and
    the loss stays up (docs/signatures.md#log-short)."""
    if not ev.excerpt:
        return []
    steps = _lines(ev)[: cfg.judge_after]
    loss = [
        (s, ev.rows[s]["loss"])
        for s in steps
        if "loss" in ev.rows[s] and math.isfinite(ev.rows[s]["loss"])
    ]
    grad = [
        (s, ev.rows[s]["grad_norm"])
        for s in steps
        if "grad_norm" in ev.rows[s]
        and math.isfinite(ev.rows[s]["grad_norm"])
        and ev.rows[s]["grad_norm"] > 0
    ]
    if not grad:
        return []
    out: list[Onset] = []
    for k, (s, v) in enumerate(loss):
        prev = [x for _, x in loss[:k]]
        later = [x for _, x in loss[k + 1 :]]
        if (
            len(prev) < JOINT_MIN
            or not v > max(prev)
            or any(not (x > max(prev) and _short_z(prev, x)[0] >= HELD_Z * cfg.z) for x in later)
        ):
            continue
        zl, med = _short_z(prev, v)
        # The grad norm of this line or the next (a Megatron line's grad norm is its
        # interval's last iteration's, the loss the interval's mean).
        gz = [(t, _short_z([x for u, x in grad if u < s], g)[0]) for t, g in grad if t >= s][:2]
        gz = [(t, z) for t, z in gz if len([u for u, _ in grad if u < s]) >= JOINT_MIN]
        top = max((z for _, z in gz), default=-math.inf)
        if (zl >= cfg.z / 2 and top >= cfg.z / 2) or top >= cfg.z:
            out.append(Onset(s, "loss", v, 10**med, zl,
                             f"loss {v:.4g} at step {s} leaves the {len(prev)} lines before it (robust z {zl:.1f}) with the grad norm (robust z {top:.1f}), "
                             f"and stays above them on the {len(later)} line(s) after", "short-joint"))  # fmt: skip
            break
    return out


# An excerpt whose fault begins at its second line has one reference line and no spread of
# its own. The ratio rules (Megatron's 10x, Lightning's rtol 2) decide where they can; else the
# trend rule's own noise floor (stats.CURVE_FLOOR, 4.7% a step: the least noise it assumes)
# stands in for the spread: every later line at z/3 floor units (the held rule's margin,
# HELD_Z: 9.6%) or more above the first, at least ONE_REF_HELD of them, and the last at z
# (OLMo-core's 6 sigma: 32%): the excursion still there where the excerpt ends, not falling back
# as a single rank's blip of two lines does. The onset is the second line, the first of the run
# that persists to the end. Two reference lines (under short-z's SHORT_MIN) are judged so too,
# against their median.
ONE_REF_HELD = 2


def one_reference_line(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """An excerpt's loss leaving its one reference line (its first) and staying above it on
    every line after (docs/signatures.md#log-short)."""
    if not ev.excerpt or len(_lines(ev)) >= cfg.judge_after:
        return []
    loss = [(s, r["loss"]) for s, r in ev.rows.items() if "loss" in r and r["loss"] > 0]
    for k in range(1, SHORT_MIN):
        if len(loss) < k + ONE_REF_HELD or not all(math.isfinite(v) for _, v in loss[:k]):
            break
        ref = float(np.median([v for _, v in loss[:k]]))
        units = [
            (math.log10(v) - math.log10(ref)) / CURVE_FLOOR if math.isfinite(v) else math.inf
            for _, v in loss[k:]
        ]
        if min(units) < HELD_Z * cfg.z or units[-1] < cfg.z:
            continue
        s, v = loss[k]
        what = (
            "the excerpt's one earlier line"
            if k == 1
            else f"the excerpt's {k} earlier lines (their median"
        )
        msg = (f"loss {v:.4g} at step {s} leaves {what} ({ref:.4g}{')' if k > 1 else ''}) and stays above it on the {len(units) - 1} line(s) after "
               f"(all >= {HELD_Z * cfg.z:g}, the last {units[-1]:.1f} noise units of the trend rule's 4.7% floor; too few lines for a spread of their own)")  # fmt: skip
        return [Onset(s, "loss", v, ref, units[0], msg, "one-reference-line")]
    return []


def short_history(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """An excerpt's steps the trend cannot judge yet (its first `judge_after` lines), by the
    ratio rules above: the loss by any of them; the grad norm by Megatron's 10x and a loss
    scale collapsing, each only where the loss rises past all it was (or the excerpt ends)
    (docs/signatures.md#log-short)."""
    if not ev.excerpt:
        return []
    steps = _lines(ev)[: cfg.judge_after]
    loss = [(s, ev.rows[s]["loss"]) for s in steps if "loss" in ev.rows[s]]
    out: list[Onset] = []
    for k, (s, v) in enumerate(loss):
        prev = [x for _, x in loss[:k] if math.isfinite(x)]
        if not prev:
            continue
        mean = float(np.mean(prev[-LIGHTNING_WINDOW:]))
        if not math.isfinite(v):
            out.append(Onset(s, "loss", v, mean, math.inf, f"loss {v} at step {s}", "nonfinite"))
        elif v >= MEGATRON_SPIKY_FACTOR * max(prev):
            out.append(
                Onset(
                    s,
                    "loss",
                    v,
                    max(prev),
                    math.inf,
                    f"loss {v:.4g} at step {s} is >= 10x the largest before it ({max(prev):.4g}; Megatron's spiky-loss rule)",
                    "megatron-10x",
                )
            )
        elif v - mean >= LIGHTNING_RTOL * mean:
            out.append(
                Onset(
                    s,
                    "loss",
                    v,
                    mean,
                    math.inf,
                    f"loss {v:.4g} at step {s} is >= 3x the mean of the {min(len(prev), LIGHTNING_WINDOW)} lines before it ({mean:.4g}; Lightning's SpikeDetection, rtol 2)",
                    "lightning-rtol",
                )
            )
        elif len(prev) >= SHORT_MIN:
            z, med = _short_z(prev, v)
            nxt = loss[k + 1][1] if k + 1 < len(loss) else None
            # Back under z/2 on the next line: a blip the excerpt sees recover (a hard batch, a
            # junk row), not an onset (issue 32: an onset persists or is confirmed).
            if z > cfg.z and not (
                nxt is not None and math.isfinite(nxt) and _short_z(prev, nxt)[0] < cfg.z / 2
            ):
                out.append(
                    Onset(
                        s,
                        "loss",
                        v,
                        10**med,
                        z,
                        f"loss {v:.4g} at step {s} vs {10**med:.4g} over the {len(prev)} lines before it (robust z {z:.1f}, spread floored at 4.7%)",
                        "short-z",
                    )
                )
    seen = {o.step for o in out}
    losses = dict(loss)

    def rises(s: int) -> bool:
        """The loss on this line or the next above everything before this line (or the excerpt ends)."""
        before = [v for t, v in loss if t < s and math.isfinite(v)]
        after = [v for t, v in loss if t >= s][:2]
        return (
            not after or not before or any(not math.isfinite(v) or v > max(before) for v in after)
        )

    grad = [(s, ev.rows[s]["grad_norm"]) for s in steps if "grad_norm" in ev.rows[s]]
    for k, (s, g) in enumerate(grad):
        prev_g = [x for _, x in grad[:k] if math.isfinite(x)]
        if (
            prev_g
            and max(prev_g) > 0
            and (not math.isfinite(g) or g >= MEGATRON_SPIKY_FACTOR * max(prev_g))
            and rises(s)
            and s not in seen
        ):
            out.append(
                Onset(
                    s,
                    "grad_norm",
                    g,
                    max(prev_g),
                    math.inf,
                    f"grad norm {g:.4g} at step {s} is >= 10x the largest before it ({max(prev_g):.4g}; Megatron's rule for grads), and the loss rises with it ({losses.get(s, math.nan):.4g})",
                    "megatron-10x",
                )
            )
    scale = [(s, ev.rows[s]["loss_scale"]) for s in steps if "loss_scale" in ev.rows[s]]
    for k, (s, v) in enumerate(scale):
        top = max((x for _, x in scale[:k]), default=0.0)
        if top > 0 and v <= SCALE_COLLAPSE * top and rises(s):
            out.append(
                Onset(
                    s,
                    "loss_scale",
                    v,
                    top,
                    math.inf,
                    f"loss scale collapses to {v:g} at step {s} from {top:g} (overflows on consecutive steps), and the loss rises with it",
                    "loss-scale-collapse",
                )
            )
            break
    return out


def _followed(onset: Onset, ev: LogEvidence, cfg: TriageConfig) -> bool:
    """A grad-norm spike or a loss-scale backoff starts an incident only where the loss
    follows (`stats.loss_follows`): a grad-norm blip the loss ignores, and dynamic loss
    scaling's routine backoff (every growth_interval steps), are normal operation."""
    steps = ev.loss.steps
    if not steps:
        return True
    z_grad = (
        ev.grad_norm.z if ev.grad_norm.steps == steps else None
    )  # aligned with the loss steps, or not used
    i = next((k for k, s in enumerate(steps) if s >= onset.step), len(steps))
    # An overflow under a loss scaler (a backoff, an inf grad norm) is routine by design:
    # at the end of the log it needs the loss to say otherwise.
    routine = onset.signal == "loss_scale" or (
        onset.signal == "grad_norm" and not math.isfinite(onset.value) and ev.scaled
    )
    level = ev.loss_level.z if ev.loss_level.steps == steps else None
    return loss_follows(
        ev.loss.z, i, cfg.z, cfg.follow, z_grad, benefit=not routine, routine=routine, z_level=level
    )


SEED_DETECTORS: tuple[LogDetector, ...] = (grad_spikes, scale_drops, skipped_iterations)
ONSET_DETECTORS: tuple[LogDetector, ...] = (
    loss_spikes,
    lr_jumps,
    lr_restarts,
    gradient_returns,
    nan_iterations,
    short_history,
    short_joint,
    one_reference_line,
)
# When two signals start on one step, the report names the most causal first.
_SIGNAL_ORDER = ("lr", "lr_restart", "param_grad", "loss_scale", "grad_norm", "loss")

# A loss excursion that is back under z/2 within RECOVER steps is a blip; the log's own blips
# (those over z/2) are its tail. A blip is an onset only where all of these hold (issue 32: an
# onset is an excursion that persists, or that the grad norm and the following steps confirm,
# judged against the log's own tail):
# - the grad norm confirms it (z/2 or more on its trend, on that step or the next), or the
#   log has no other blip at least half its size (UNCONFIRMED_PEERS): a loss blip the
#   gradient does not see, on a log that blips, is a batch the model found hard, not a bad
#   update; a log without a grad norm cannot confirm one;
# - the log has too few other blips reaching half its size: TAIL_PEERS, plus the count normal
#   noise of the log's spread and length could give at that height (the Poisson 99% bound on
#   stats.expected_exceedances: a 20,000-step quiet log has ~5 steps over z 3.5 by chance). A
#   run whose logged loss is one micro-batch of one rank has hundreds of them;
# - it does not recur at a period of the log's own blips (stats.recurrence_period): a fixed
#   data order blips at the same step of every epoch, however few epochs the log holds.
# A poisoned batch in an averaged, quiet log is alone, and its gradient is large.
RECOVER, HOLD, TAIL_PEERS = 2, 3, 2
# How long this log's blips last: its excursions over z/2 shorter than CURVE_SHORT (a longer one
# is a held excursion, not a blip) fitted by a geometric distribution of durations (each step
# of an excursion continues it with one probability: the maximum-likelihood fit is 1/mean);
# a blip recovers within the longest of the log's n excursions the fit allows at 1% for all n
# together (scipy.stats.geom.isf at stats.family_alpha(n, 1%), Sidak), at least RECOVER and at
# most half CURVE_SHORT. Fewer than BLIP_FIT excursions fit nothing: RECOVER. A log whose
# blips last one step keeps 2; one rank's micro-batch, or junk batches in a row, last 2-3.
BLIP_ALPHA, BLIP_FIT = 0.01, 3


def recovery_horizon(ev: LogEvidence, cfg: TriageConfig) -> int:
    """Steps within which a blip of this log comes back under z/2 (docs/signatures.md#log-blip)."""
    from scipy import stats

    over = np.isfinite(ev.loss.z) & (ev.loss.z > cfg.z / 2)
    runs, n = [], 0
    for o in [*over.tolist(), False]:
        if o:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    runs = [r for r in runs if r < CURVE_SHORT]
    if len(runs) < BLIP_FIT or max(runs) == 1:
        return RECOVER  # too few to fit, or every blip lasts one step
    q = int(stats.geom.isf(family_alpha(len(runs), BLIP_ALPHA), 1.0 / float(np.mean(runs))))
    return min(max(RECOVER, q), CURVE_SHORT // 2)


# A blip the grad norm does not confirm is routine only on a log that blips so at all: one
# other blip at least half its size (a quiet log's lone poisoned batch, whose junk rows move
# the gradient less than z/2, stays an onset).
UNCONFIRMED_PEERS = 1


def blips(
    ev: LogEvidence, cfg: TriageConfig, floor: float | None = None
) -> dict[int, tuple[float, float]]:
    """step -> (robust z, log10 excess over the level before it) of every loss excursion
    (z > `floor`, default cfg.z; finite, under the 10x rule) that recovers: back under z/2
    within the log's own blip duration (`recovery_horizon`), and either under half its excess
    there too (the excursion has ended: a rise after that is another excursion, which the
    blip's level does not continue into) or held down the HOLD steps after its return (their
    median under half its excess: a spike that dips to the band once and climbs back is the
    start of a held rise, not a blip; docs/signatures.md#log-blip)."""
    z, steps, vals, base = ev.loss.z, ev.loss.steps, ev.loss.values, ev.loss.level
    floor = cfg.z if floor is None else floor
    lv = np.log10(np.maximum(np.asarray(vals, dtype=np.float64), 1e-30))
    usual = _usual_excess(ev)
    horizon = recovery_horizon(ev, cfg)
    out = {}
    for i, zi in enumerate(z):
        if (
            not (zi > floor and math.isfinite(vals[i]) and math.isfinite(base[i]))
            or vals[i] >= cfg.loss_factor * base[i]
        ):
            continue
        # Recovery is judged against the level before the excursion, in the noise units it
        # was measured in (the trend itself moves up under a rise it accepts: steps under z 6
        # enter it, so the next steps' own z would call a held rise recovered), or within
        # where this log's steps usually are, if that is wider (a heavy tail's MAD is narrow).
        lb = math.log10(base[i])
        excess = lv[i] - lb
        band = lb + max((cfg.z / 2) * excess / zi, usual)
        after = lv[i + 1 : i + 1 + horizon + HOLD]
        first = after[:horizon]
        if (
            len(first) < min(horizon, RECOVER)
            or not np.isfinite(first).all()
            or not (first <= band).any()
        ):
            continue
        # Back under the band and under half its excess within the horizon: the excursion has
        # ended (contiguity: a rise after it is another excursion, which does not continue from
        # this level). Back under the band only: the HOLD steps after the return stay down
        # (their median under half its excess).
        back = int(np.argmax(first <= band))
        hold = after[back + 1 : back + 1 + HOLD]
        ended = bool((first <= min(band, lb + excess / 2)).any())
        if (
            not ended
            and hold.size
            and not float(np.median(np.where(np.isfinite(hold), hold, np.inf))) < lb + excess / 2
        ):
            continue
        out[steps[i]] = (float(zi), float(excess))
    return out


# "Where the log's steps usually are": the 90th percentile of their log10 excess over the
# level before them. On a normal noise that is 1.3 noise units (inside the z/2 band); on a
# loss logged from one rank's micro-batch, whose MAD is narrow and whose tail is wide, it is
# the step-to-step range the log lives in.
USUAL_Q = 90


def _usual_excess(ev: LogEvidence) -> float:
    lv = np.log10(np.maximum(np.asarray(ev.loss.values, dtype=np.float64), 1e-30))
    with np.errstate(invalid="ignore", divide="ignore"):
        e = lv - np.log10(np.asarray(ev.loss.level, dtype=np.float64))
    e = e[np.isfinite(e) & (ev.loss.z != 0)]
    return float(np.percentile(e, USUAL_Q)) if e.size >= CURVE_SHORT else 0.0


def _grad_confirms(step: int, ev: LogEvidence, cfg: TriageConfig) -> tuple[bool, str]:
    """Whether the grad norm confirms a loss excursion at `step`: z/2 or more on its trend on
    that step or the next (a Megatron line's grad norm is its interval's last iteration's)."""
    if not ev.grad_norm.steps:
        return False, "the log has no grad norm to confirm it"
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    nxt = [s for s in ev.grad_norm.steps if s > step][:1]
    zs = [float(g[s]) for s in [step, *nxt] if s in g]
    if not zs:
        return False, "no grad norm was logged there"
    top = max(zs)
    return (
        top >= cfg.z / 2 or not math.isfinite(top)
    ), f"the grad norm stays at robust z {top:.1f} (under {cfg.z / 2:g})"


def _peers(
    tail: dict[int, tuple[float, float]],
    step: int,
    excess: float,
    zs: float,
    share: float,
    ev: LogEvidence,
    cfg: TriageConfig,
) -> tuple[bool, int]:
    """Whether the log has enough other blips at least `share` of this one's size (its log10
    excess over the level before it: the noise, and so a blip's z, shrinks as training goes on
    while a hard batch stays as hard)."""
    from scipy import stats

    chance = expected_exceedances(int(np.count_nonzero(ev.loss.z)), max(share * zs, cfg.z / 2))
    peers = sum(1 for s, (_, eb) in tail.items() if s != step and eb >= share * excess)
    return peers >= TAIL_PEERS + float(stats.poisson.isf(0.01, chance)), peers


def _excursions(ev: LogEvidence, cfg: TriageConfig) -> tuple[set[int], list[int]]:
    """(steps where the loss is out of line, steps judged) for the recurrence test: a loss at
    z/2 or more on its trend (recovering or not: a hard batch met again during a fault still
    stands above it), a non-finite loss, or an overflow (a Megatron line counting skipped
    iterations, whose loss average leaves the overflowed iteration out: a hard batch under
    fp16 overflows as often as it blips)."""
    hard = {s for s, zz in zip(ev.loss.steps, ev.loss.z, strict=True) if not zz < cfg.z / 2}
    over = {s for s, r in ev.rows.items() if r.get("skipped", 0) > 0}
    logged = {s for s, zz in zip(ev.loss.steps, ev.loss.z, strict=True) if zz != 0} | over
    return hard | over, sorted(logged)


def _routine(
    o: Onset, tail: dict[int, tuple[float, float]], ev: LogEvidence, cfg: TriageConfig
) -> str | None:
    """Why a loss or grad-norm onset of the trend rule is the log's routine (a message), or
    None when it stands. A blip that recovers: unconfirmed by the grad norm, within the log's
    tail, or recurring at the log's period; in the log's last CURVE_SHORT steps, where
    recovery cannot be seen yet, only peers two thirds its size excuse it."""
    steps = ev.loss.steps
    if o.signal == "loss_scale" and o.rule in ("loss-scale-backoff", "skipped-iterations"):
        # An overflow counts where the loss spikes on that line or the next (`_followed`):
        # where that spike is one of the log's routine blips, so is the overflow.
        i = next((k for k, s in enumerate(steps) if s >= o.step), len(steps))
        answer = next((k for k in range(i, min(i + 2, len(steps))) if ev.loss.z[k] > cfg.z), None)
        if answer is None:
            return None
        k = answer
        why = _routine(
            Onset(
                steps[k],
                "loss",
                ev.loss.values[k],
                float(ev.loss.level[k]),
                float(ev.loss.z[k]),
                "",
                "trend",
            ),
            tail,
            ev,
            cfg,
        )
        return (
            f"the loss answers at step {steps[k]} with a blip of its routine: {why}"
            if why
            else None
        )
    if o.signal not in ("loss", "grad_norm") or o.rule != "trend":
        return None
    horizon = recovery_horizon(ev, cfg)
    if o.step in tail:
        zs, es = tail[o.step]
        ok, why = _grad_confirms(o.step, ev, cfg) if o.signal == "loss" else (True, "")
        enough, n = _peers(tail, o.step, es, zs, 0.5, ev, cfg)
        if not ok and n >= UNCONFIRMED_PEERS:
            return f"the loss recovers within {horizon} steps (this log's blips), {why}, and the log has {n} other blip(s) at least half its size"
        if enough:
            return f"the loss recovers within {horizon} steps (this log's blips), as {n} other blips of this log at least half its size do"
        hard, logged = _excursions(ev, cfg)
        spacing = int(np.median(np.diff(steps))) if len(steps) > 2 else 1
        p = recurrence_period(o.step, hard, logged, spacing)
        if p is not None:
            return f"the loss recovers within {horizon} steps (this log's blips), and blips every {p} steps of this log (a batch that comes back each epoch)"
        return None
    i = next((k for k, s in enumerate(steps) if s >= o.step), len(steps))
    if i >= len(steps) or len(steps) - 1 - i >= horizon:
        return None
    base = ev.loss.level[i]
    if (
        not (math.isfinite(ev.loss.values[i]) and math.isfinite(base))
        or not float(ev.loss.z[i]) > cfg.z
    ):
        return None  # a grad-norm seed the loss followed at half z: judged by the loss's own size
    excess, zs = math.log10(ev.loss.values[i] / base), float(ev.loss.z[i])
    # The grad norm logged on every step from the excursion's to the log's end staying under
    # z/2 (a log that has one: one without cannot tell), on a log with other blips at least
    # half its size that the grad norm let pass (UNCONFIRMED_PEERS): the excursion is as old
    # as this log's blips last, and the one signal that would make it an update's is quiet, as
    # it is for the routine blips mid-log (a single rank's junk micro-batches on the last two
    # lines: fresh tuning log draw 355).
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    gz = [float(g[s]) for s in steps[i:] if s in g]
    if o.signal == "loss" and gz and max(gz) < cfg.z / 2:
        _, n = _peers(tail, o.step, excess, zs, 0.5, ev, cfg)
        if n >= UNCONFIRMED_PEERS:
            return (f"in the log's last steps (within {horizon}, this log's blip duration), the grad norm stays under robust z "
                    f"{cfg.z / 2:g} (at most {max(gz):.1f}) to the end, and the log has {n} other blip(s) at least half its size")  # fmt: skip
    enough, n = _peers(tail, o.step, excess, zs, 2 / 3, ev, cfg)
    return (
        f"in the log's last steps, where recovery cannot be seen yet, {n} other blips of this log reach two thirds its size"
        if enough
        else None
    )


def _persisting_start(o: Onset, ev: LogEvidence, cfg: TriageConfig) -> Onset:
    """The first step of the excursion that persists, for a loss spike of the trend rule: where
    the next step falls back under half the spike's excess (over the level before it) and,
    within the log's blip duration, a run starts that stays at half its excess or more for
    HOLD steps, the onset is that run's first step; the spike before it is a blip the
    excursion's level does not continue from (issue 32). Else the spike stands."""
    steps = ev.loss.steps
    if o.signal != "loss" or o.rule != "trend" or o.step not in steps:
        return o
    i = steps.index(o.step)
    base = float(ev.loss.level[i])
    lv = np.log10(np.maximum(np.asarray(ev.loss.values, dtype=np.float64), 1e-30))
    lv = np.where(np.isfinite(lv), lv, np.inf)
    if not (math.isfinite(base) and base > 0) or i + 1 >= len(steps):
        return o
    half = math.log10(base) + (lv[i] - math.log10(base)) / 2
    if not lv[i + 1] < half:
        return o
    for j in range(i + 2, min(len(steps), i + 2 + recovery_horizon(ev, cfg))):
        run = lv[j : j + HOLD]
        if run.size == HOLD and (run >= half).all():
            v = ev.loss.values[j]
            msg = (f"loss {v:.4g} at step {steps[j]} starts the excursion that persists ({HOLD} steps at half the excess or more of the spike at step "
                   f"{o.step}, {ev.loss.values[i]:.4g}, which fell back under it at step {steps[i + 1]}: a blip the excursion does not continue from)")  # fmt: skip
            return Onset(steps[j], "loss", v, base, float(ev.loss.z[j]), msg, "persisting-run")
    return o


SHORT_RULES = (
    "short-z",
    "short-joint",
    "one-reference-line",
    "lightning-rtol",
    "megatron-10x",
    "nonfinite",
    "loss-scale-collapse",
)


def _short_followed(seed: Onset, found: list[Onset], ev: LogEvidence) -> bool:
    """An excerpt's overflow (a backoff, skipped iterations) that the loss follows: an onset of
    the short rules on the line that logged it or the next (as `_followed` asks of the trend's
    loss on a full log)."""
    if seed.signal != "loss_scale" or not ev.excerpt:
        return False
    lines = _lines(ev)
    at = next((k for k, s in enumerate(lines) if s >= seed.step), None)
    if at is None:
        return False
    near = set(lines[at : at + 2])
    return any(o.step in near and o.rule in SHORT_RULES for o in found)


def log_onsets(ev: LogEvidence, cfg: TriageConfig) -> tuple[list[Onset], list[Onset]]:
    """(onsets by step, seeds the loss did not follow and the log's routine blips: ignored)."""
    seeds = [o for d in SEED_DETECTORS for o in d(ev, cfg)]
    found = [o for d in ONSET_DETECTORS for o in d(ev, cfg)]
    # The excerpt's short rules measure what spread its lines have: one reference line decides
    # only where they find nothing but a last line rising (`undecidable_last_line`).
    lines = _lines(ev)
    measured = [
        o
        for o in found
        if o.rule != "one-reference-line"
        and not (lines and o.step == lines[-1] and o.rule in NOISE_RULES)
    ]
    if measured:
        found = [o for o in found if o.rule != "one-reference-line"]
    kept = [o for o in seeds if _followed(o, ev, cfg) or _short_followed(o, found, ev)]
    ignored = [o for o in seeds if o not in kept]
    onsets = kept + found
    tail = blips(ev, cfg, cfg.z / 2)
    why = {id(o): _routine(o, tail, ev, cfg) for o in onsets}
    ignored += [
        Onset(
            o.step, o.signal, o.value, o.baseline, o.robust_z, f"{o.message}; {why[id(o)]}", "tail"
        )
        for o in onsets
        if why[id(o)]
    ]
    onsets = (
        [_persisting_start(o, ev, cfg) for o in onsets if not why[id(o)]]
        + held_rise(ev, cfg)
        + held_shift(ev, cfg)
    )
    yielded = {id(o): _overflow_yields(o, onsets, ev, cfg) for o in onsets}
    ignored += [
        Onset(o.step, o.signal, o.value, o.baseline, o.robust_z, f"{o.message}; {why}", o.rule)
        for o in onsets
        if (why := yielded[id(o)])
    ]
    onsets = [o for o in onsets if not yielded[id(o)]]
    return sorted(onsets, key=lambda o: (o.step, _SIGNAL_ORDER.index(o.signal))), ignored


# The overflow seeds: a loss scaler's routine by design, onsets only where the loss follows
# (`_followed`).
OVERFLOW_RULES = ("loss-scale-backoff", "skipped-iterations")


def _overflow_yields(
    o: Onset, onsets: list[Onset], ev: LogEvidence, cfg: TriageConfig
) -> str | None:
    """Why an overflow kept because the loss followed it gives way to a later start (a
    message), or None. A log printed every k iterations dates an overflow at the first step of
    the interval that holds it (`scale_drops`): the earliest the line allows, not where it
    happened. Where the loss does not confirm it on that line (its own spike, z, as `_followed`
    asks of a routine seed) and an onset of a rule that stands on its own (an LR jump, a loss
    rule) is dated later in the same interval, the log places the incident no earlier than
    that onset: the overflow, routine by design (dynamic loss scaling backs off once every
    growth interval), is the same incident seen less precisely, or a routine one before it
    (held-out log draw 9923: a backoff dated 186 on a line of 186-190, the LR line of 185
    vouching for 186's LR, the jump dated 187, the loss up only on the next line)."""
    if o.rule not in OVERFLOW_RULES or o.signal != "loss_scale":
        return None
    lines = _lines(ev)
    line = next((s for s in lines if s >= o.step), None)
    if line is None or line == o.step:
        return None  # a log of every step (or the line itself): the overflow is dated exactly
    loss = dict(zip(ev.loss.steps, ev.loss.z, strict=True))
    if loss.get(line, 0.0) > cfg.z:
        return None  # the loss confirms it on its own line
    later = [x for x in onsets if x.rule not in OVERFLOW_RULES and o.step < x.step <= line]
    if not later:
        return None
    x = min(later, key=lambda x: x.step)
    return (
        f"the loss does not confirm it on its line ({line}), and {x.rule} dates the incident "
        f"later in the same interval, at step {x.step}: the overflow is dated at the interval's "
        "first step only because the line covers it"
    )


# A fault that lifts the loss by less than z noise-widths a step shows as a held excursion:
# CURVE_SHORT steps in a row with their lower quartile (6 of 8) at z/3 or more above the level
# before the first (6 of 8 normal values >= 2 sigma has probability 4e-9, binomial), which the
# trend, reading each step alone, absorbs. Its first step is the first of three in a row at z/3,
# the second keeping half the first's excess: a blip just before the fault, followed by a step
# back at (or halfway to) the level, is not its start.
HELD_Z = 1 / 3


def held_rise(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The first step of a held rise of the loss (docs/signatures.md#log-held)."""
    # Judged above the level the loss has just been at too (`above_level`): in a descent a
    # pause runs above the trend line, not above where the curve is. The window is measured
    # against the level before its first step, in that step's noise units: the trend accepts
    # steps under z 6 and would follow the rise it is asked about.
    z, steps, vals, base = (
        ev.loss_level.z,
        ev.loss_level.steps,
        ev.loss_level.values,
        ev.loss_level.level,
    )
    lv = np.log10(np.maximum(np.asarray(vals, dtype=np.float64), 1e-30))
    lv = np.where(np.isfinite(lv), lv, np.inf)  # a NaN loss is held above any level
    k = CURVE_SHORT
    for i in range(len(z) - k + 1):
        if not (
            z[i] >= HELD_Z * cfg.z
            and math.isfinite(z[i])
            and math.isfinite(base[i])
            and math.isfinite(lv[i])
        ):
            continue
        lb = math.log10(base[i])
        scale = (lv[i] - lb) / z[i]
        units = (lv[i : i + k] - lb) / scale
        held = float(np.percentile(units, 25))
        # Contiguity: the next step keeps at least half this one's excess, and the one after
        # stays at z/3 (a blip that falls back before the rise is not where it continues from).
        if (
            held >= HELD_Z * cfg.z
            and units[1] >= max(HELD_Z * cfg.z, units[0] / 2)
            and units[2] >= HELD_Z * cfg.z
        ):
            return [Onset(steps[i], "loss", vals[i], float(base[i]), held,
                          f"loss {vals[i]:.4g} at step {steps[i]} starts {k} steps held above its level {base[i]:.4g} (6 of 8 at robust z {held:.1f} or more)", "held")]  # fmt: skip
    return []


# A fault that lifts the loss by less than its noise a step, on a log whose noise is heavy
# tailed, still moves where the loss is: the CURVE_SHORT steps from its onset sit above the
# 2 x CURVE_SHORT before them. Mann-Whitney's rank test (scipy.stats.mannwhitneyu, exact)
# reads ranks, not the spread a heavy tail widens, and a lone blip moves one rank of eight.
# The grad norm, where the log has one, must rise with the loss: each at SHIFT_ALPHA (1%)
# on its own, and both together (Fisher's combination, scipy.stats.combine_pvalues) at the
# Sidak level for the windows tested (stats.family_alpha), as the loss alone must where no
# grad norm was logged. A loss logged from one rank's micro-batch blips where the gradient,
# averaged over all ranks, does not move; a fault moves both and stays.
SHIFT_ALPHA = 0.01
# Ranks say whether the steps after sit above those before, not by how much, and they assume
# independent steps: a healthy log whose heavy tail comes in bursts, or whose loss wanders
# slowly (autocorrelated), ranks a quiet stretch under a noisy one though its level hardly
# moved (tuning draw 388: p 2.6e-5 on the loss, 9.6e-3 on the grad norm, for a median 0.8
# noise units up). So the level must move too: the median of the CURVE_SHORT steps from the
# start at least SHIFT_EFFECT noise units above that of the 2 x CURVE_SHORT before it, where
# the unit is the log's own, the trend rule's: the robust spread of the loss about its trend's
# one-step-ahead level over the CURVE_WINDOW steps before the window, floored at CURVE_FLOOR
# (`_shift_effect`). One unit: a level that moved by less than one step's noise is what
# the log does on its own (every held shift the rank test finds at a fault of the tuning
# draws 100-429 moved 2.2 units or more); a shift under one unit is left to the trend rules.
SHIFT_EFFECT = 1.0
# And the move must be extreme against the log's own history: the same move (the median of
# CURVE_SHORT steps less that of the 2 x CURVE_SHORT before them) at every earlier start whose
# window ends before this one's begins, over the trend's window of them, is the null of a log
# that drifts: a slowly wandering (autocorrelated) loss moves its windows' medians by far more
# than independent steps would, and Mann-Whitney, which assumes independent steps, reads that
# as a shift. The candidate's robust z against them (their median and robust spread) must
# reach the Sidak level of SHIFT_ALPHA over the windows tested (stats.family_z): the same
# correction the rank test's level has (draw 388: z 3.7 against 4.0; the held shifts at the
# tuning draws' faults 4.6 or more; an AR(1) drift of a log's level with its grad norm, the
# unit tests' class, passes the ranks and often the effect). A log with fewer than SHIFT_HISTORY such windows has
# no history to set a null by, and is judged by the rank test and the effect alone.
SHIFT_HISTORY = 2 * CURVE_SHORT


def _window_moves(ev: LogEvidence) -> np.ndarray:
    """The move of the loss's level (log10) at every index i >= 2 x CURVE_SHORT: the median of
    the CURVE_SHORT steps from i less that of the 2 x CURVE_SHORT before it (NaN where the
    windows do not fit, or a NaN loss sits on both sides)."""
    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = log_curve(ev.loss.values)
    out = np.full(x.size, np.nan)
    with np.errstate(invalid="ignore"):
        for i in range(h, x.size - k + 1):
            out[i] = np.median(x[i : i + k]) - np.median(x[i - h : i])
    return out


def _shift_effect(
    ev: LogEvidence, starts: np.ndarray, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """How far the loss's level moves at each window start (`_window_moves`): in the log's
    noise units (over the robust spread of the loss about its trend's level over the `window`
    steps before it, floored at CURVE_FLOOR, and the floor where fewer than 3 are known),
    and as a robust z against the same move at the earlier starts whose windows end before
    it begins (the last `window` of them; +inf with fewer than SHIFT_HISTORY)."""
    k = CURVE_SHORT
    x = log_curve(ev.loss.values)
    moves = _window_moves(ev)
    with np.errstate(invalid="ignore"):
        resid = x - log_curve(ev.loss.level)  # not finite where the trend had not judged yet
    units, zs = np.empty(starts.size), np.full(starts.size, math.inf)
    for n, i in enumerate(starts):
        unit = robust_sigma(resid[max(0, i - window) : i])
        unit = max(unit, CURVE_FLOOR) if math.isfinite(unit) else CURVE_FLOOR
        units[n] = moves[i] / unit
        past = moves[max(0, i - k + 1 - window) : i - k + 1]
        past = past[np.isfinite(past)]
        spread = robust_sigma(past)
        if past.size >= SHIFT_HISTORY and spread > 0:
            zs[n] = (moves[i] - float(np.median(past))) / spread
    # A NaN loss on both sides of a start moves nothing measurable: left to the ranks.
    return np.nan_to_num(units, nan=math.inf), np.nan_to_num(zs, nan=math.inf)


def _shift_p(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """One-sided Mann-Whitney p of the CURVE_SHORT values from each start against the
    2 x CURVE_SHORT before it (a non-finite value ranks above every finite one)."""
    from scipy import stats

    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = np.nan_to_num(log_curve(values), posinf=1e300)
    before = np.stack([x[i - h : i] for i in starts])
    after = np.stack([x[i : i + k] for i in starts])
    return np.asarray(
        stats.mannwhitneyu(after, before, alternative="greater", axis=1, method="exact").pvalue,
        dtype=np.float64,
    )


def held_shift(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The first step of CURVE_SHORT steps whose loss (and grad norm) sit above the steps
    before them, by ranks: the change point the log's windows agree on best near the first
    window that passes (docs/signatures.md#log-shift)."""
    from scipy import stats

    steps, k, h = ev.loss.steps, CURVE_SHORT, 2 * CURVE_SHORT
    starts = np.arange(max(h, cfg.judge_after), len(steps) - k + 1)
    if starts.size == 0:
        return []
    p_loss = _shift_p(np.asarray(ev.loss.values, dtype=np.float64), starts)
    gsteps = ev.grad_norm.steps
    level = family_alpha(int(starts.size), SHIFT_ALPHA)
    if len(gsteps) >= h + k:
        # The grad norm's own windows, from its first step at or after each loss window's.
        gi = np.searchsorted(np.asarray(gsteps), np.asarray(steps)[starts])
        ok = (gi >= h) & (gi <= len(gsteps) - k)
        p_grad = np.ones(starts.size)
        if ok.any():
            p_grad[ok] = _shift_p(np.asarray(ev.grad_norm.values, dtype=np.float64), gi[ok])
        p = np.array(
            [
                stats.combine_pvalues([a, b], method="fisher").pvalue
                for a, b in zip(p_loss, p_grad, strict=True)
            ]
        )
        passed = (p_loss < SHIFT_ALPHA) & (p_grad < SHIFT_ALPHA) & (p < level)
        how = "and the grad norm with it"
    else:
        p_grad, p, passed = np.full(starts.size, math.nan), p_loss, p_loss < level
        how = "(no grad norm logged)"
    effect, past_z = _shift_effect(ev, starts, cfg.window)
    passed &= (effect >= SHIFT_EFFECT) & (past_z >= family_z(int(starts.size), SHIFT_ALPHA))
    if not passed.any():
        return []
    first = int(np.argmax(passed))
    near = np.arange(first, min(first + k, starts.size))
    j = int(near[np.argmin(np.where(passed[near], p[near], np.inf))])
    w = int(starts[j])
    i = _shift_start(ev, w)
    s, v = steps[i], ev.loss.values[i]
    before = float(np.median(ev.loss.values[i - h : i]))
    moved = (
        ""
        if i == w
        else f"; the window with the smallest p starts at step {steps[w]}, the steps best split "
        f"into the level before and the level after at step {s} (biweight loss, K {BIWEIGHT_K:g})"
    )
    msg = (f"loss from step {s} ({v:.4g}) sits above the {h} steps before it (median {before:.4g}) for {k} steps, {how}: "
           f"Mann-Whitney p {p_loss[j]:.1e} (loss), {p_grad[j]:.1e} (grad norm), together {p[j]:.1e} < {level:.1e} "
           f"(1% over the {starts.size} windows tested, Sidak); its median {effect[j]:.1f} noise units up "
           f"(>= {SHIFT_EFFECT:g}){moved}")  # fmt: skip
    return [Onset(s, "loss", v, before, math.inf, msg, "held-shift")]


def _shift_start(ev: LogEvidence, w: int) -> int:
    """The index of a held shift's first step, near the start `w` of the window that tested
    best: the change point between the level of the 2 x CURVE_SHORT steps before `w` and that
    of the CURVE_SHORT from it (their medians, in log10), each step weighed by its one-step
    likelihood under either level with outliers of both capped (`stats.biweight_change`), in
    the noise units of the steps before (their robust spread, floored at the trend rule's
    CURVE_FLOOR). Candidates lie within half a window either side of `w`: the rank test
    places the shift to within its window, not further. A hard batch the step before the
    fault ranks top in every window and is an outlier of both levels: it does not start
    the shift; the step after it, back at the old level, does not either."""
    k, h = CURVE_SHORT, 2 * CURVE_SHORT
    x = log_curve(ev.loss.values)
    pre, post = x[w - h : w], x[w : w + k]
    pre, post = pre[np.isfinite(pre)], post[np.isfinite(post)]
    if pre.size < SHORT_MIN or post.size < SHORT_MIN:
        return w
    scale = max(robust_sigma(pre), CURVE_FLOOR)
    lo, hi = max(h, w - k // 2), min(x.size - 1, w + k // 2)
    return biweight_change(
        x, range(lo, hi + 1), float(np.median(pre)), float(np.median(post)), scale
    )


def log_noise(ev: LogEvidence, cfg: TriageConfig) -> dict[str, float | int | str]:
    """How noisy the log is: the loss's robust spread per step, its blips, and how heavy its
    tail is against a normal noise of that spread (stats.tail_df, stats.expected_exceedances;
    docs/signatures.md#log-noise)."""
    from ..stats import expected_exceedances, family_z, robust_sigma, tail_df

    z = ev.loss.z[np.isfinite(ev.loss.z) & (ev.loss.z != 0)]
    lv = np.log10(np.maximum(np.asarray(ev.loss.values, dtype=np.float64), 1e-12))
    steps_judged = int(z.size)
    tail = blips(ev, cfg)
    over = int(np.sum(z > cfg.z))
    df = tail_df(z)
    sigma = robust_sigma(np.diff(lv)) / math.sqrt(2) if lv.size > 3 else math.nan
    kind = (
        "quiet" if over <= 1 else ("heavy-tailed" if (math.isfinite(df) and df < 10) else "noisy")
    )
    return {
        "loss_noise_pct_per_step": round(100 * (10**sigma - 1), 2)
        if math.isfinite(sigma)
        else math.nan,
        "steps_judged": steps_judged,
        "steps_over_z": over,
        "expected_over_z_if_normal": expected_exceedances(steps_judged, cfg.z),
        "recovering_blips": len(tail),
        "largest_blip_z": max((zb for zb, _ in tail.values()), default=0.0),
        "tail_df": df,
        "family_z": family_z(max(steps_judged, 1)),
        "kind": kind,
        "ignored_columns": ", ".join(ev.ignored_columns),
    }


# Rules that read the noise (a z against a spread, measured or floored); on an excerpt's last
# line alone they cannot tell a hard batch from an onset. The ratio rules, a non-finite loss,
# an LR jump, a NaN count and a collapsing loss scale need no line after.
NOISE_RULES = (
    "trend",
    "persisting-run",
    "short-z",
    "short-joint",
    "held",
    "held-shift",
    "one-reference-line",
    "tail",
)
UNDECIDABLE = "the last line rises; one line cannot tell a hard batch from an onset"


def undecidable_last_line(onsets: list[Onset], ev: LogEvidence, cfg: TriageConfig) -> bool:
    """Whether an excerpt's only evidence is its last line rising by a noise rule: nothing
    after it is logged, so it may be a hard batch as well as an onset (said, not called)."""
    lines = _lines(ev)
    if not onsets or not ev.excerpt or not lines or len(lines) >= cfg.judge_after:
        return False
    last = lines[-1]
    return all(o.step == last and o.rule in NOISE_RULES for o in onsets)
