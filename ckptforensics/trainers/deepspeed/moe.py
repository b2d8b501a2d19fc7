"""DeepSpeed-MoE: the experts' own files beside the dense model states.

`DeepSpeedEngine._save_moe_checkpoint` (deepspeed 0.19.8) writes, for the `n`-th `MoE`
module in `named_modules()` order (L = n) and each of its global experts E,
`layer_{L}_expert_{E}_mp_rank_{MP:02d}_model_states.pt` (`_get_expert_ckpt_name`): a plain
state dict of that expert's tensors under their full module names
(`...deepspeed_moe.experts.deepspeed_experts.{E}.<param>`, the local id rewritten to the
global one). Checkpoints of older releases name them `expert_{E}_mp_rank_{MP:02d}_...`
(layer id -1, `load_moe_state_dict(old_moe_load=True)`). `mp_rank_{MP:02d}_model_states.pt`
keeps the rest (`_get_non_moe_state_dict`: every key of an MoE module holding `expert`,
but the gate's `wg.weight`, removed) and `num_experts`, one count per MoE layer.

The optimizer keeps the expert params in groups of their own (`moe: True`, named after
the expert group, `ep_size_{ep}`): under ZeRO-1/2 `param_shapes` names them like every
other param, so the partitions unflatten to them; under ZeRO-0 the model states'
`optimizer` (also saved as `expp_rank_{r}_mp_rank_{MP:02d}_optim_states.pt`) is a torch
state dict in group order, the dense params first, then the experts in layer and expert
order, the order these files are read in.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.statedict import add_state_dict, map_in_order
from ckptforensics.formats.torchfile import load_torch_file

__all__ = [
    "EXPERT_FILE",
    "EXPP_FILE",
    "expert_files",
    "add_experts",
    "attach_stage0",
    "expert_problems",
]

# `_get_expert_ckpt_name`: layer_{L}_expert_{E}_mp_rank_{MP:02d}, or expert_{E}_... (layer -1).
EXPERT_FILE = re.compile(r"^(?:layer_(\d+)_)?expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# `_get_optimizer_ckpt_name`: ZeRO-0's optimizer again, per expert-parallel rank (not read:
# the model states hold the same state dict), checked whole like the others.
EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


# Every expert tensor's name holds it (`_save_moe_checkpoint`'s `moe_str_prefix`).
EXPERT_MARK = ".deepspeed_moe.experts.deepspeed_experts."


def expert_files(tag: Path, mp: int = 0) -> list[tuple[int, int, Path]]:
    """(layer, expert, path) of each expert file of model-parallel rank `mp`, in layer then
    expert order (a legacy `expert_{E}` file has layer -1)."""
    out = []
    for f in tag.iterdir() if tag.is_dir() else ():
        m = EXPERT_FILE.match(f.name)
        if m and int(m.group(3)) == mp:
            out.append((int(m.group(1)) if m.group(1) else -1, int(m.group(2)), f))
    return sorted(out, key=lambda x: (x[0], x[1]))


def add_experts(ckpt: Checkpoint, tag: Path) -> bool:
    """Declare every expert tensor of `tag` under its full name; False when it has no
    expert files. Each file is opened now (memory-mapped: its pickle, no tensor data)."""
    files = expert_files(tag)
    if not files:
        return False
    layers: dict[int, int] = {}
    n = 0
    for layer, _expert, path in files:
        sd, _ = load_torch_file(path)
        if not isinstance(sd, dict) or not all(isinstance(t, torch.Tensor) for t in sd.values()):
            raise CorruptCheckpoint(f"{path}: not a DeepSpeed expert state dict (name -> tensor)")
        clash = next((k for k in sd if ckpt.has(k)), None)
        if clash is not None:
            raise CorruptCheckpoint(
                f"{path}: {clash} is also in the model states or another expert file"
            )
        add_state_dict(ckpt, sd)
        layers[layer] = layers.get(layer, 0) + 1
        n += len(sd)
    ckpt.scalars["moe_experts"] = {str(k): v for k, v in sorted(layers.items())}
    ckpt.notes.append(
        f"DeepSpeed-MoE: {n} expert tensors of {len(layers)} MoE layer(s) "
        f"({', '.join(f'{v} experts' for v in layers.values())}) read from their "
        "layer_*_expert_* files, under their full names"
    )
    return True


def attach_stage0(ckpt: Checkpoint, osd: dict[str, Any], source: str) -> None:
    """ZeRO-0 with experts: the torch state dict's groups hold the dense params in the
    module's order, then the `moe` groups the experts in layer and expert order (DeepSpeed's
    `split_params_into_different_moe_groups_for_optimizer`). The module states keep a tied
    weight's copy (`lm_head.weight` beside `wte.weight`) that named_parameters() yields once:
    a dense tensor equal to an earlier one of its shape counts once."""
    experts = {n for n in ckpt.names() if EXPERT_MARK in n}
    dense = [n for n in ckpt.names() if n not in experts]
    tied: dict[str, str] = {}
    for i, n in enumerate(dense):
        m = ckpt.meta(n)
        for prev in dense[:i]:
            if (
                prev not in tied
                and ckpt.meta(prev) == m
                and torch.equal(ckpt.tensor(prev), ckpt.tensor(n))
            ):
                tied[n] = prev
                break
    order = [n for n in dense if n not in tied] + [n for n in ckpt.names() if n in experts]
    map_in_order(ckpt, osd, order, source)


def _counts(ms: dict[str, Any]) -> list[int]:
    """`num_experts` of the model states: one count per MoE layer (an int in old releases)."""
    ne = ms.get("num_experts")
    if isinstance(ne, int) and not isinstance(ne, bool):
        return [ne]
    if isinstance(ne, (list, tuple)) and all(isinstance(x, int) for x in ne):
        return list(ne)
    return []


def expert_problems(tag: Path, ms: dict[str, Any], mp_ranks: int, rel: Any) -> list[str]:
    """The expert files the model states' `num_experts` calls for, each present (whole is
    checked with the other files): one per MoE layer, expert and model-parallel rank."""
    counts = _counts(ms)
    if not counts:
        return []
    have = {(m, layer, e) for m in range(mp_ranks) for layer, e, _ in expert_files(tag, m)}
    legacy = any(layer == -1 for _, layer, _ in have)
    problems = []
    for m in range(mp_ranks):
        for layer, n in enumerate(counts):
            for e in range(n):
                if legacy:
                    if (m, -1, e) not in have and layer == 0:
                        problems.append(
                            f"{rel(f'expert_{e}_mp_rank_{m:02d}_model_states.pt')} missing "
                            f"(num_experts {counts} in the model states)"
                        )
                elif (m, layer, e) not in have:
                    problems.append(
                        f"{rel(f'layer_{layer}_expert_{e}_mp_rank_{m:02d}_model_states.pt')} missing "
                        f"(num_experts {counts} in the model states)"
                    )
    return problems
