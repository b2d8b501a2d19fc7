"""Muon (torch.optim.Muon): recognised by its Newton-Schulz options, bounded by the spectral
norm of its orthogonalised update, replayed with torch's own class (a Muon run's AdamW beside
it is the Adam family's)."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import constructor_args, finite_or, group_values
from ckptforensics.optim.updates import StepBound

__all__ = ["FAMILY", "ns_sup"]

# bfloat16's unit roundoff (2^-8): torch's Muon runs Newton-Schulz in bf16, each iteration
# rounding its product once (torch/optim/_muon.py `_zeropower_via_newtonschulz`).
_BF16_U = 2.0**-8


def _bound(
    *, lr: float, wd: float, options: dict[str, Any], shape: tuple[int, ...], **_: Any
) -> StepBound:
    """torch.optim.Muon: w <- w (1 - lr wd) - lr_adj O, O the Newton-Schulz orthogonalisation
    of the momentum. O's singular values are the NS polynomial iterated on values in [0, 1]
    (the input is normalised by its Frobenius norm), so every element |O_ij| <= ||O||_2 <=
    sup p^(n)([0, 1]) (1.2024 for torch's default coefficients, Keller Jordan's), widened by
    bf16's roundoff per iteration."""
    coeffs = tuple(options.get("ns_coefficients") or (3.4445, -4.7750, 2.0315))
    steps = int(options.get("ns_steps") or 5)
    sigma = ns_sup(coeffs, steps) * (1 + steps * _BF16_U)  # type: ignore[arg-type]
    a, b = (shape[0], shape[1]) if len(shape) >= 2 else (1, 1)
    fn = options.get("adjust_lr_fn")
    # torch/optim/_muon.py `_adjust_lr`: 'original' sqrt(max(1, A/B)); 'match_rms_adamw' 0.2 sqrt(max(A, B)).
    adj = 0.2 * math.sqrt(max(a, b)) if fn == "match_rms_adamw" else math.sqrt(max(1.0, a / b))
    return StepBound(
        "muon",
        lr * adj * sigma,
        lr * wd,
        lr * adj * sigma,
        True,
        "Muon: |O_ij| <= ||O||_2 <= sup of the Newton-Schulz polynomial (torch.optim.Muon)",
    )


@lru_cache(maxsize=8)
def ns_sup(coeffs: tuple[float, float, float], steps: int) -> float:
    """sup over x in [0, 1] of the quintic Newton-Schulz map x -> a x + b x^3 + c x^5 applied
    `steps` times: the largest singular value Muon's orthogonalised update can have."""
    a, b, c = coeffs
    x = np.linspace(0.0, 1.0, 200_001)
    y = x.copy()
    for _ in range(steps):
        y = a * y + b * y**3 + c * y**5
    return float(np.abs(y).max())


_KEYS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
)


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    vals = group_values(h, finite_or(h.eps, 1e-7))
    if isinstance(vals.get("ns_coefficients"), list):
        vals["ns_coefficients"] = tuple(vals["ns_coefficients"])
    return constructor_args(vals, _KEYS)


FAMILY = Family(
    name="muon",
    title="Muon",
    marks=((frozenset({"ns_coefficients", "ns_steps"}), "torch.optim.Muon"),),
    options=("momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn"),
    bound=_bound,
    # torch/optim/_muon.py `_zeropower_via_newtonschulz` casts the update to bf16: a replay
    # whose gradients differ from the run's in a last bit (another summation order) rounds
    # some of O's elements the other way, so its momentum buffers drift from the run's by
    # bf16's roundoff per step, relative to the buffer's size (its RMS), as a bf16 run's
    # gradients do (measured on fixtures/own_loop_layouts.py's Muon run: gradients changed by
    # 1e-7 to 1e-5 relative over 10 steps move the buffers by up to half this tolerance,
    # and by 14x the fp32 one).
    state_rounding=_BF16_U,
    replay_class=lambda impl: torch.optim.Muon,
    replay_args=_args,
    replay_label=lambda impl: "torch.optim.Muon",
)
