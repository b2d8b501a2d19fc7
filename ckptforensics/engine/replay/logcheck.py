"""Compare every replayed step with the run's own log: a replay is evidence only where it
reproduces what the run recorded.

The log's figures are read in the run's own terms: a loss logged at step s is that step's loss,
or the mean over the logging interval ending at s (HF Trainer's `logging_steps`, Megatron's
`--log-interval`), or the loss of one micro-batch (karpathy/nanoGPT logs the last micro-step's
`loss.item() * gradient_accumulation_steps`); the convention is found on the first step that
can be checked and kept for the window. A grad norm is the step's pre-clip norm, or the
clipped one where a trainer logs that. Pure: records and logged rows in, a `LogCheck` out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.trainers import convention_of

__all__ = [
    "LOSS_RTOL",
    "GRAD_RTOL",
    "TOLERANCE_SOURCE",
    "StepCheck",
    "LogCheck",
    "check_against_log",
    "log_rounding",
]

# Relative tolerance of a replayed step's loss against the logged one, per precision. The same
# batch from the same weights replays within float noise on the same kernels (2e-7 relative,
# fixtures/hf_data_run.py); across devices fp32 reductions differ in the last bits, TF32
# matmuls by ~1e-4 of the loss; the next batch is ~1% away. A tenth of that in fp32; in bf16 /
# fp16 kernels differ across devices by a few 1e-4 of the loss and autocast's casts move it
# further: half of the batch-to-batch spread.
LOSS_RTOL = {"fp32": 1e-3, "bf16": 5e-3, "fp16": 5e-3}
# Grad norms spread by tens of percent between batches and by well under a percent across
# devices in fp32; low-precision gradients by a few percent.
GRAD_RTOL = {"fp32": 1e-2, "bf16": 3e-2, "fp16": 3e-2}
TOLERANCE_SOURCE = (
    "docs/signatures.md#replay-vs-log (float noise across devices vs batch-to-batch spread)"
)


@dataclass(frozen=True, slots=True)
class StepCheck:
    """One logged step against its replay (None: not logged, or not comparable)."""

    step: int
    loss: float | None = None  # replayed, in the log's convention
    logged_loss: float | None = None
    grad_norm: float | None = None
    logged_grad_norm: float | None = None
    loss_ok: bool | None = None
    grad_ok: bool | None = None

    @property
    def ok(self) -> bool:
        return self.loss_ok is not False and self.grad_ok is not False

    @property
    def checked(self) -> bool:
        return self.loss_ok is not None or self.grad_ok is not None


@dataclass(slots=True)
class LogCheck:
    """Every replayed step the log can speak for, compared.

    Attributes:
        checks: per logged step of the window, in step order.
        loss_as: how the log's loss was read (the convention that matched first).
        grad_as: how its grad norm was read.
        loss_rtol, loss_atol, grad_rtol: the tolerances (atol: the log's own rounding).
        note: why steps were not checked, where some were not.
    """

    checks: list[StepCheck] = field(default_factory=list)
    loss_as: str = "the step's loss"
    grad_as: str = "the step's pre-clip grad norm"
    loss_rtol: float = 1e-3
    loss_atol: float = 0.0
    grad_rtol: float = 1e-2
    note: str = ""

    @property
    def first_checked(self) -> int | None:
        return next((c.step for c in self.checks if c.checked), None)

    @property
    def first_miss(self) -> StepCheck | None:
        return next((c for c in self.checks if c.checked and not c.ok), None)

    def as_dict(self) -> dict[str, Any]:
        miss = self.first_miss
        return {
            "checked_steps": [c.step for c in self.checks if c.checked],
            "first_miss": miss.step if miss else None,
            "loss_as": self.loss_as,
            "grad_as": self.grad_as,
            "tolerance": {
                "loss_rtol": self.loss_rtol,
                "loss_atol": self.loss_atol,
                "grad_rtol": self.grad_rtol,
                "source": TOLERANCE_SOURCE,
            },
            "note": self.note,
            "steps": [
                {
                    k: getattr(c, k)
                    for k in (
                        "step",
                        "loss",
                        "logged_loss",
                        "loss_ok",
                        "grad_norm",
                        "logged_grad_norm",
                        "grad_ok",
                    )
                }
                for c in self.checks
            ],
        }


def log_rounding(values: Sequence[float]) -> float:
    """Half a unit of the last decimal every logged value carries (0 when they carry full
    floats): a log printed with 4 decimals cannot match closer than 5e-5."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0
    for d in range(1, 9):
        if all(abs(v - round(v, d)) <= 1e-12 * max(1.0, abs(v)) for v in finite):
            return 0.5 * 10.0**-d
    return 0.0


def _close(mine: float, theirs: float, rtol: float, atol: float) -> bool:
    if not math.isfinite(theirs) or not math.isfinite(mine):
        return not math.isfinite(theirs) and not math.isfinite(mine)
    return abs(mine - theirs) <= rtol * abs(theirs) + atol


def _micro_means(rec: Any, micro: int | None) -> list[float]:
    """Token-weighted mean loss of each micro-batch of a replayed step (rows in order)."""
    loss, tok = list(rec.sample_loss), list(getattr(rec, "sample_tokens", ()) or ())
    if not micro or micro >= len(loss) or len(tok) != len(loss):
        return []
    out = []
    for i in range(0, len(loss), micro):
        n = sum(tok[i : i + micro])
        out.append(
            sum(a * b for a, b in zip(loss[i : i + micro], tok[i : i + micro], strict=True)) / n
            if n
            else math.nan
        )
    return out


def _loss_candidates(
    s: int, recs: dict[int, Any], prev_logged: int | None, micro: int | None
) -> list[tuple[str, float]]:
    """What the log's loss at step s may be, in the order trainers log it."""
    out: list[tuple[str, float]] = []
    spacing = s - prev_logged if prev_logged is not None else 1
    if spacing == 1:
        out.append(("the step's loss", recs[s].loss))
    else:
        span = range(prev_logged + 1, s + 1)  # type: ignore[operator]
        if all(t in recs for t in span):
            out.append(
                ("the step's loss", recs[s].loss)
            )  # a point sample every `spacing` steps (nanoGPT)
            vals = [recs[t].loss for t in span]
            out.append(
                (f"the mean over the logging interval ({spacing} steps)", sum(vals) / len(vals))
            )
    means = _micro_means(recs[s], micro) if out else []
    if means:
        out.append(
            (f"the last micro-batch's loss ({convention_of('last_micro_batch_loss')})", means[-1])
        )
        out.append(("the first micro-batch's loss (one rank's)", means[0]))
    return out


def check_against_log(
    records: Sequence[Any],
    logged: dict[int, dict[str, float]],
    precision: str,
    micro_batch_size: int | None = None,
    clip: float | None = None,
) -> LogCheck:
    """Compare each replayed step (`records.StepRecord`) with the logged rows of the run
    (`logs.read_metrics`: step -> {"loss", "grad_norm", ...}, the whole log).

    A step is checked where the log has a value for it and the replay covers what that value
    summarises (a logging interval that starts before the window is not checked). The loss
    convention is the first candidate that matches on the first checkable step (else the
    step's loss, and that step misses); a grad norm matches as the pre-clip norm or as the
    clipped one. A column that is zero on every logged line was never computed (Megatron-
    DeepSpeed's grad norm): it is not checked.
    """
    check = LogCheck(
        loss_rtol=LOSS_RTOL.get(precision, 5e-3), grad_rtol=GRAD_RTOL.get(precision, 3e-2)
    )
    recs = {r.step: r for r in records}
    if not recs or not logged:
        check.note = "no training log" if not logged else "nothing replayed"
        return check
    all_steps = sorted(logged)
    losses = [logged[t]["loss"] for t in all_steps if "loss" in logged[t]]
    check.loss_atol = log_rounding(losses)
    grads = [logged[t]["grad_norm"] for t in all_steps if "grad_norm" in logged[t]]
    grad_alive = any(g != 0 for g in grads)
    loss_steps = [t for t in all_steps if "loss" in logged[t]]
    chosen: str | None = None
    skipped = []
    for s in sorted(recs):
        row = logged.get(s)
        if row is None:
            continue
        c = StepCheck(step=s)
        if "loss" in row:
            prev = max((t for t in loss_steps if t < s), default=None)
            cands = _loss_candidates(s, recs, prev, micro_batch_size)
            if chosen is None and cands:
                hit = next(
                    (
                        name
                        for name, v in cands
                        if _close(v, row["loss"], check.loss_rtol, check.loss_atol)
                    ),
                    None,
                )
                chosen = hit or cands[0][0]
                check.loss_as = chosen
            value = next((v for name, v in cands if name == chosen), None)
            if value is not None:
                c = StepCheck(
                    step=s,
                    loss=value,
                    logged_loss=row["loss"],
                    loss_ok=_close(value, row["loss"], check.loss_rtol, check.loss_atol),
                )
            else:
                skipped.append(s)
        if "grad_norm" in row and grad_alive:
            g, lg = recs[s].grad_norm, row["grad_norm"]
            ok = _close(g, lg, check.grad_rtol, 0.0)
            if (
                not ok
                and clip
                and math.isfinite(g)
                and g > clip
                and _close(clip, lg, check.grad_rtol, 0.0)
            ):
                ok, check.grad_as = True, "the clipped grad norm"
            c = StepCheck(c.step, c.loss, c.logged_loss, g, lg, c.loss_ok, ok)
        check.checks.append(c)
    notes = []
    if skipped:
        notes.append(
            f"steps {skipped} not checked: their logged loss summarises steps before the window"
        )
    if grads and not grad_alive:
        notes.append("the log's grad norm is 0 on every line (never computed): not checked")
    if not any(c.checked for c in check.checks):
        notes.append("the log has no value for any replayed step")
    check.note = "; ".join(notes)
    return check
