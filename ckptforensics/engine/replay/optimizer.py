"""The run's optimizer rebuilt from the checkpoint's state and hyper-parameters, in its own
family's torch class (`optim.families`), over the model `model.load_weights` filled: one
name map for weights and moments, each rank's shard where the model is sharded."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ckptforensics.core.errors import ForensicsError, IncompatibleCheckpoints
from ckptforensics.engine.replay.distributed import local_rows
from ckptforensics.formats.base import Checkpoint
from ckptforensics.optim import bnb

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


def _family_class(family: str, impl: str) -> Any:
    """The framework's own optimizer class for a family (never a re-implementation)."""
    if family == "adam":
        return torch.optim.AdamW
    if family == "adafactor" and impl.startswith("transformers"):
        try:
            from transformers.optimization import Adafactor
        except ImportError:
            raise ForensicsError(
                "replaying transformers' Adafactor needs transformers (pip install 'ckptforensics[hf]')"
            ) from None
        return Adafactor
    if family == "adafactor":
        return torch.optim.Adafactor
    if family == "lion":
        try:
            from lion_pytorch import Lion
        except ImportError:
            raise ForensicsError(
                "replaying Lion needs its package: pip install lion-pytorch"
            ) from None
        return Lion
    if family == "muon":
        return torch.optim.Muon
    if family == "sgd":
        return torch.optim.SGD
    if family == "adam8bit":
        try:
            # Its import warns about an optional 4-bit GEMM kernel on CPUs with AVX512-BF16
            # (nothing the 8-bit optimizer uses): kept out of the user's terminal.
            quiet = logging.getLogger("bitsandbytes")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                import bitsandbytes as bnb
            finally:
                quiet.setLevel(level)
        except ImportError:
            raise ForensicsError(
                "replaying 8-bit Adam needs its package: pip install bitsandbytes"
            ) from None
        # Adam8bit and AdamW8bit are one Optimizer2State("adam"): decay applied as w (1 - lr wd).
        return bnb.optim.AdamW8bit
    if family == "lamb" and impl.startswith("pytorch_optimizer"):
        try:
            from pytorch_optimizer import Lamb
        except ImportError:
            raise ForensicsError(
                "replaying pytorch_optimizer's Lamb needs its package: pip install pytorch_optimizer"
            ) from None
        return Lamb
    if family == "lamb" and impl:
        raise ForensicsError(
            f"replaying {impl} needs its CUDA op (a fused kernel; no CPU build): the replay rebuilds pytorch_optimizer's Lamb "
            "only; `ckptforensics diff` still checks its LAMB bounds"
        )
    return None


# The constructor arguments each class takes from a saved group (its own names).
_CLASS_KEYS = {
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adafactor-torch": ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize"),
    "adafactor-transformers": (
        "lr",
        "eps",
        "clip_threshold",
        "decay_rate",
        "beta1",
        "weight_decay",
        "scale_parameter",
        "relative_step",
        "warmup_init",
    ),
    "lion": ("lr", "betas", "weight_decay"),
    "muon": (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    ),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adam8bit": ("lr", "betas", "eps", "weight_decay"),
    # pytorch_optimizer's Lamb; `pre_norm` is an attribute, not saved: its default (False).
    "lamb": (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "weight_decouple",
        "fixed_decay",
        "rectify",
        "grad_averaging",
        "max_grad_norm",
        "adam",
    ),
}


def _group_args(h: Any, key: str) -> dict[str, Any]:
    """A saved group's hyper-parameters as its class's constructor takes them."""
    o = h.options
    vals: dict[str, Any] = {
        "lr": h.lr,
        "betas": h.betas,
        "weight_decay": h.weight_decay,
        **{k: v for k, v in o.items() if k != "implementation"},
    }
    if key.startswith("adafactor"):
        eps1 = None if not math.isfinite(h.eps) else h.eps
        vals["eps"] = (eps1, o.get("eps2", 1e-3))
        if o.get("relative_step"):
            vals["lr"] = None  # transformers' relative step: its own schedule
    elif key == "muon":
        vals["eps"] = h.eps if math.isfinite(h.eps) else 1e-7
        if isinstance(vals.get("ns_coefficients"), list):
            vals["ns_coefficients"] = tuple(vals["ns_coefficients"])
    else:
        vals["eps"] = h.eps
    # transformers' Adafactor takes lr=None (relative step); every other None means "the
    # class's default".
    keep_none = ("lr",) if key == "adafactor-transformers" else ()
    return {
        k: vals[k]
        for k in _CLASS_KEYS[key]
        if k in vals and (vals[k] is not None or k in keep_none)
    }


