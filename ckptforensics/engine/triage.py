"""Training logs -> spike onsets, the rollback checkpoint, and the commands to run next."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ckptforensics.checkpoints import first_complete, list_checkpoints
from ckptforensics.core.errors import ForensicsError
from ckptforensics.detectors.log import (
    Onset,
    TriageConfig,
    log_evidence,
    log_onsets,
    undecidable_last_line,
)
from ckptforensics.detectors.log.noise import UNDECIDABLE, log_noise
from ckptforensics.logs import (
    find_metrics,
    group_lrs,
    lr_columns,
    param_grad_columns,
    read_log,
    read_metrics,
)

__all__ = [
    "TriageConfig",
    "Onset",
    "TriageResult",
    "read_metrics",
    "find_metrics",
    "triage",
    "lr_columns",
    "group_lrs",
    "param_grad_columns",
]


@dataclass(slots=True)
class TriageResult:
    """What `triage` found: the onsets, the rollback, and what it read to find them.

    `metrics_file` is the log as given or discovered (a file, a folder of legs, a glob);
    `files` every file read; `legs` each leg (a launch of the trainer) with the steps a
    later leg logged again (the later leg wins)."""

    metrics_file: str
    steps: int
    files: list[str] = field(default_factory=list)
    log_format: str = ""
    legs: list[dict[str, Any]] = field(default_factory=list)
    onsets: list[Onset] = field(default_factory=list)
    ignored: list[Onset] = field(
        default_factory=list
    )  # grad-norm blips / backoffs the loss did not follow
    first_bad_step: int | None = None
    rule: str | None = None  # the rule that decided the first onset (docs/signatures.md#log-onset)
    noise: dict[str, Any] = field(
        default_factory=dict
    )  # how noisy the log is (detectors.log.noise.log_noise)
    # Why no onset is called where the log cannot say (an excerpt ending on its first rising line).
    undecided: str | None = None
    rollback: str | None = None
    rollback_step: int | None = None
    # Where the rollback checkpoint is the step just before an onset the loss or grad norm
    # dates: safe for a bad batch at the onset, not for a bad update one step before it
    # (`_rollback_caveat`); None otherwise.
    rollback_caveat: str | None = None
    after: str | None = None
    after_step: int | None = None
    drift: str | None = None
    commands: list[str] = field(default_factory=list)
    skipped: list[str] = field(
        default_factory=list
    )  # incomplete checkpoints passed over, and what they lack
    timeline: dict[str, list[float]] = field(
        default_factory=dict
    )  # step, loss, grad_norm, checkpoints
    # A run already rolled back (a later leg of its log starts at or before an earlier leg's
    # last step): {"from": the step it resumed at, "legs": [...]}; the log read is the latest leg's.
    resumed: dict[str, Any] | None = None


def triage(
    metrics: Path | str,
    run_dir: Path | None,
    cfg: TriageConfig | None = None,
    keys: dict[str, str] | None = None,
) -> TriageResult:
    """Find the first bad step in a training log and the checkpoint to roll back to.

    `metrics`: a log file, a folder of its files (a restarted run's legs), or a glob."""
    cfg = cfg or TriageConfig()
    log = read_log(metrics, keys)
    rows = log.rows
    if not rows:
        raise ForensicsError(f"{metrics}: no rows with a step")
    res = TriageResult(
        metrics_file=str(metrics),
        steps=len(rows),
        files=log.files,
        log_format=log.kind,
        legs=[asdict(leg) for leg in log.legs],
    )
    ev = log_evidence(rows, cfg)
    res.onsets, res.ignored = log_onsets(ev, cfg)
    res.noise = log_noise(ev, cfg)
    if undecidable_last_line(res.onsets, ev, cfg):
        res.undecided = f"{UNDECIDABLE} (step {res.onsets[0].step}, {res.onsets[0].rule})"
        res.ignored += res.onsets
        res.onsets = []
    if res.onsets:
        res.first_bad_step = res.onsets[0].step
        res.rule = res.onsets[0].rule
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
        # Incomplete ones (a save that died) are passed over, and said so (`first_complete`).
        # An overflow or a held start set aside for the onset (`Onset.yields_to`) may be its
        # first sign: the rollback goes before it too.
        first = min([res.first_bad_step] + [o.step for o in res.ignored if o.yields_to is not None])
        safe = [(s, p) for s, p in ckpts if s < first - cfg.margin]
        later = [(s, p) for s, p in ckpts if s >= res.first_bad_step]
        back, skipped_back = first_complete(safe[::-1])
        after, skipped_after = first_complete(later)
        res.skipped = skipped_back + skipped_after
        if back is not None:
            res.rollback_step, res.rollback = back[0], str(back[1])
            res.rollback_caveat = _rollback_caveat(res, safe)
        if after is not None:
            res.after_step, res.after = after[0], str(after[1])
    if res.rollback_step is not None and run_dir is not None and res.rollback is not None:
        res.commands = _commands(run_dir, Path(res.rollback), res.rollback_step, res.after_step)
    res.resumed = _resumed(res.legs)
    if res.resumed is not None:
        where = run_dir if run_dir is not None else Path(res.files[0]).parent
        res.commands.append(
            f"ckptforensics recovery --run-dir {where} --resumed-from {res.resumed['from']} --out recovery/"
        )
    return res


def _resumed(legs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A run already rolled back: a leg of its log whose steps a later leg logged again (the
    logs package's `superseded`); it resumed at the step before that later leg's first."""
    back = [
        b["first"] - 1
        for a, b in zip(legs, legs[1:], strict=False)
        if a["superseded"] and b["first"] <= a["last"]
    ]
    return {"from": back[-1], "legs": legs} if back else None


# Onsets a log dates at the faulty step itself: the LR the scheduler set for that step.
_DATED_AT_CAUSE = ("lr", "lr_restart")


def _rollback_caveat(res: TriageResult, safe: list[tuple[int, Path]]) -> str | None:
    """A caveat where the rollback checkpoint is the step just before the onset and the onset
    is dated by the loss or grad norm: the checkpoint of step s - 1 holds s - 1's update, and
    the loss logged at s is the first computed after it. A bad batch at s leaves that
    checkpoint clean; a bad update at s - 1 (an LR or optimizer fault the log does not carry)
    is already in it, and from the log alone the two look the same. The replay tells them
    apart; the checkpoint before it is the one that holds neither."""
    first = res.onsets[0] if res.onsets else None
    if first is None or first.signal in _DATED_AT_CAUSE or res.rollback_step != first.step - 1:
        return None
    earlier, _ = first_complete([(s, p) for s, p in safe if s < res.rollback_step][::-1])
    prior = f"; the one before it is {earlier[1]} (step {earlier[0]})" if earlier else ""
    return (
        f"checkpoint {res.rollback_step} is the step just before the onset: clean if step "
        f"{first.step}'s batch is the cause, not if step {res.rollback_step}'s update is (its "
        f"loss first shows at {first.step}); `replay` from it tells which{prior}"
    )


def _commands(run_dir: Path, rollback: Path, before: int, after_step: int | None) -> list[str]:
    """The next commands, with what this run needs: a batch log if it kept one; a checkpoint
    with its model's config.json (an HF Trainer's) needs no --model, and with its trainer's
    arguments beside it (training_args.bin) can rebuild its batches (--data)."""
    after = f" --after {after_step}" if after_step is not None else ""
    builds = (rollback / "config.json").is_file()
    batch = run_dir / "batches.h5"
    source = (
        f" --batch {batch}"
        if batch.is_file()
        else (
            " --data TRAIN_DATA"
            if builds and (rollback / "training_args.bin").is_file()
            else " --batch BATCH_LOG"
        )
    )
    model = "" if builds else " --model MODEL"
    return [
        f"ckptforensics diff --run-dir {run_dir} --before {before}{after} --out incident/",
        f"ckptforensics replay --run-dir {run_dir} --before {before}{after}{source}{model} --out incident/",
        f"ckptforensics bisect --run-dir {run_dir} --before {before}{after}{source}{model} --out incident/",
        f"ckptforensics plan --run-dir {run_dir} --before {before}{after}{source}{model} --out plan/",
    ]


def _drift(rows: dict[int, dict[str, float]], onset: int, cfg: TriageConfig) -> str | None:
    """Slow grad-norm growth before the onset: the last quarter window's median vs the window's."""
    g = [
        rows[s]["grad_norm"]
        for s in rows
        if s < onset and "grad_norm" in rows[s] and math.isfinite(rows[s]["grad_norm"])
    ][-cfg.window :]
    if len(g) < 2 * cfg.min_history:
        return None
    recent, older = float(np.median(g[-max(len(g) // 4, cfg.min_history) :])), float(np.median(g))
    if recent > 2 * older:
        return f"grad norm drifted up {recent / older:.1f}x over the steps before the onset"
    return None


def as_dict(res: TriageResult) -> dict[str, Any]:
    return asdict(res)
