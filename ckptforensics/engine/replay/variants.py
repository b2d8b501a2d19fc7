"""A replay that parts from the run's log is a question: which of the explanations the run's
own files name makes it land? Each is replayed as a variant of the plan from the same *before*
state, and checked against the same log (issue #42). The variants:

- a resume inside the window that lost the optimizer's state: the optimizer's step counter
  in *after* trails the trainer's steps since *before* (a fresh optimizer counts from the
  resume: `detectors.diff.state.detect_optimizer_state_lost`'s rule), so the replay drops the
  state at the resume, as the trainer's fresh optimizer had none;
- the LR as the run's log states it: group 0's as logged, the others at their ratio to it in
  *before*, carried over the steps the log skips, where the plan had other LRs (a log that
  misses some steps; a *before* whose stored LR is not the log's).

A variant that lands on the log is the finding; the report lists every variant with the step
up to which it matched."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptforensics.engine.diff.records import optimizer_steps
from ckptforensics.engine.replay.logcheck import LogCheck, check_against_log
from ckptforensics.engine.replay.records import AFTER_SHARE, ReplayResult, after_share
from ckptforensics.engine.replay.window import Plan, run_window
from ckptforensics.formats.base import Checkpoint

__all__ = [
    "Variant",
    "Suspect",
    "explain",
    "optimizer_count",
    "resume_step",
    "suspects",
]

log = logging.getLogger(__name__)

# Steps an optimizer's counter may trail the trainer's for reasons other than a restart: the
# loss scaler's routine skipped steps (GradScaler skips the update and its step count).
ROUTINE_SKIPS = 2


@dataclass(frozen=True, slots=True)
class Suspect:
    """An explanation the run's files name, and the plan that replays it.

    Attributes:
        name: what is replayed ("a fresh optimizer from step 61").
        why: the evidence that names it.
        cause: the cause it stands for where it lands (None: a replay setting, no cause).
        edit: the plan as this explanation has it.
    """

    name: str
    why: str
    cause: str | None
    edit: Callable[[Plan], Plan]


@dataclass(frozen=True, slots=True)
class Variant:
    """One explanation replayed: whether it landed on the log, and up to which step it matched."""

    name: str
    why: str
    cause: str | None
    lands: bool
    matched_to: int | None  # the last step before its first miss (None: it missed the first)
    first_miss: int | None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def optimizer_count(ckpt: Checkpoint | None) -> int | None:
    """The optimizer's own step counter (the largest over its parameters), None without one."""
    return optimizer_steps(ckpt.optimizer) if ckpt is not None else None


def resume_step(p: Plan) -> tuple[int, str] | None:
    """The step a fresh optimizer restarted at inside the window, from the step counters:
    *after*'s counter trails *before*'s plus the trainer's steps between them, so it counted
    from a resume at step_after - counter_after; with the evidence, said."""
    if p.b is None or p.a.step is None or p.b.step is None:
        return None
    ca, cb = optimizer_count(p.a), optimizer_count(p.b)
    if ca is None or cb is None:
        return None
    expected = ca + (p.b.step - p.a.step)
    if cb >= expected - ROUTINE_SKIPS:
        return None
    at = max(p.b.step - cb, p.a.step)
    if at - p.a.step <= ROUTINE_SKIPS:
        # Skipped steps since the resume make the counter trail by them: a resume starts from
        # a checkpoint, and *before* is the one within them (the diff's rule).
        at = p.a.step
    why = (
        f"the optimizer's step counter is {cb} at step {p.b.step} where {p.a.step}'s {ca} plus "
        f"{p.b.step - p.a.step} steps would make {expected}: a fresh optimizer counted from the resume at step {at}"
    )
    return at, why


def _logged_lrs(p: Plan) -> dict[int, list[float]] | None:
    """Every window step's LR from the log (group 0's; the others at their ratio to it in
    *before*), carried over the steps it does not log; before its first logged step, the
    plan's (*before* stored the LR of the step after it). None where the log has no LR in
    the window."""
    logged = {s: p.logged[s]["lr"] for s in p.steps if "lr" in p.logged.get(s, {})}
    if not logged:
        return None
    base = p.lrs[p.steps[0]]
    ratios = [x / base[0] if base[0] > 0 else 1.0 for x in base]
    out: dict[int, list[float]] = {}
    last = None
    for s in p.steps:
        last = logged.get(s, last)
        out[s] = [last * r for r in ratios] if last is not None else list(p.lrs[s])
    return out


