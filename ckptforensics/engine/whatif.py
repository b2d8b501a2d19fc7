"""What-if: replay the window from *before* under each mitigation and see which keeps the run on track."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.core.errors import ForensicsError, ReplayMismatch
from ckptforensics.core.tensors import MAD_TO_SIGMA
from ckptforensics.engine.replay.logcheck import LogCheck, check_against_log
from ckptforensics.engine.replay.run import ReplayConfig, plan
from ckptforensics.engine.replay.settle import diagnose_miss, settle, settle_clip
from ckptforensics.trainers import require_rebuilt_match

__all__ = ["Mitigation", "Outcome", "parse_mitigation", "whatif", "INVASIVENESS"]

# Least invasive first: what a recommendation prefers when several keep the run on track.
INVASIVENESS = (
    "clip",
    "eps",
    "lr_scale",
    "precision",
    "skip_samples",
    "skip_step",
    "reset_moments",
)


@dataclass(frozen=True, slots=True)
class Mitigation:
    """One --try: knob -> value ('clip=1.0,precision=bf16'); empty = the baseline."""

    text: str
    knobs: tuple[tuple[str, str], ...]

    @property
    def rank(self) -> int:
        return max((INVASIVENESS.index(k) for k, _ in self.knobs), default=-1)


def parse_mitigation(text: str) -> Mitigation:
    """`clip=1.0,lr_scale=0.5` -> Mitigation; unknown knobs are bad input."""
    knobs = []
    for part in filter(None, (x.strip() for x in text.split(","))):
        if "=" not in part:
            raise ForensicsError(f"--try {text!r}: expected knob=value, got {part!r}")
        k, v = (x.strip() for x in part.split("=", 1))
        if k not in INVASIVENESS:
            raise ForensicsError(
                f"--try {text!r}: unknown knob {k!r}; known: {', '.join(INVASIVENESS)}"
            )
        if k == "precision" and v not in ("fp32", "bf16", "fp16"):
            raise ForensicsError(f"--try {text!r}: precision must be fp32, bf16 or fp16")
        if k in ("clip", "eps", "lr_scale", "skip_step"):
            try:
                float(v)
            except ValueError:
                raise ForensicsError(f"--try {text!r}: {k} needs a number, got {v!r}") from None
        knobs.append((k, v))
    return Mitigation(text=text, knobs=tuple(knobs))


@dataclass(slots=True)
class Outcome:
    """One mitigation replayed: per-step loss and grad norm, and whether it stays on track."""

    mitigation: str
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    max_loss: float = math.nan
    max_grad_norm: float = math.nan
    final_loss: float = math.nan
    on_track: bool = False
    skipped_rows: dict[int, list[int]] = field(default_factory=dict)
    skipped_updates: list[int] = field(default_factory=list)  # overflow skips (not --try skip_step)
    # --try skip_step: the steps whose batch the trainer is told never to see; not replayed,
    # so not on the record (steps, losses, grad norms) the outcome is judged on.
    skipped_steps: list[int] = field(default_factory=list)
    note: str = ""


def _band(
    logged: dict[int, dict[str, float]], first: int, key: str = "loss"
) -> tuple[float, float] | None:
    """The pre-spike level and its band: median of the last 8 logged losses before the
    window, and 6 robust standard deviations of the last 16 around their linear trend
    (at least 5% of the level). One-sided: a loss below the level is on track."""
    pts = [
        (s, v[key]) for s, v in logged.items() if s < first and key in v and math.isfinite(v[key])
    ][-16:]
    if len(pts) < 5:
        return None
    x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    slope, icpt = np.polyfit(x, y, 1)
    res = y - (slope * x + icpt)
    level = float(np.median(y[-8:]))
    band = max(6 * MAD_TO_SIGMA * float(np.median(np.abs(res - np.median(res)))), 0.05 * level)
    return level, band


def whatif(
    cfg: ReplayConfig,
    n_steps: int,
    tries: list[Mitigation],
    auto_rows: dict[int, list[int]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Outcome], str | None, dict[str, Any]]:
    """Replay steps before+1 .. before+N under the baseline and each mitigation.

    Args:
        cfg: replay configuration (the *before* checkpoint, model, batches).
        n_steps: steps to replay.
        tries: mitigations; the baseline (none) is always replayed first.
        auto_rows: step -> rows for `skip_samples=auto` (bisect's result).

    Returns:
        (outcomes, recommended mitigation or None, the band used).
    """
    base_plan = plan(
        cfg,
        steps=None if n_steps <= 0 else list(range(_step_of(cfg) + 1, _step_of(cfg) + n_steps + 1)),
    )
    settle(base_plan, progress)
    base_plan.clips = [settle_clip(base_plan, progress)]
    steps = base_plan.steps
    band = _band(base_plan.logged, steps[0])
    gband = _band(base_plan.logged, steps[0], "grad_norm")
    outcomes = []
    for i, m in enumerate([Mitigation("baseline", ()), *tries], 1):
        if progress is not None:
            progress(f"what-if {i} of {len(tries) + 1}: {m.text}, {len(steps)} steps")
        outcomes.append(_replay_with(cfg, base_plan, m, auto_rows or {}, band, gband))
        if len(outcomes) == 1 and base_plan.batches.rebuilt and outcomes[0].losses:
            first = (outcomes[0].losses[0], outcomes[0].grad_norms[0])
            require_rebuilt_match(
                steps[0], first, base_plan.logged.get(steps[0]), base_plan.precision
            )
        if len(outcomes) == 1:
            check = _baseline_check(cfg, base_plan, outcomes[0])
    ranked = sorted(
        (
            (m.rank, i)
            for i, (o, m) in enumerate(zip(outcomes[1:], tries, strict=True))
            if o.on_track and not o.note
        )
    )
    best = tries[ranked[0][1]].text if ranked and not outcomes[0].on_track else None
    info = {
        "level": band[0] if band else None,
        "band": band[1] if band else None,
        "grad_norm_level": gband[0] if gband else None,
        "grad_norm_band": gband[1] if gband else None,
        "source": "training log before the window"
        if band
        else "first replayed step (no training log)",
        "baseline_on_track": outcomes[0].on_track,
        "clip": {"value": base_plan.clips[0][0], "source": base_plan.clips[0][1]},
        "check": check.as_dict(),
    }
    return outcomes, best, info


@dataclass(frozen=True, slots=True)
class _Replayed:
    """A baseline step in the shape `check_against_log` reads."""

    step: int
    loss: float
    grad_norm: float
    sample_loss: tuple[float, ...] = ()


def _baseline_check(cfg: ReplayConfig, p: Any, base: Outcome) -> LogCheck:
    """The baseline against the run's own log: mitigations are compared on a replay that is
    the run, so one that misses the log on its first checked step is refused (as `replay`
    refuses it), unless `cfg.allow_mismatch`. After the spike the baseline may leave the log
    (the run's own divergence is chaotic): that is not checked against it."""
    recs = [
        _Replayed(s, loss, g)
        for s, loss, g in zip(base.steps, base.losses, base.grad_norms, strict=True)
    ]
    check = check_against_log(recs, p.logged, p.precision, None, p.clips[0][0])
    miss = check.first_miss
    if miss is not None and miss.step == check.first_checked and not cfg.allow_mismatch:
        figures = (
            f"loss {miss.loss:.5g} vs {miss.logged_loss:.5g} logged"
            if miss.loss_ok is False
            else f"grad norm {miss.grad_norm:.4g} vs {miss.logged_grad_norm:.4g} logged"
        )
        raise ReplayMismatch(
            f"the baseline replay does not reproduce the run's own log on its first checked step {miss.step} ({figures}); "
            f"likeliest: {diagnose_miss(p, miss, check.loss_atol)}; pass --allow-mismatch to compare the mitigations anyway"
        )
    return check


def _step_of(cfg: ReplayConfig) -> int:

    with open_checkpoint(cfg.before) as a:
        if a.step is None:
            raise ForensicsError(f"{cfg.before}: the checkpoint does not record its step")
        return a.step


def _replay_with(
    cfg: ReplayConfig,
    base: Any,
    m: Mitigation,
    auto_rows: dict[int, list[int]],
    band: Any,
    gband: Any,
) -> Outcome:
    knobs = dict(m.knobs)
    p = base  # the baseline's settled plan (precision, loss scale, clip); a precision knob changes it
    if "precision" in knobs:
        p = plan(dataclasses.replace(cfg, precision=knobs["precision"]), steps=base.steps)
        settle(p)
    clip = float(knobs["clip"]) if "clip" in knobs else base.clips[0][0]
    sess = p.session()
    out = Outcome(mitigation=m.text)
    try:
        if "eps" in knobs:
            for g in sess.opt.param_groups:
                g["eps"] = float(knobs["eps"])
        if "reset_moments" in knobs:
            pattern = knobs["reset_moments"]
            for name, prm in sess.params:
                if fnmatch.fnmatch(sess.to_ckpt(name), pattern) or fnmatch.fnmatch(name, pattern):
                    st = sess.opt.state.get(prm)
                    if st:
                        st["exp_avg"].zero_()
                        st["exp_avg_sq"].zero_()
        scale = float(knobs.get("lr_scale", 1.0))
        skip_step = int(float(knobs["skip_step"])) if "skip_step" in knobs else None
        rows = _rows(knobs.get("skip_samples"), auto_rows, p)
        if "skip_samples" in knobs and not rows:
            out.note = "no culprit rows found in these steps: nothing skipped"
        if skip_step is not None and skip_step not in p.steps:
            out.note = f"step {skip_step} is not in the window ({p.steps[0]}-{p.steps[-1]}): nothing skipped"
        for s in p.steps:
            if s == skip_step:  # the trainer never sees this batch: no forward, no update
                out.skipped_steps.append(s)
                continue
            batch = p.batches.batch(s)
            if s in rows:
                keep = torch.tensor(
                    [i for i in range(batch["input_ids"].shape[0]) if i not in rows[s]]
                )
                batch = {k: v[keep] for k, v in batch.items()}
                out.skipped_rows[s] = rows[s]
            rec, _ = sess.step(s, batch, [lr * scale for lr in p.lrs[s]], clip)
            out.steps.append(s)
            if rec.skipped:
                out.skipped_updates.append(s)
            out.losses.append(rec.loss)
            out.grad_norms.append(rec.grad_norm)
    finally:
        sess.close()
    fin = [x for x in out.losses if math.isfinite(x)]
    out.max_loss = max(fin) if len(fin) == len(out.losses) and fin else math.inf
    out.max_grad_norm = (
        (max(out.grad_norms) if all(math.isfinite(g) for g in out.grad_norms) else math.inf)
        if out.grad_norms
        else math.nan
    )
    out.final_loss = out.losses[-1] if out.losses else math.nan
    # On track: every step finite (no overflow, no skipped update), every loss and every
    # (pre-clip) grad norm under its pre-spike level plus band.
    first = out.losses[0] if out.losses else math.nan
    level, width = band if band is not None else (first, 0.2 * abs(first))
    glevel, gwidth = (
        gband
        if gband is not None
        else (out.grad_norms[0] if out.grad_norms else math.nan, math.inf)
    )
    finite = all(math.isfinite(x) for x in out.losses + out.grad_norms) and not out.skipped_updates
    if not out.losses and not out.note:
        out.note = "no step left to replay once the skipped ones are left out"
    out.on_track = (
        bool(out.losses)
        and finite
        and all(x <= level + width for x in out.losses)
        and all(g <= glevel + gwidth for g in out.grad_norms)
    )
    return out


def _rows(spec: str | None, auto_rows: dict[int, list[int]], p: Any) -> dict[int, list[int]]:
    if spec is None:
        return {}
    if spec == "auto":
        return auto_rows  # bisect found none: nothing to skip (the outcome says so)
    wanted = {int(x) for x in spec.replace(";", " ").replace("+", " ").split()}
    out: dict[int, list[int]] = {}
    for s in p.steps:
        ids = p.batches.sample_ids.get(s)
        if ids:
            hit = [i for i, sid in enumerate(ids) if sid in wanted]
            if hit:
                out[s] = hit
    return out
