"""The `Family` record: everything the tool knows about one optimizer family, as the functions
and facts its module (`optim/<family>.py`) gives, read by the registry (`optim.registry`),
the diff and the replay instead of branching on the family's name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ckptforensics.optim.hyper import GroupHyper
from ckptforensics.optim.rebuild import construct, float_state
from ckptforensics.optim.updates import StepBound

__all__ = ["Family", "Marks"]

# Group options that name a family outright, each set with the implementation it names.
Marks = tuple[tuple[frozenset[str], str], ...]


def _never(*_: Any) -> Any:
    return None


def _no(_: dict[str, Any]) -> bool:
    return False


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One optimizer family: how its saved state is recognised, which group options it keeps,
    how far one step can move a weight (the diff), and its framework's own class and state
    (the replay).

    Attributes:
        name: the family's name, as `GroupHyper.family` and the reports say it ('adam').
        title: how messages name it ('8-bit Adam').
        marks: group options that name the family outright, each set with the
            implementation it names (checked before any state key, in registry order).
        recognise: (state keys of a group, the group) -> (family, implementation), or None
            where the state is not this family's. A family may claim a state its package
            saves but whose rule it does not know ('unknown:bitsandbytes ...').
        options: the group options its bounds and its replay read (`GroupHyper.options`).
        moments: it keeps Adam's two full-shaped moments (exp_avg, exp_avg_sq), which the
            diff checks element by element (their floor, |m| <= C sqrt(v)).
        second_moments: its second-moment tensors (decay floor) where they are not Adam's
            full-shaped pair (Adafactor's rows, columns and vector variances).
        bound: its per-step bound on a weight, keyword arguments lr, wd, betas, options,
            t_first, t_last (1-based, t_first <= t_last), shape, rms_w -> `StepBound`.
        floor: (betas, options, t_first, t_last) -> the least factor its second moment can
            keep over those steps; None: it keeps no second moment.
        weight_scale: (options) -> its bound reads the weight's RMS (Adafactor's parameter
            scale, LAMB's trust ratio), which the diff then measures.
        own_step_size: (options) -> its step size is its own function of the step
            (transformers' relative-step Adafactor): bounded without a recorded LR.
        update_buffer: the state tensor its step is lr times (SGD's momentum buffer): an
            element's move its buffers at both ends account for is training, not a flip.
        state_rounding: the relative rounding per step a replay of its state may differ by
            whatever the run's precision, relative to the state tensor's RMS as well as to
            each element (Muon: its Newton-Schulz runs in bf16, so a gradient a last bit
            apart moves the weights, and every later gradient, by bf16's roundoff); None:
            the precision's own (`engine.replay.precision.moment_rounding`).
        bnb_state: its state is bitsandbytes' 8-bit layout (`optim.bnb`): the checks read
            the moments dequantised from the codes, widened by their rounding.
        replay_class: (implementation) -> its framework's own optimizer class; None where
            it cannot be rebuilt. Raises ForensicsError where the class needs a package
            that is missing, or a CUDA op.
        replay_args: (GroupHyper, implementation) -> one saved group's constructor
            arguments, in the class's own names.
        replay_optimizer: (class, param groups, GroupHyper of each, where) -> the optimizer
            (Adam: torch's fused AdamW where the run's was).
        replay_state: (saved state of a parameter, the parameter, implementation) -> the
            state as its class keeps it.
        replay_label: (implementation) -> the rebuilt class as `replay.config` names it.
        sharded_replay: a torchrun replay rebuilds it, its moments sharded like their
            parameter (Adam's only).
    """

    name: str
    title: str
    marks: Marks = ()
    recognise: Callable[[set[str], dict[str, Any]], tuple[str, str] | None] = _never
    options: tuple[str, ...] = ()
    moments: bool = False
    second_moments: tuple[str, ...] = ()
    bound: Callable[..., StepBound]
    floor: Callable[[tuple[float, float] | None, dict[str, Any], int, int], float] | None = None
    weight_scale: Callable[[dict[str, Any]], Any] = _no
    own_step_size: Callable[[dict[str, Any]], Any] = _no
    update_buffer: str | None = None
    state_rounding: float | None = None
    bnb_state: bool = False
    replay_class: Callable[[str], Any] = _never
    replay_args: Callable[[GroupHyper, str], dict[str, Any]]
    replay_optimizer: Callable[..., torch.optim.Optimizer] = construct
    replay_state: Callable[[dict[str, Any], torch.Tensor, str], dict[str, Any]] = float_state
    replay_label: Callable[[str], str]
    sharded_replay: bool = False

    def update_bound(
        self,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] | None,
        options: dict[str, Any],
        t_first: int,
        t_last: int,
        shape: tuple[int, ...],
        rms_w: float = 0.0,
    ) -> StepBound:
        """The per-step bound over optimizer steps t_first..t_last (1-based).

        Args:
            lr: the largest LR the window ran at (NaN for transformers' relative-step Adafactor).
            options: the group's saved options (`GroupHyper.options`).
            shape: the parameter's shape (Muon's LR adjustment, Adafactor's n).
            rms_w: the larger RMS of the weight at the window's ends (`weight_scale`).
        """
        t_first = max(1, int(t_first))
        return self.bound(
            lr=lr, wd=weight_decay or 0.0, betas=betas, options=options, t_first=t_first,
            t_last=max(t_first, int(t_last)), shape=shape, rms_w=rms_w,
        )  # fmt: skip

    def second_moment_floor(
        self, betas: tuple[float, float] | None, options: dict[str, Any], t_first: int, t_last: int
    ) -> float | None:
        """The least factor a second moment can keep over optimizer steps t_first..t_last
        (1.0 for an empty window); None where the family keeps none."""
        t_first = max(1, int(t_first))
        t_last = int(t_last)
        if t_last < t_first:
            return 1.0
        return self.floor(betas, options, t_first, t_last) if self.floor is not None else None
