"""The run's optimizer rebuilt from the checkpoint's state and hyper-parameters, in its own
family's torch class (`optim.<family>`'s `replay_class`), over the model `model.load_weights` filled: one
name map for weights and moments, each rank's shard where the model is sharded."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptforensics import optim
from ckptforensics.core.errors import ForensicsError, IncompatibleCheckpoints
from ckptforensics.engine.replay.distributed import local_rows
from ckptforensics.formats.base import Checkpoint
from ckptforensics.optim.hyper import GroupHyper

__all__ = ["OptimizerChain", "build_optimizer"]

log = logging.getLogger(__name__)


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers stepped as one (a Muon run's Muon for the hidden matrices and AdamW
    for the rest): their param groups in order, their states as one mapping. Everything the
    replay does to an optimizer (set each group's LR, zero, step, unscale under a
    GradScaler) goes through here to each of them."""

    def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
        # No Optimizer.__init__: the parts own the groups and the state.
        self.opts = opts
        self.defaults = {}
        self._optimizer_step_pre_hooks = {}  # type: ignore[assignment]
        self._optimizer_step_post_hooks = {}  # type: ignore[assignment]

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for o in self.opts for g in o.param_groups]

    @property
    def state(self) -> Any:  # type: ignore[override]
        from collections import ChainMap

        return ChainMap(*[o.state for o in self.opts])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for o in self.opts:
            o.step()
        return None


def build_optimizer(
    model: nn.Module, ckpt: Checkpoint, to_ckpt: Callable[[str], str], ranks: Any = None
) -> torch.optim.Optimizer:
    """The run's optimizer rebuilt with its framework's own class, its param groups,
    hyper-parameters and state (with `ranks`, Adam's moments as the DTensor shard of their
    parameter: only those rows read).

    Families: Adam/AdamW (torch's; fused where the run's was), torch's and transformers'
    Adafactor, lion-pytorch's Lion, torch's Muon (with the AdamW of the same run: an
    `OptimizerChain`), torch's SGD. Every group is tagged with its `family`, which the
    replay's comparison reads for the family's update bound (`optim.replay_bound`).

    Raises:
        ForensicsError: no optimizer state, or one whose family the replay cannot rebuild.
    """
    opt = ckpt.optimizer
    if opt is None:
        raise ForensicsError(
            f"{ckpt.path}: no optimizer state; replay needs the moments to reproduce the update"
        )
    fams = {h.family for h in opt.groups}
    unknown = sorted(
        {
            h.family
            for h in opt.groups
            if h.family != "none" and not _rebuildable(h.family, _impl(h))
        }
    )
    if unknown:
        what = unknown[0].removeprefix("unknown:")
        raise ForensicsError(
            f"{ckpt.path}: optimizer {what!r} cannot be rebuilt for a replay (replay rebuilds Adam/AdamW, Adafactor, Lion, "
            "Muon, SGD, bitsandbytes' 8-bit Adam and pytorch_optimizer's LAMB with their own classes); "
            "`ckptforensics diff` still compares the weights"
        )
    if ranks is not None and any(f != "none" and not optim.family(f).sharded_replay for f in fams):
        raise ForensicsError(
            f"{ckpt.path}: a torchrun replay rebuilds Adam(W) only; run this {'+'.join(sorted(fams))} replay in one process"
        )
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in opt.groups]
    for key, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = ckpt.aliases.get(to_ckpt(key), to_ckpt(key))
        h = opt.hyper.get(name)
        if h is None:
            raise IncompatibleCheckpoints(
                f"{ckpt.path}: parameter {name} is in no optimizer param group"
            )
        groups[h.index].append((name, p))
    # One optimizer per saved optimizer (groups keep their order within it).
    built: list[torch.optim.Optimizer] = []
    for oi in sorted({h.optimizer for h in opt.groups}):
        mine = [gi for gi, h in enumerate(opt.groups) if h.optimizer == oi and groups[gi]]
        if not mine:
            continue
        h0 = opt.groups[mine[0]]
        fam = optim.DEFAULT if h0.family == "none" else optim.family(h0.family)
        impl = _impl(h0)
        cls = fam.replay_class(impl)
        param_groups = [
            {
                "params": [p for _, p in groups[gi]],
                **fam.replay_args(opt.groups[gi], impl),
                "family": fam.name,
                "implementation": impl,
            }
            for gi in mine
        ]
        o = fam.replay_optimizer(cls, param_groups, [opt.groups[gi] for gi in mine], str(ckpt.path))
        for gi in mine:
            for name, p in groups[gi]:
                st = opt.state.get(name)
                if not st:
                    continue
                if ranks is not None and hasattr(p, "to_local"):
                    o.state[p] = {
                        "step": torch.tensor(float(st["step"])),
                        **{
                            k: _shard_moment(p, ckpt, name, k, ranks)
                            for k in ("exp_avg", "exp_avg_sq")
                        },
                    }
                    ckpt.forget(name)
                    continue
                o.state[p] = fam.replay_state(st, p, impl)
        built.append(o)
    return built[0] if len(built) == 1 else OptimizerChain(built)


def _impl(h: GroupHyper) -> str:
    return str(h.options.get("implementation", ""))


def _rebuildable(family: str, impl: str) -> bool:
    """The family is one the tool knows and its class can be had (raises where it needs a
    package that is missing, or a CUDA op)."""
    f = optim.find(family)
    return f is not None and f.replay_class(impl) is not None


def _shard_moment(p: Any, ckpt: Checkpoint, name: str, field: str, ranks: Any) -> Any:
    """A moment of `name` as a DTensor sharded like its parameter `p`."""
    from torch.distributed.tensor import DTensor

    st = ckpt.optim_state(name)
    stored = tuple(ckpt.meta(name).shape) if ckpt.has(name) else ()
    local = local_rows(
        ranks, p, stored, lambda lo, hi: ckpt.state_rows(name, field, lo, hi), lambda: st[field]
    )
    local = local.to(p.device, torch.float32).reshape(p.to_local().shape)
    return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
