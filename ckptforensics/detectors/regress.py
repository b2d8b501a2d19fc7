"""A regression's evidence -> findings: where two versions of the code part (or that they do
not), and whether side B leaves the run's logged track where side A keeps to it. Pure: reads
`engine.regress.RegressResult` (duck-typed), returns `Finding`s."""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.detectors.base import Finding

__all__ = ["regress_findings"]

_SOURCE = "docs/signatures.md#regress-parting"


def _size(d: Any) -> str:
    """A difference in words: '9.4e-05 max abs (3.1e-04 of the tensor's scale, 1234 ulps)'."""
    if not math.isfinite(d.max_abs):
        return "non-finite or mis-shaped"
    return f"{d.max_abs:.3g} max abs ({d.max_rel:.3g} of the tensor's scale, {d.max_ulps:.0f} ulps)"


def _g(x: float | None) -> str:
    return "—" if x is None else f"{x:.6g}"


def _parted(r: Any) -> Finding:
    p = r.parting
    noise = r.noise_floor
    if p is None:  # the steps' figures part while every tensor agrees within the noise
        s = next(s for s in r.steps if s.exceeds(noise))
        return Finding(
            "F1", "regress_parted", "run", 1.0, "warning",
            {"direction": "loss", "step": s.step, "loss_a": s.loss_a, "loss_b": s.loss_b,
             "noise_floor": noise, "noise_factor": r.noise_factor},
            f"B's loss or grad norm at step {s.step} parts from A's past A's own noise "
            "while every module's tensors agree within it",
            _SOURCE, ("code_change",), True,
        )  # fmt: skip
    d = p.delta
    score = (
        d.max_rel / (r.noise_factor * noise)
        if noise > 0 and math.isfinite(d.max_rel)
        else max(d.max_ulps, 1.0)
        if math.isfinite(d.max_ulps)
        else 1e6
    )
    bad = d.nonfinite > 0 or not math.isfinite(d.max_abs)
    where = p.module or "the model's own forward"
    noise_words = (
        f"A's own noise up to there is {noise:.3g} relative"
        if noise > 0
        else "A repeats itself bit for bit"
    )
    return Finding(
        "F1", "regress_parted", where, float(score), "critical" if bad else "warning",
        {"direction": p.direction, "tensor": p.key, "where": p.where, "max_abs": d.max_abs,
         "max_rel": d.max_rel, "max_ulps": d.max_ulps, "differing": d.differing, "numel": d.numel,
         "nonfinite": d.nonfinite, "noise_max_abs": p.noise.max_abs, "noise_floor": noise,
         "noise_factor": r.noise_factor},
        f"B parts from A in the {p.direction} at {where} ({p.where}): {_size(d)}; {noise_words}",
        _SOURCE, ("code_change",), True,
    )  # fmt: skip


def _track(r: Any) -> list[Finding]:
    """B off the run's logged track where A keeps to it (a regression the run's own figures
    show), or A itself off the log (the reference is not the run's code: said, no cause)."""
    miss_a, miss_b = r.check_a.first_miss, r.check_b.first_miss
    if miss_a is not None:
        return [
            Finding(
                "F0", "regress_reference_off_log", "run", 1.0, "info",
                {"step": miss_a.step, "loss": miss_a.loss, "logged_loss": miss_a.logged_loss},
                f"side A misses the run's log at step {miss_a.step}: the reference is not the code "
                "the run trained with (the comparison of A and B stands)",
                "docs/signatures.md#replay-vs-log", (),
            )
        ]  # fmt: skip
    if miss_b is None or not r.check_b.first_checked:
        return []
    return [
        Finding(
            "F0", "regress_off_track", "run", 1.0, "warning",
            {"step": miss_b.step, "loss_b": miss_b.loss, "logged_loss": miss_b.logged_loss},
            f"side B leaves the run's logged track at step {miss_b.step} (loss {_g(miss_b.loss)}, "
            f"logged {_g(miss_b.logged_loss)}; grad norm {_g(miss_b.grad_norm)}, logged "
            f"{_g(miss_b.logged_grad_norm)}) where side A keeps to it",
            "docs/signatures.md#replay-vs-log", ("code_change",),
        )
    ]  # fmt: skip


def regress_findings(r: Any) -> list[Finding]:
    """The regression's findings (ids numbered by the command): where B parts from A, or
    that it does not (info), and each side against the run's log."""
    if r.status == "parted":
        head = _parted(r)
    else:
        same = r.status == "identical"
        head = Finding(
            "F1", f"regress_{r.status}", "run", 1.0, "info",
            {"noise_floor": r.noise_floor, "noise_factor": r.noise_factor,
             "tensors": len(r.modules) + len(r.params)},
            "B is bitwise identical to A on every tensor of the pass and after the steps"
            if same
            else f"B differs from A only within A's own run-to-run noise ({r.noise_floor:.3g} relative, "
            f"x{r.noise_factor:g})",
            _SOURCE, (),
        )  # fmt: skip
    return [head, *_track(r)]
