"""The rules over a full log, one signal each (docs/signatures.md#log-onset): the loss and
grad norm leaving their trends, a loss scale backing off, Megatron's skipped and NaN
iteration counts, an LR jumping or re-running its warm-up, a parameter's gradient returning.
The grad-norm and overflow rules are seeds (`onsets.SEED_DETECTORS`): they count only where
the loss follows."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ckptforensics.core.tensors import lr_growth_limit
from ckptforensics.detectors.log.evidence import Curve, LogEvidence, Onset, TriageConfig
from ckptforensics.detectors.log.short import SPIKY_RULE
from ckptforensics.logs import lr_columns, param_grad_columns


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
            rule = "nonfinite" if not math.isfinite(v) else "trend" if zi > cfg.z else SPIKY_RULE
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
    a new data source in a small batch do that), not an incident (`descent_pauses`)."""
    return [o for o, why in _judged_spikes(ev, cfg) if not why]


def descent_pauses(ev: LogEvidence, cfg: TriageConfig) -> list[Onset]:
    """The loss spikes `loss_spikes` sets aside as a descent pausing, each saying why: for the
    ignored list, so that a reader sees the candidate and the figures that excused it."""
    return [
        replace(o, message=f"{o.message}; {why}", rule="descent-pause")
        for o, why in _judged_spikes(ev, cfg)
        if why
    ]


def _judged_spikes(ev: LogEvidence, cfg: TriageConfig) -> list[tuple[Onset, str]]:
    """Each loss spike with why it is a descent pausing ('' where it is not)."""
    above = {s: z for s, z in zip(ev.loss_level.steps, ev.loss_level.z, strict=True)}
    grad = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    out = []
    for o in _spikes(ev.loss, cfg):
        za, zg = above.get(o.step, math.inf), grad.get(o.step, 0.0)
        pause = (
            math.isfinite(o.value)
            and o.value < cfg.loss_factor * o.baseline
            and za <= cfg.z
            and zg < cfg.z / 2
        )
        if not pause:
            out.append((o, ""))
            continue
        gz = f"grad norm z {zg:.2f}" if o.step in grad else "no grad norm logged"
        out.append(
            (
                o,
                f"no further above the level the loss has just been at than its noise allows "
                f"(robust z {za:.2f} <= {cfg.z:g}) and the grad norm not rising ({gz} < "
                f"{cfg.z / 2:g}): a steep descent pausing",
            )
        )
    return out


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
