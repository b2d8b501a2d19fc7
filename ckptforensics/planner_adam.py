"""The plan's Adam changes in the run's own terms: the betas and epsilon its optimizer saved
(`adam_run`), the beta2 at which Adam's steps stay bounded and the epsilon raised from the
run's (`AdamRun`), and why, in the run's figures (`adam_change`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ckptforensics.detectors.history.adam import SIGN_STEPS
from ckptforensics.formats.base import Checkpoint
from ckptforensics.optim import FAMILIES, GroupHyper
from ckptforensics.trainers import Edit

__all__ = ["BETA2", "EPS", "OPTIMIZER_KEY", "AdamRun", "adam_change", "adam_run"]

# Adam's beta2 values a plan proposes, least change first (GPT-3, Llama and OLMo train at 0.95).
BETA2 = (0.95, 0.98, 0.99, 0.999)
# Where the run records no epsilon: Molybog et al. 2023 (2304.09871), 1e-8 -> 1e-6.
EPS = 1e-6


@dataclass(frozen=True, slots=True)
class AdamRun:
    """The run's own Adam settings, read from the *before* checkpoint's optimizer groups: the
    group of the tensor the verdict names (else the first Adam group that keeps betas).

    Attributes:
        betas: (beta1, beta2) as saved.
        eps: the group's epsilon as saved (NaN: not recorded).
        tensor: the tensor whose group it is (None: the first Adam group's).
    """

    betas: tuple[float, float]
    eps: float
    tensor: str | None

    @property
    def safe_beta2(self) -> float | None:
        """The first of `BETA2` at which Adam's steady-state bound on |m_hat| / sqrt(v_hat),
        (1 - beta1) / sqrt((1 - beta2)(1 - beta1^2 / beta2)), stays within `SIGN_STEPS`; None
        where the run's own beta2 is already at least beta1^2 (nothing to raise)."""
        b1, b2 = self.betas
        if b2 >= b1 * b1:
            return None
        for cand in BETA2:
            r = b1 * b1 / cand
            if r < 1 and (1 - b1) / math.sqrt((1 - cand) * (1 - r)) <= SIGN_STEPS:
                return max(cand, b2)
        return BETA2[-1]

    @property
    def raised_eps(self) -> float:
        """The run's epsilon raised: 1e-6, or ten times the run's where that is larger."""
        return max(EPS, 10 * self.eps) if math.isfinite(self.eps) else EPS


def adam_run(doc: dict[str, Any], ck: Checkpoint) -> AdamRun | None:
    """The run's Adam settings (`AdamRun`) from `ck`'s optimizer groups; None without an
    Adam-family group that saved its betas."""
    opt = ck.optimizer
    if opt is None:
        return None
    v = doc["verdict"]
    cause = v["causes"][0]["cause"] if v["causes"] else "none"
    named = [
        str(f.get("metrics", {}).get("tensor") or f.get("subject") or "")
        for f in doc.get("findings") or []
        if cause in (f.get("supports") or ())
    ]

    def adam(h: GroupHyper | None) -> bool:
        fam = FAMILIES.get(h.family) if h is not None else None
        return h is not None and h.betas is not None and fam is not None and fam.moments

    tensor = next((t for t in named if adam(opt.hyper.get(t))), None)
    h = opt.hyper[tensor] if tensor is not None else next((g for g in opt.groups if adam(g)), None)
    if h is None or h.betas is None:
        return None
    return AdamRun(h.betas, h.eps, tensor)


# The key of an edit the planner makes itself where the trainer names none (Adam's betas are
# set where the optimizer is built): listed with its change, not rendered as a config key.
OPTIMIZER_KEY = "optimizer:"


def adam_change(
    knob: str, value: Any, adam: AdamRun, why: str, edits: tuple[Edit, ...]
) -> tuple[str, tuple[Edit, ...]]:
    """An Adam change in the run's own terms: why, from the run's saved betas and epsilon, and
    the edit of the saved groups where the trainer has no key for it."""
    b1, b2 = adam.betas
    where = f" ({adam.tensor}'s group)" if adam.tensor else ""
    if knob == "beta2":
        why = (
            f"the run's betas ({b1:g}, {b2:g}){where}: beta2 below beta1^2 = {b1 * b1:.3g} lets a row's steps grow "
            f"x{b1 / math.sqrt(b2):.3g} a step where its gradient stops, without bound; at beta2 {value:g} Adam's "
            f"steps stay within {SIGN_STEPS:g} sign-like steps"
        )
        if not edits:
            edits = (
                Edit(
                    f"{OPTIMIZER_KEY} betas",
                    [b1, b2],
                    [b1, float(value)],
                    "set where the optimizer is built (torch.optim.AdamW(..., betas=...)); the trainer's config has no key for it here",
                ),
            )
    elif math.isfinite(adam.eps):
        why = f"{why} (the run's eps {adam.eps:g}{where})"
    return why, edits
