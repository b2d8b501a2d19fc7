"""The optimizer families, each told apart by what its own code saves, and each param
group's options read as a `GroupHyper`; several optimizers' state_dicts merged into one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.optim.hyper import GroupHyper

# The optimizer families the tool knows, each told apart by what its own code saves: the
# state keys it creates per parameter and the options it puts in every param group.
FAMILIES = ("adam", "lamb", "lion", "adafactor", "muon", "sgd", "adam8bit")

# Group options that name a family outright (each the optimizer's own constructor argument).
_GROUP_MARKS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("muon", frozenset({"ns_coefficients", "ns_steps"}), "torch.optim.Muon"),
    ("adafactor", frozenset({"beta2_decay", "d"}), "torch.optim.Adafactor"),
    (
        "adafactor",
        frozenset({"clip_threshold", "decay_rate"}),
        "transformers.optimization.Adafactor",
    ),
    ("lamb", frozenset({"max_coeff", "min_coeff"}), "deepspeed.ops.lamb.FusedLamb"),
    (
        "lamb",
        frozenset({"weight_decouple", "rectify", "adam", "max_grad_norm"}),
        "pytorch_optimizer.Lamb",
    ),
    ("lamb", frozenset({"grad_averaging", "max_grad_norm"}), "apex.optimizers.FusedLAMB"),
    ("sgd", frozenset({"dampening"}), "torch.optim.SGD"),
)


def optimizer_family(keys: set[str], group: dict[str, Any] | None = None) -> tuple[str, str]:
    """(family, implementation) of one param group from its options and its state's keys.

    Group options decide first (Adafactor with `beta1` saves `exp_avg` and `exp_avg_sq` for
    vectors, as Adam does; LAMB saves Adam's moments); then the state's keys: bitsandbytes'
    quantised `state1`/`state2`, Adam's `exp_avg` + `exp_avg_sq`, Lion's lone `exp_avg`
    (lion-pytorch), Adafactor's factored rows/columns, a momentum buffer (SGD).
    'none' for a group without state or options that say; 'unknown:<keys>' otherwise.
    bitsandbytes' 2-state optimizers save `alpha` / `t_alpha` / `t_beta3` in every group
    (`Optimizer2State`): Adam(W)8bit with alpha 0, AdEMAMix with its mixing alpha; a
    `unorm_vec` is its LAMB8bit / LARS8bit (update-norm clipping), not Adam's rule.
    """
    g = set(group or ())
    for fam, marks, impl in _GROUP_MARKS:
        if marks <= g:
            return fam, impl
    bnb_group = {"t_alpha", "t_beta3"} <= g
    if (
        {"state1", "qmap1"} <= keys
        or {"state1", "absmax1"} <= keys
        or ({"state1", "state2"} <= keys and bnb_group)
    ):
        adam_rule = "state2" in keys and "unorm_vec" not in keys and not (group or {}).get("alpha")
        return (
            ("adam8bit", "bitsandbytes")
            if adam_rule
            else (f"unknown:bitsandbytes {','.join(sorted(keys))}", "bitsandbytes")
        )
    if {"exp_avg", "exp_avg_sq"} <= keys:
        # torch's Adam and AdamW save `amsgrad` in every group; apex's FusedAdam and
        # DeepSpeed's (CPU)Adam save `bias_correction` instead, with the same moments.
        return (
            "adam",
            "torch.optim.Adam(W)"
            if "amsgrad" in g
            else "apex/DeepSpeed Adam"
            if "bias_correction" in g
            else "Adam",
        )
    if keys & {"row_var", "col_var", "variance"}:
        return "adafactor", "torch.optim.Adafactor"
    if keys & {"exp_avg_sq_row", "exp_avg_sq_col"}:
        return "adafactor", "transformers.optimization.Adafactor"
    if keys == {"exp_avg"} and "betas" in g:
        return "lion", "lion-pytorch"
    if "momentum_buffer" in keys:
        return "sgd", "torch.optim.SGD"
    if not keys:
        return ("adam", "Adam") if "betas" in g and "amsgrad" in g else ("none", "")
    return f"unknown:{','.join(sorted(keys))}", ""


def optimizer_kind(
    state: dict[Any, dict[str, Any]], groups: list[dict[str, Any]] | None = None
) -> str:
    """The families of a state_dict's groups joined by '+' in group order ('adam',
    'muon+adam'); groups without state take the family their options name, or none."""
    keys: set[str] = set()
    for s in state.values():
        keys.update(s)
    if not groups:
        return optimizer_family(keys)[0]
    fams = [group_family(g, state)[0] for g in groups]
    known = [f for f in fams if f != "none"]
    return "+".join(dict.fromkeys(known)) if known else "none"


def group_family(group: dict[str, Any], state: dict[Any, dict[str, Any]]) -> tuple[str, str]:
    keys: set[str] = set()
    for pid in group.get("params", ()):
        keys.update(state.get(pid) or ())
    if not keys and not any(m <= set(group) for _, m, _ in _GROUP_MARKS):
        # A group without state yet (no step taken): the family of the state saved elsewhere.
        for s in state.values():
            keys.update(s)
    return optimizer_family(keys, group)


# Options each family saves in its groups that its bounds and its replay read.
_OPTIONS = (
    "beta2_decay",
    "d",
    "clip_threshold",
    "decay_rate",
    "relative_step",
    "scale_parameter",
    "warmup_init",
    "beta1",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "ns_steps",
    "adjust_lr_fn",
    "dampening",
    "max_coeff",
    "min_coeff",
    "bias_correction",
    "max_grad_norm",
    "grad_averaging",
    "amsgrad",
    "maximize",
    "decoupled_weight_decay",
    "foreach",
    "optim_bits",
    "percentile_clipping",
    "block_wise",
    "weight_decouple",
    "fixed_decay",
    "rectify",
    "adam",
    "adam_w_mode",
    "use_nvlamb",
    "step",
)


def group_hyper(
    group: dict[str, Any], index: int, family: tuple[str, str] | None = None
) -> GroupHyper:
    """One saved param group as a GroupHyper, whatever its family.

    Adafactor's `eps` is a pair (eps1 for the second moment, eps2 the floor of the
    parameter scale): eps1 becomes `eps` (NaN where torch leaves it None: the dtype's
    machine epsilon) and eps2 an option. transformers' Adafactor with `relative_step`
    saves `lr=None`: NaN here, its step size is a function of the step (`tensors`).
    """
    betas = group.get("betas")
    eps = group.get("eps", 1e-8)
    opts = {k: _plain(group[k]) for k in _OPTIONS if k in group}
    if isinstance(eps, (tuple, list)):
        opts["eps2"] = _opt_num(eps[1]) if len(eps) > 1 else None
        eps = eps[0]
    fam, impl = family or optimizer_family(set(), group)
    if family is None and fam == "none" and betas is not None:
        fam = "adam"  # readers that map state themselves (DCP, DeepSpeed, Megatron) hold Adam's
    opts["implementation"] = impl
    return GroupHyper(
        lr=_opt_num(group.get("lr", 0.0), math.nan),
        betas=(float(_num(betas[0])), float(_num(betas[1])))
        if isinstance(betas, (tuple, list)) and len(betas) == 2 and all(is_number(b) for b in betas)
        else None,
        eps=_opt_num(eps, math.nan),
        weight_decay=_opt_num(group.get("weight_decay", 0.0), 0.0),
        initial_lr=float(_num(group["initial_lr"])) if is_number(group.get("initial_lr")) else None,
        max_lr=float(_num(group["max_lr"])) if is_number(group.get("max_lr")) else None,
        index=index,
        fused=bool(group["fused"]) if isinstance(group.get("fused"), bool) else None,
        family=fam,
        options=opts,
        optimizer=int(group.get(_OPTIMIZER_KEY, 0)),
    )


def _num(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _opt_num(x: Any, default: float = math.nan) -> float:
    """A number that may be None (torch Adafactor's eps1, HF Adafactor's relative-step lr)."""
    if x is None or isinstance(x, bool):
        return default
    try:
        return _num(x)
    except (TypeError, ValueError):
        return default


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else None
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool)) or x is None else repr(x)


# Marks the optimizer a group came from when several are merged (`merge_optimizers`).
_OPTIMIZER_KEY = "__ckptforensics_optimizer__"


def merge_optimizers(osds: Sequence[dict[str, Any]], source: str) -> dict[str, Any]:
    """Several optimizers' state_dicts (a Muon run's Muon + AdamW, Lightning's
    `optimizer_states`) as one: groups in order, ids renumbered past the previous
    optimizer's, each group marked with its optimizer's position."""
    state: dict[Any, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    offset = 0
    for i, osd in enumerate(osds):
        if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
            raise CorruptCheckpoint(
                f"{source}[{i}]: not a torch optimizer state_dict (no 'state'/'param_groups')"
            )
        ids = [pid for g in osd["param_groups"] for pid in g["params"]]
        remap = {pid: offset + j for j, pid in enumerate(ids)}
        for pid, st in osd["state"].items():
            if pid in remap:
                state[remap[pid]] = st
        for g in osd["param_groups"]:
            groups.append({**g, "params": [remap[p] for p in g["params"]], _OPTIMIZER_KEY: i})
        offset += len(ids)
    return {"state": state, "param_groups": groups}


def is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) or (
        isinstance(x, torch.Tensor) and x.numel() == 1
    )
