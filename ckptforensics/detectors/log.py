"""Detectors over a training log (step -> metrics rows, `logs.read_metrics`): where an
incident starts (docs/signatures.md#log-onset).

Each detector is a pure function `(LogEvidence, TriageConfig) -> list[Onset]`. The seed
detectors (grad-norm spikes, loss-scale backoffs) raise candidates that count only where
the loss follows (`log_onsets` settles that); the onset detectors (loss spikes, LR jumps,
a gradient's return) are onsets as they stand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..logs import lr_columns, param_grad_columns
from ..tensors import CURVE_MIN_HISTORY, LOSS_FOLLOW, loss_follows, lr_growth_limit, trend_z

__all__ = ["TriageConfig", "Onset", "Curve", "LogEvidence", "LogDetector", "SEED_DETECTORS", "ONSET_DETECTORS", "log_evidence", "log_onsets"]

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


@dataclass(frozen=True, slots=True)
class Curve:
    """One logged signal judged against its own trend (`tensors.trend_z`), once."""

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
    loss_level: Curve  # the loss judged `above_level` too (tensors.trend_z)


LogDetector = Callable[[LogEvidence, TriageConfig], list[Onset]]


def _curve(rows: Rows, key: str, cfg: TriageConfig, above_level: bool = False) -> Curve:
    steps = [s for s in rows if key in rows[s]]
    vals = [rows[s][key] for s in steps]
    z, level = trend_z(vals, z=cfg.z, window=cfg.window, min_history=cfg.judge_after, above_level=above_level)
    return Curve(key, steps, vals, z, level)


def log_evidence(rows: Rows, cfg: TriageConfig) -> LogEvidence:
    scaled = any("loss_scale" in r for r in rows.values())
    return LogEvidence(rows, _curve(rows, "loss", cfg), _curve(rows, "grad_norm", cfg), scaled, _curve(rows, "loss", cfg, above_level=True))


def _spikes(c: Curve, cfg: TriageConfig) -> list[Onset]:
    """Steps whose log10(value) leaves the run's own trend, or a loss `loss_factor` times
    its baseline whatever the noise (Megatron-LM's 10x rule)."""
    key = c.key
    out = []
    for s, v, zi, base in zip(c.steps, c.values, c.z, c.level, strict=True):
        factor = (not math.isfinite(v)) or (key == "loss" and math.isfinite(base) and v >= cfg.loss_factor * base)
        if zi > cfg.z or factor:
            out.append(Onset(s, key, v, float(base), float(zi), f"{key} {v:.4g} at step {s} vs {base:.4g} on its trend (robust z {zi:.1f})"))
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
        if not math.isfinite(o.value) or o.value >= cfg.loss_factor * o.baseline or above.get(o.step, math.inf) > cfg.z or grad.get(o.step, 0.0) >= cfg.z / 2
    ]


def grad_spikes(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The grad norm leaving its trend (a seed: it moves first, but counts only where the loss follows)."""
    return _spikes(ev.grad_norm, cfg)


def scale_drops(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """A loss-scale backoff: that step overflowed (a seed: routine unless the loss follows)."""
    out = []
    steps = [s for s in ev.rows if "loss_scale" in ev.rows[s]]
    for a, b in zip(steps, steps[1:], strict=False):
        sa, sb = ev.rows[a]["loss_scale"], ev.rows[b]["loss_scale"]
        if sb < sa:
            out.append(Onset(a, "loss_scale", sb, sa, math.inf, f"loss scale backs off after step {a} ({sa:g} -> {sb:g}): that step overflowed"))
    return out


def lr_jumps(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """Any logged LR (the main one or a group's) rising faster than a linear warmup from
    zero can (2x the step ratio); one onset per step, naming the columns that jumped."""
    rows = ev.rows
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
        return math.isclose(vals[i], vals[0], rel_tol=1e-6) and vals[i - 1] > 2 * vals[i] and vals[i + 1] > 2 * vals[i]

    out = []
    i = n + 1
    while i <= len(vals) - n:
        j = repeats(i)
        if j is None and dip(i):
            b = steps[i]
            out.append(Onset(b, "lr_restart", vals[i], vals[i - 1], math.inf, f"the LR falls back to the run's first value at step {b} for one step ({vals[i - 1]:.3g} -> {vals[i]:.3g} -> {vals[i + 1]:.3g}): an optimizer and scheduler rebuilt at a resume"))
            i += n
        elif j is not None and repeats(i - 1) is None:
            b = steps[i] - j
            out.append(Onset(b, "lr_restart", vals[i], vals[i - 1], math.inf, f"the LR re-runs its warm-up from step {b} (the run's first values again: {vals[i - 1]:.3g} -> {vals[i]:.3g}): the scheduler restarted at a resume"))
            i += n
        i += 1
    return out


def gradient_returns(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """A parameter whose gradient norm sat >= 1000x below its peers' for `min_history`
    steps and comes back >= 1000x at once, to within 100x of its peers. Adam's second
    moment has decayed meanwhile, so its next updates are sign-like and lr-sized
    (Molybog et al. 2023, Adam instability)."""
    rows = ev.rows
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


def _followed(onset: Onset, ev: LogEvidence, cfg: TriageConfig) -> bool:
    """A grad-norm spike or a loss-scale backoff starts an incident only where the loss
    follows (`tensors.loss_follows`): a grad-norm blip the loss ignores, and dynamic loss
    scaling's routine backoff (every growth_interval steps), are normal operation."""
    steps = ev.loss.steps
    if not steps:
        return True
    z_grad = ev.grad_norm.z if ev.grad_norm.steps == steps else None  # aligned with the loss steps, or not used
    i = next((k for k, s in enumerate(steps) if s >= onset.step), len(steps))
    # An overflow under a loss scaler (a backoff, an inf grad norm) is routine by design:
    # at the end of the log it needs the loss to say otherwise.
    routine = onset.signal == "loss_scale" or (onset.signal == "grad_norm" and not math.isfinite(onset.value) and ev.scaled)
    level = ev.loss_level.z if ev.loss_level.steps == steps else None
    return loss_follows(ev.loss.z, i, cfg.z, cfg.follow, z_grad, benefit=not routine, routine=routine, z_level=level)


SEED_DETECTORS: tuple[LogDetector, ...] = (grad_spikes, scale_drops)
ONSET_DETECTORS: tuple[LogDetector, ...] = (loss_spikes, lr_jumps, lr_restarts, gradient_returns)
# When two signals start on one step, the report names the most causal first.
_SIGNAL_ORDER = ("lr", "lr_restart", "param_grad", "loss_scale", "grad_norm", "loss")


def log_onsets(ev: LogEvidence, cfg: TriageConfig) -> tuple[list[Onset], list[Onset]]:
    """(onsets by step, seeds the loss did not follow: ignored)."""
    seeds = [o for d in SEED_DETECTORS for o in d(ev, cfg)]
    kept = [o for o in seeds if _followed(o, ev, cfg)]
    ignored = [o for o in seeds if o not in kept]
    onsets = kept + [o for d in ONSET_DETECTORS for o in d(ev, cfg)]
    return sorted(onsets, key=lambda o: (o.step, _SIGNAL_ORDER.index(o.signal))), ignored