def build_optimizer(
    model: nn.Module, ckpt: Checkpoint, to_ckpt: Callable[[str], str], ranks: Any = None
) -> torch.optim.Optimizer:
    """The run's optimizer rebuilt with its framework's own class, its param groups,
    hyper-parameters and state (with `ranks`, Adam's moments as the DTensor shard of their
    parameter: only those rows read).

    Families: Adam/AdamW (torch's; fused where the run's was), torch's and transformers'
    Adafactor, lion-pytorch's Lion, torch's Muon (with the AdamW of the same run: an
    `OptimizerChain`), torch's SGD. Every group is tagged with its `family`, which the
    replay's comparison reads for the family's update bound (`updates.replay_bound`).

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
            if h.family != "none"
            and _family_class(h.family, str(h.options.get("implementation", ""))) is None
        }
    )
    if unknown:
        what = unknown[0].removeprefix("unknown:")
        raise ForensicsError(
            f"{ckpt.path}: optimizer {what!r} cannot be rebuilt for a replay (replay rebuilds Adam/AdamW, Adafactor, Lion, "
            "Muon, SGD, bitsandbytes' 8-bit Adam and pytorch_optimizer's LAMB with their own classes); "
            "`ckptforensics diff` still compares the weights"
        )
    if ranks is not None and fams - {"adam", "none"}:
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
        fam = h0.family if h0.family != "none" else "adam"
        impl = str(h0.options.get("implementation", ""))
        key = (
            "adafactor-transformers"
            if fam == "adafactor" and impl.startswith("transformers")
            else "adafactor-torch"
            if fam == "adafactor"
            else fam
        )
        cls = _family_class(fam, impl)
        param_groups = [
            {
                "params": [p for _, p in groups[gi]],
                **_group_args(opt.groups[gi], key),
                "family": fam,
                "implementation": impl,
            }
            for gi in mine
        ]
        if fam == "adam":
            # The saved implementation: HF Trainer's default is fused AdamW, whose rounding differs.
            fused = all(opt.groups[gi].fused for gi in mine)
            o = (
                torch.optim.AdamW(param_groups, fused=True)
                if fused
                else torch.optim.AdamW(param_groups)
            )
        else:
            try:
                o = cls(param_groups)
            except (TypeError, ValueError) as e:
                raise ForensicsError(
                    f"{ckpt.path}: cannot rebuild {cls.__name__} from the saved param groups ({e})"
                ) from None
            for g, gi in zip(o.param_groups, mine, strict=True):
                step = opt.groups[gi].options.get("step")
                if fam == "lamb" and isinstance(step, (int, float)):
                    g["step"] = int(
                        step
                    )  # pytorch_optimizer counts steps in the group (its bias correction)
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
                o.state[p] = _state_for(fam, key, st, p)
        built.append(o)
    return built[0] if len(built) == 1 else OptimizerChain(built)


def _state_for(fam: str, key: str, st: dict[str, Any], p: nn.Parameter) -> dict[str, Any]:
    """One parameter's saved state as its class keeps it: tensors in fp32 on the parameter's
    device (moments saved in bf16 widened), Adam's and torch Adafactor's `step` a float
    tensor, transformers' Adafactor's `step` a Python int."""
    out: dict[str, Any] = {}
    if fam == "adam8bit":
        # bitsandbytes' own layout: uint8 codes, maps and scales as saved, an int step.

        return {
            k: int(float(v))
            if k == "step"
            else v.to(p.device).clone()
            if isinstance(v, torch.Tensor)
            else v
            for k, v in bnb.raw_state(st).items()
        }
    for k, v in st.items():
        if k == "step":
            out[k] = int(float(v)) if key == "adafactor-transformers" else torch.tensor(float(v))
        elif isinstance(v, torch.Tensor):
            t = v.to(p.device, torch.float32).clone()
            out[k] = (
                t.view_as(p)
                if t.numel() == p.numel()
                and k in ("exp_avg", "exp_avg_sq", "momentum_buffer", "variance")
                else t
            )
        else:
            out[k] = v
    return out


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
