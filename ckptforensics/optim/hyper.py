"""One optimizer param group's hyper-parameters as saved (`GroupHyper`): what every family's
reader fills and every consumer of a group's settings reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GroupHyper"]


@dataclass(frozen=True, slots=True)
class GroupHyper:
    """Hyper-parameters of one optimizer param group.

    Attributes:
        lr: learning rate stored in the group (the one the *next* step will use).
        betas: Adam (beta1, beta2); None for optimizers without moments.
        eps: Adam epsilon.
        weight_decay: decoupled (AdamW) or L2 weight decay coefficient.
        initial_lr: the schedule's base LR when a scheduler recorded it.
        max_lr: OneCycle-style peak LR when recorded.
        index: the group's position in `param_groups`.
        fused: the group's `fused` flag as saved (torch's fused AdamW rounds differently
            from the foreach one; a replay that must land on *after* uses the same).
        family: the optimizer family that owns the group, read from its state layout and
            its group's own keys ('adam', 'lamb', 'lion', 'adafactor', 'muon', 'sgd',
            'adam8bit'; see `optim.registry`).
        options: the family's other settings as saved, plain values (Adafactor's `eps2`,
            `d` / `clip_threshold`, `beta2_decay` / `decay_rate`, `relative_step`; Muon's
            `momentum`, `nesterov`, `ns_coefficients`, `ns_steps`, `adjust_lr_fn`; LAMB's
            `max_coeff`; SGD's `momentum`, `dampening`, `nesterov`; `implementation`).
        optimizer: which optimizer of the checkpoint holds the group (Muon runs save two).
    """

    lr: float
    betas: tuple[float, float] | None = None
    eps: float = 1e-8
    weight_decay: float = 0.0
    initial_lr: float | None = None
    max_lr: float | None = None
    index: int = 0
    fused: bool | None = None
    family: str = "adam"
    options: dict[str, Any] = field(default_factory=dict)
    optimizer: int = 0
