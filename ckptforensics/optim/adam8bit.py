"""bitsandbytes' 8-bit Adam (Adam8bit, AdamW8bit, their paged variants): recognised by its
quantised `state1` / `state2`, its moments dequantised (`optim.bnb`), Adam's bound where its
state is fp32 and none through the codes, replayed with bitsandbytes' own AdamW8bit."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.optim import bnb
from ckptforensics.optim.adam import adam_bound
from ckptforensics.optim.base import Family
from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import constructor_args, group_values
from ckptforensics.optim.updates import StepBound, ema_floor

__all__ = ["FAMILY"]


def recognise(keys: set[str], group: dict[str, Any]) -> tuple[str, str] | None:
    """bitsandbytes' 2-state optimizers save `alpha` / `t_alpha` / `t_beta3` in every group
    (`Optimizer2State`): Adam(W)8bit with alpha 0, AdEMAMix with its mixing alpha; a
    `unorm_vec` is its LAMB8bit / LARS8bit (update-norm clipping), not Adam's rule: those
    are bitsandbytes' optimizers the tool does not know, named as such."""
    bnb_group = {"t_alpha", "t_beta3"} <= set(group)
    if not (
        {"state1", "qmap1"} <= keys
        or {"state1", "absmax1"} <= keys
        or ({"state1", "state2"} <= keys and bnb_group)
    ):
        return None
    if "state2" in keys and "unorm_vec" not in keys and not group.get("alpha"):
        return "adam8bit", "bitsandbytes"
    return f"unknown:bitsandbytes {','.join(sorted(keys))}", "bitsandbytes"


def _bound(
    *,
    lr: float,
    wd: float,
    betas: tuple[float, float] | None,
    options: dict[str, Any],
    t_first: int,
    t_last: int,
    **_: Any,
) -> StepBound:
    """Tensors under min_8bit_size keep fp32 state and Adam's update exactly: Adam's bound.
    Quantised ones (options' `quantised`, set by the diff and the replay from the state):
    bitsandbytes updates from its dequantised state (`optimizer_update_8bit_blockwise`):
    m = b1 deq(m) + (1 - b1) g, v = b2 deq(v) + (1 - b2) g^2, then re-quantises. The two EMAs
    no longer share one history, so Cauchy-Schwarz does not bound m / sqrt(v): a second
    moment rounded to code 0 under a first moment that is not moves an element by up to
    lr |m| / eps. No per-element bound: located among its own changes."""
    if options.get("quantised"):
        return StepBound(
            "adam8bit",
            math.inf,
            lr * wd,
            None,
            False,
            "8-bit Adam: no per-element bound through the quantised state (bitsandbytes `optimizer_update_8bit_blockwise`)",
        )
    return adam_bound("adam8bit", lr, wd, betas, t_first, t_last)


def _floor(betas: Any, options: dict[str, Any], t_first: int, t_last: int) -> float:
    return ema_floor(betas, t_first, t_last)


def _class(impl: str) -> Any:
    try:
        # Its import warns about an optional 4-bit GEMM kernel on CPUs with AVX512-BF16
        # (nothing the 8-bit optimizer uses): kept out of the user's terminal.
        quiet = logging.getLogger("bitsandbytes")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            import bitsandbytes
        finally:
            quiet.setLevel(level)
    except ImportError:
        raise ForensicsError(
            "replaying 8-bit Adam needs its package: pip install bitsandbytes"
        ) from None
    # Adam8bit and AdamW8bit are one Optimizer2State("adam"): decay applied as w (1 - lr wd).
    return bitsandbytes.optim.AdamW8bit


_KEYS = ("lr", "betas", "eps", "weight_decay")


def _args(h: GroupHyper, impl: str) -> dict[str, Any]:
    return constructor_args(group_values(h, h.eps), _KEYS)


def _state(st: dict[str, Any], p: torch.Tensor, impl: str) -> dict[str, Any]:
    """bitsandbytes' own layout: uint8 codes, maps and scales as saved, an int step."""
    return {
        k: int(float(v))
        if k == "step"
        else v.to(p.device).clone()
        if isinstance(v, torch.Tensor)
        else v
        for k, v in bnb.raw_state(st).items()
    }


FAMILY = Family(
    name="adam8bit",
    title="8-bit Adam",
    recognise=recognise,
    options=("optim_bits", "percentile_clipping", "block_wise"),
    moments=True,
    second_moments=("exp_avg_sq",),
    bound=_bound,
    floor=_floor,
    bnb_state=True,
    replay_class=_class,
    replay_args=_args,
    replay_state=_state,
    replay_label=lambda impl: "bitsandbytes.optim.AdamW8bit",
)
