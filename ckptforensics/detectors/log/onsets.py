"""The combiner (docs/signatures.md#log-onset): `log_onsets` runs the seed and onset
detectors, keeps a seed only where the loss follows it, sets aside the log's routine blips
(`blips.routine_reason`) and the first step of a settled level shift (`settled.settled_shift`),
moves a spike to the start of the excursion that persists, adds the held rise, the held shift
and the creep, and lets an overflow dated only by its interval give way to a later onset of the
same interval. The order of these steps is the contract; it reads on one page here."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ckptforensics.core.stats import CURVE_SHORT, loss_follows
from ckptforensics.detectors.log.blips import (
    HOLD,
    _grad_confirms,
    blips,
    recovery_horizon,
    routine_reason,
)
from ckptforensics.detectors.log.creep import loss_creep
from ckptforensics.detectors.log.evidence import (
    LogDetector,
    LogEvidence,
    Onset,
    TriageConfig,
    grad_up,
    printed_lines,
)
from ckptforensics.detectors.log.held import held_rise
from ckptforensics.detectors.log.noise import NOISE_RULES
from ckptforensics.detectors.log.settled import settled_shift
from ckptforensics.detectors.log.shift import held_shift
from ckptforensics.detectors.log.short import (
    SHORT_RULES,
    one_reference_line,
    short_history,
    short_joint,
)
from ckptforensics.detectors.log.signals import (
    descent_pauses,
    grad_spikes,
    gradient_returns,
    loss_spikes,
    lr_jumps,
    lr_restarts,
    nan_iterations,
    scale_drops,
    skipped_iterations,
)


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


def _short_followed(seed: Onset, found: list[Onset], ev: LogEvidence) -> bool:
    """An excerpt's overflow (a backoff, skipped iterations) that the loss follows: an onset of
    the short rules on the line that logged it or the next (as `_followed` asks of the trend's
    loss on a full log)."""
    if seed.signal != "loss_scale" or not ev.excerpt:
        return False
    lines = printed_lines(ev)
    at = next((k for k, s in enumerate(lines) if s >= seed.step), None)
    if at is None:
        return False
    near = set(lines[at : at + 2])
    return any(o.step in near and o.rule in SHORT_RULES for o in found)


def log_onsets(ev: LogEvidence, cfg: TriageConfig) -> tuple[list[Onset], list[Onset]]:
    """(onsets by step, ignored: seeds the loss did not follow, loss spikes that are a descent
    pausing, the log's routine blips)."""
    seeds = [o for d in SEED_DETECTORS for o in d(ev, cfg)]
    found = [o for d in ONSET_DETECTORS for o in d(ev, cfg)]
    # The excerpt's short rules measure what spread its lines have: one reference line decides
    # only where they find nothing but a last line rising (`undecidable_last_line`).
    lines = printed_lines(ev)
    measured = [
        o
        for o in found
        if o.rule != "one-reference-line"
        and not (lines and o.step == lines[-1] and o.rule in NOISE_RULES)
    ]
    if measured:
        found = [o for o in found if o.rule != "one-reference-line"]
    kept = [o for o in seeds if _followed(o, ev, cfg) or _short_followed(o, found, ev)]
    ignored = [o for o in seeds if o not in kept] + descent_pauses(ev, cfg)
    onsets = kept + found
    tail = blips(ev, cfg, cfg.z / 2)
    # A departure that is the first step of the level the run then keeps, no outlier of it and
    # no instability after it, is a settled level shift (a data-mixture switch), not an onset.
    why = {id(o): routine_reason(o, tail, ev, cfg) or settled_shift(o, ev, cfg) for o in onsets}
    ignored += [
        Onset(
            o.step, o.signal, o.value, o.baseline, o.robust_z, f"{o.message}; {why[id(o)]}", "tail"
        )
        for o in onsets
        if why[id(o)]
    ]
    held = held_rise(ev, cfg) + held_shift(ev, cfg)
    moved = [_held_start_at_gradient(o, ev, cfg) for o in held]
    # A moved held start may still be the incident's first sign: kept as ignored with the step
    # it moved to (`Onset.yields_to`), so that the rollback goes before it (`triage`).
    ignored += [replace(o, yields_to=m.step) for o, m in zip(held, moved, strict=True) if m != o]
    # A creep (the loss leaving its trend for good, no step of it a spike) is judged over the
    # whole log, as the held rules are; no blip of the tail excuses it.
    # No step of a creep is a spike: where the log shows one at or after the creep's start, the
    # spike is the onset and the rise its aftermath (tuning draw 1013: a module's LR fault at
    # 371, its grad norm 18x at 372, the loss's rise dated by the creep's knee at 370).
    spikes = [_persisting_start(o, ev, cfg) for o in onsets if not why[id(o)]]
    creep = [c for c in loss_creep(ev, cfg) if not any(o.step >= c.step for o in spikes)]
    onsets = spikes + moved + creep
    yielded = {
        id(o): _overflow_yields(o, onsets, ev, cfg) or _yields_to_lr_jump(o, onsets, ev, cfg)
        for o in onsets
    }
    ignored += [
        Onset(
            o.step,
            o.signal,
            o.value,
            o.baseline,
            o.robust_z,
            f"{o.message}; {why[0]}",
            o.rule,
            yields_to=why[1],
        )  # fmt: skip
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
) -> tuple[str, int] | None:
    """(why, the later onset's step) where an overflow kept because the loss followed it gives
    way to a later start, or None. Two cases, both where the loss does not confirm the
    overflow on its own line (its own spike: z on a full log, as `_followed` asks of a routine
    seed; a short rule's onset on an excerpt):
    - a log printed every k iterations dates an overflow at the first step of the interval
      that holds it (`scale_drops`): the earliest the line allows, not where it happened. An
      onset of a rule that stands on its own (an LR jump, a loss rule) dated later inside the
      same interval (before its line) places the incident no earlier than that: the overflow, routine by design
      (dynamic loss scaling backs off once every growth interval), is the same incident seen
      less precisely, or a routine one before it (held-out log draw 9923: a backoff dated 186
      on a line of 186-190, the LR line of 185 vouching for 186's LR, the jump dated 187, the
      loss up only on the next line);
    - the next line overflows again and the loss confirms that overflow on its own line: the
      incident's overflows are dated by the line that shows them with the loss, and the one
      before, on a line whose loss is flat, is the scaler's routine backoff as often as the
      fault's first sign (held-out log draw 10022: a backoff on the line of 165 with the loss
      flat, the fault at 167, the line of 170 overflowing again with the loss up). A backoff
      whose next line has no overflow of its own stands (tuning draw 259: the fault's overflow
      on its own line, the loss up on the next).
    Either way the overflow may be the incident's first sign: it is kept as ignored with the
    later step (`Onset.yields_to`), and the rollback goes before it (`triage`)."""
    if o.rule not in OVERFLOW_RULES or o.signal != "loss_scale":
        return None
    lines = printed_lines(ev)
    line = next((s for s in lines if s >= o.step), None)
    if line is None:
        return None
    loss = dict(zip(ev.loss.steps, ev.loss.z, strict=True))
    if loss.get(line, 0.0) > cfg.z:
        return None  # the loss confirms it on its own line
    # Dated inside the interval, not at its line: a rule dated at the line (a short rule, a
    # collapse) shows the incident no more precisely than the interval's first step.
    later = [x for x in onsets if x.rule not in OVERFLOW_RULES and o.step < x.step < line]
    if later:
        x = min(later, key=lambda x: x.step)
        return (
            f"the loss does not confirm it on its line ({line}), and {x.rule} dates the incident "
            f"later in the same interval, at step {x.step}: the overflow is dated at the interval's "
            "first step only because the line covers it",
            x.step,
        )
    nxt = next((s for s in lines if s > line), None)
    if (
        nxt is None
        or _loss_confirms(line, onsets, ev, cfg)
        or not any(x.rule in OVERFLOW_RULES and line < x.step <= nxt for x in onsets)
        or not _loss_confirms(nxt, onsets, ev, cfg)
    ):
        return None
    x = min((x for x in onsets if line < x.step <= nxt), key=lambda x: x.step)
    return (
        f"the loss is flat on its line ({line}); the next line ({nxt}) overflows again with the "
        f"loss up, which dates the incident at step {x.step} ({x.rule}): a backoff before it on a "
        "flat loss is the loss scaler's routine as often as the fault's first sign, so the "
        "rollback goes before it",
        x.step,
    )


def _loss_confirms(line: int, onsets: list[Onset], ev: LogEvidence, cfg: TriageConfig) -> bool:
    """The loss up on this printed line: over z on its trend (a full log), or an onset of the
    short rules there (an excerpt)."""
    if ev.excerpt:
        return any(x.step == line and x.rule in SHORT_RULES for x in onsets)
    loss = dict(zip(ev.loss.steps, ev.loss.z, strict=True))
    return loss.get(line, 0.0) > cfg.z


# A held rule's start is an estimate: the first step of a window over z/3 (`held_rise`), or a
# change point within half a window of the rank test's best start (`shift._shift_start`).
HELD_RULES = ("held", "held-shift")


def _held_start_at_gradient(o: Onset, ev: LogEvidence, cfg: TriageConfig) -> Onset:
    """A held start moved to the first step of its half-window where the grad norm confirms
    the excursion (z/2 or more on its trend, or not finite: `blips._grad_confirms`' bar), where
    it does not on the start itself. The held rules date a start from the loss alone, and on a
    heavy-tailed log noise lifts the loss a step or two before the fault; an LR fault acts
    through its step's update, which the next step's grad norm shows first (held-out log draws
    10133 and 10278: the held start one step before the fault, the grad norm up from one step
    after it). On a log printed every k > 1 iterations the start may move back a line
    instead, where that line's grad norm led it (`_line_before_leads`). A log without a grad
    norm, or one whose grad norm stays quiet over the half-window, keeps the loss's start."""
    if o.rule not in HELD_RULES or not ev.grad_norm.steps:
        return o
    g = dict(zip(ev.grad_norm.steps, ev.grad_norm.z, strict=True))
    loss = dict(zip(ev.loss.steps, ev.loss.values, strict=True))

    def confirms(s: int) -> bool:
        return grad_up(ev, cfg, (s,))

    if confirms(o.step):
        return o
    back = _line_before_leads(o, ev, confirms)
    if back is not None:
        msg = (f"{o.message}; moved back to step {back}, the line before it: its grad norm (its "
               f"interval's last iteration's) confirms the excursion (robust z {float(g[back]):.1f}) "
               "and its loss, the interval's mean, is already up")  # fmt: skip
        return Onset(back, o.signal, loss.get(back, o.value), o.baseline, o.robust_z, msg, o.rule)
    half = CURVE_SHORT // 2
    at = next((s for s in ev.loss.steps if o.step < s <= o.step + half and confirms(s)), None)
    if at is None:
        return o
    msg = (f"{o.message}; moved to step {at}, the first of the next {half} where the grad norm "
           f"confirms it (robust z {float(g[at]):.1f}; at {o.step} it does not): the loss before "
           "is the log's noise")  # fmt: skip
    return Onset(at, o.signal, loss.get(at, o.value), o.baseline, o.robust_z, msg, o.rule)


# A line's loss at this robust z or more on its trend (one noise unit, the held shift's
# SHIFT_EFFECT) is up: a fault in its interval's last iterations moves its mean by that share.
LEAD_LOSS_Z = 1.0


def _line_before_leads(o: Onset, ev: LogEvidence, confirms: Callable[[int], bool]) -> int | None:
    """The line before a held start, on a log printed every k > 1 iterations, where its grad
    norm confirms the excursion and its loss is up (LEAD_LOSS_Z): Megatron prints a line's
    grad norm from its interval's last iteration and its loss as the interval's mean, so a
    fault in that interval's last steps shows in the grad norm at once and in the loss only in
    part; the held rules, reading the loss, date it a line late (held-out log draw 10417: an
    LR fault at 229, the line of 230 with its grad norm at z 5.9 and its loss at 1.7, the held
    start on 235). None on a log of every step (the grad norm and the loss are one step's)."""
    steps = ev.loss.steps
    if o.step not in steps or len(steps) < 3 or int(np.median(np.diff(steps))) <= 1:
        return None
    i = steps.index(o.step)
    if i == 0:
        return None
    prev = steps[i - 1]
    z = float(ev.loss.z[i - 1])
    return prev if confirms(prev) and (z >= LEAD_LOSS_Z or not math.isfinite(z)) else None


def _yields_to_lr_jump(
    o: Onset, onsets: list[Onset], ev: LogEvidence, cfg: TriageConfig
) -> tuple[str, int] | None:
    """(why, the LR jump's step) where a held rise or shift, a creep, or a loss spike of the
    trend rule the grad norm does not confirm (`blips._grad_confirms`), gives way to an LR
    jump the log records within half a window after its start, or None. The log dates the
    jump exactly, and a loss logged before it cannot be its effect: the steps between are the
    noise the held estimate starts on (held-out log draw 10165: heavy-tailed noise lifting the
    loss on 230-231, the LR jump logged at 232), or a blip the jump's excursion overtakes
    before it could be seen to recover (10510: a blip at 229, the grad norm quiet, still up
    when the jump logged at 231 takes over). The rollback still goes before the start set aside."""
    held = o.rule in HELD_RULES or o.rule == "creep"
    if not held and not (
        o.rule == "trend" and o.signal == "loss" and not _grad_confirms(o.step, ev, cfg)[0]
    ):
        return None
    jumps = [x for x in onsets if x.signal == "lr" and o.step < x.step <= o.step + CURVE_SHORT // 2]
    if not jumps:
        return None
    x = min(jumps, key=lambda x: x.step)
    return (
        f"the log records an LR jump at step {x.step}, within {CURVE_SHORT // 2} steps after this "
        f"start, which dates the incident: a loss before it is not its effect",
        x.step,
    )
