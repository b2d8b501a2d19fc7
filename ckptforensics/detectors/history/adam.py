"""Adam's instability over a run's history: a tensor whose largest per-element step, in units
of the LR (`max_step`), grows for good past a sign-like step (docs/signatures.md#history-adam).

Adam moves an element by lr * m_hat / (sqrt(v_hat) + eps). At a steady gradient the ratio is
about 1 (a sign-like step; bias-corrected Adam's first step is exactly lr * sign(g)), and
with beta1 < sqrt(beta2) no gradient sequence takes it far past that (Cauchy-Schwarz on the
two averages: 1.16 at (0.9, 0.95)). Where an element stops getting gradients, m decays as
beta1^k and sqrt(v) as beta2^(k/2): with beta2 < beta1^2 the ratio grows by beta1 / sqrt(beta2)
every step until sqrt(v) meets eps, so with a tiny eps the element's steps grow without end
(Molybog et al. 2023, arXiv 2304.09871; Kingma & Ba 2015's beta1 < sqrt(beta2) condition).
A logit growth does not do this: the gradients it raises are normalised away by v.

The rule reads the tensor against its own earlier steps, not a fixed size: its steps must
have risen at every checkpoint of a final unbroken climb that multiplied them by `CREEP`, and
end past `SIGN_STEPS` sign-like steps. The onset is the climb's first checkpoint. A geometric
creep is a straight line on the log scale the trend rule (`trend.departure`) reads, so that
rule dates only its bend, which at checkpoints 5 steps apart (4-8% growth a step) is smoother
than its x1.5: the trend's departure is reported beside the onset, not instead of it.
"""

from __future__ import annotations

import math

from ckptforensics.detectors.base import Finding, Thresholds, cap, module_of
from ckptforensics.detectors.history.evidence import HistoryEvidence
from ckptforensics.detectors.history.trend import departure

__all__ = ["CREEP", "SIGN_STEPS", "adam_step_growth"]

# Sign-like steps an element must end past: twice what a steady gradient gives (1), past
# Adam's own bound at beta1 < sqrt(beta2) for the usual beta2 <= 0.95 (1.16 at (0.9, 0.95)).
SIGN_STEPS = 2.0
# The growth of the final climb: two doublings, past what one noisy pair moves a tensor's
# largest step by (the trend rule's x1.5, twice over, is 2.25).
CREEP = 4.0


def _climb(pts: list[tuple[int, float]]) -> int | None:
    """The index of the first point of the final unbroken climb (each point above the one
    before it, to the last); None where the last point does not rise."""
    i = len(pts) - 1
    while i > 0 and pts[i][1] > pts[i - 1][1]:
        i -= 1
    return i + 1 if i + 1 < len(pts) else None


def adam_step_growth(ev: HistoryEvidence, th: Thresholds) -> list[Finding]:
    """Each module whose tensor's largest per-element step (`max_step`, lr units) ends past
    `SIGN_STEPS` after a final unbroken climb that grew it `CREEP`-fold, dated at the climb's
    first checkpoint; earliest onset first, the larger last step breaking ties (one finding
    per module: its tensor that climbed first)."""
    found: dict[str, tuple[int, float, Finding]] = {}
    for t in ev.trajectories:
        if t.metric != "max_step":
            continue
        pts = t.finite()
        if len(pts) < 2 or pts[-1][1] <= SIGN_STEPS:
            continue
        i = _climb(pts)
        if i is None:
            continue
        base_step, base = pts[i - 1]
        last_step, last = pts[-1]
        growth = last / base if base > 0 else math.inf
        if growth < CREEP:
            continue
        onset = pts[i][0]
        dep = departure(t, th.attn_growth)
        mod = module_of(t.module)
        how = f"rose at every checkpoint from step {onset} (x{growth:.3g} from {base:.3g} lr at step {base_step})"
        f = Finding(
            "",
            "adam_step_growth",
            mod,
            cap(last / SIGN_STEPS),
            "warning",
            {
                "onset_step": onset,
                "onset_rule": how,
                "tensor": t.module,
                "steps": [s for s, _ in pts],
                "max_step": [v for _, v in pts],
                "growth": growth,
                "limit": SIGN_STEPS,
                "creep": CREEP,
                "departure_step": dep.step if dep is not None else None,
            },
            f"{t.module}: its largest element's step grew to {last:.3g}x the LR per step by step {last_step}, "
            f"past {SIGN_STEPS:g} sign-like Adam steps; it {how}"
            + (f", off its trend since step {dep.step}" if dep is not None else "")
            + ": Adam's second moment decays faster than its first where the gradient stops "
            "(beta2 < beta1^2) and eps is too small to hold it",
            "docs/signatures.md#history-adam (Molybog 2304.09871; Kingma & Ba 1412.6980)",
            ("adam_instability",),
            primary=True,
        )
        key = (onset, -last)
        if mod not in found or key < found[mod][:2]:
            found[mod] = (onset, -last, f)
    return [f for *_, f in sorted(found.values(), key=lambda x: (x[0], x[1]))]