def _differs(a: dict[int, list[float]], b: dict[int, list[float]]) -> bool:
    return any(
        abs(x - y) > 1e-6 * max(abs(x), abs(y)) for s in a for x, y in zip(a[s], b[s], strict=True)
    )


def suspects(p: Plan) -> list[Suspect]:
    """The explanations the run's files name for a replay that parts from its log."""
    out: list[Suspect] = []
    logged = _logged_lrs(p)
    per_step = p.lr_source.startswith(("batch log", "training log, LR per group"))
    resumed = resume_step(p)
    if resumed is not None:
        at, why = resumed
        # The resumed run's LR is the log's: the resume rebuilt what set it, whatever *before*
        # stored (a fresh optimizer's groups start at their constructor's LR).
        lrs = logged if logged is not None and not per_step else p.lrs

        def fresh(q: Plan, at: int = at, lrs: dict[int, list[float]] = lrs) -> Plan:
            return dataclasses.replace(q, fresh_from=at + 1, lrs=lrs)

        out.append(
            Suspect(
                f"a fresh optimizer from step {at + 1} (a resume that lost the optimizer's state)",
                why,
                "optimizer_state_lost",
                fresh,
            )
        )
    if logged is not None and not per_step and _differs(logged, p.lrs):
        n = sum("lr" in p.logged.get(s, {}) for s in p.steps)

        def from_log(q: Plan, lrs: dict[int, list[float]] = logged) -> Plan:
            return dataclasses.replace(
                q,
                lrs=lrs,
                lr_source="training log lr as logged (group 0's; the others at their ratio to it in before)",
            )

        out.append(
            Suspect(
                "the LR as the run's log states it",
                f"the log gives the LR of {n} of the window's {len(p.steps)} steps; the plan used {p.lr_source}",
                None,
                from_log,
            )
        )
    return out


def _outcome(check: LogCheck, steps: list[int]) -> tuple[bool, int | None, int | None]:
    miss = check.first_miss
    if miss is None:
        return bool(check.first_checked is not None), steps[-1], None
    before = [s for s in steps if s < miss.step]
    return False, (before[-1] if before else None), miss.step


def explain(
    p: Plan,
    base: ReplayResult,
    clip: float | None,
    progress: Callable[[str], None] | None = None,
    on_after: bool = False,
) -> tuple[list[Variant], ReplayResult | None]:
    """Replay each suspect (`suspects`) from the same state under the base replay's clip and
    check it against the log, in turn until one lands: (the variants tried, the result of the
    one that landed, None where none did). A landed result carries its own plan.

    `on_after`: the base replay landed on the log but not on *after* (a log whose tolerance
    a fresh optimizer's first steps stay within): a variant lands where it reproduces *after*
    as well (`AFTER_SHARE`)."""
    tried: list[Variant] = []
    # The base's clip first; where the clip was calibrated, the other candidates too (the
    # base chose among them under the wrong explanation: a fresh optimizer's second step
    # depends on the clip, its first does not).
    clips = [clip, *[c for c, _ in p.clips if c != clip]]
    for sus in suspects(p):
        q = sus.edit(p)
        best: Variant | None = None
        for c in clips:
            if progress is not None:
                progress(f"variant: {sus.name}, clip {c if c is not None else 'none'}")
            result = run_window(q, c, progress)
            result.check = check_against_log(
                result.records, q.logged, q.precision, q.batches.micro_batch_size, c
            )
            lands, upto, miss = _outcome(result.check, q.steps)
            note = f"clip {c if c is not None else 'none'}"
            if on_after:
                share = after_share(result)
                lands = lands and share is not None and share <= AFTER_SHARE
                note += f"; {share:.1%} of after's elements missed" if share is not None else ""
            v = Variant(sus.name, sus.why, sus.cause, lands, upto, miss, note)
            log.info(
                "variant %s (%s): %s", sus.name, note, "lands" if lands else f"misses at {miss}"
            )
            if lands:
                tried.append(v)
                src = "the variant's: the clip under which it lands on the log"
                result.config = q.config(c, src)
                result.logged, result.baseline, result.plan = base.logged, base.baseline, q
                return tried, result  # the first that lands is the finding: the rest need no replay
            if best is None or (v.matched_to or 0) > (best.matched_to or 0):
                best = v
        assert best is not None
        tried.append(best)
    return tried, None
