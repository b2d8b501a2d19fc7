"""MoE experts in megatron-core's torch_dist checkpoints, read one tensor per expert.

`SequentialMLP.sharded_state_dict` (megatron/core/transformer/moe/experts.py; `TEGroupedMLP`'s,
the grouped-GEMM experts, is interchangeable with it) saves the model's
`<mlp>.experts.local_experts.<e>.<param>` under the sharded key `<mlp>.experts.experts.<param>`
with one more dim: the expert's *global* index (EP rank x local experts + e), after the layers'
dim where the layers are stacked (`decoder.layers.mlp.experts.experts.linear_fc1.weight`
[layers, experts, ...]); Megatron-LM's save_checkpoint sets `singleton_local_shards` off, which
is what gives that layout. The reader takes each expert's slice under SequentialMLP's name, so
a torch_dist save and a legacy one (the model's state dict) name an expert alike and the diff's
per-expert rules (`engine.diff.experts.split_groups`) see one tensor per expert.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = ["EXPERTS", "expert_count", "experts_in_order", "split_experts"]

# `<head>experts.<param>` where `<head>` is the experts module (`decoder.layers.mlp.experts.`).
EXPERTS = re.compile(r"^(?P<head>(?:.*\.)?experts\.)experts\.(?P<param>.+)$")
# One expert's own tensor, as SequentialMLP names it.
_LOCAL = re.compile(r"^(?P<head>.*\.local_experts\.)(?P<e>\d+)\.(?P<param>.+)$")


def _model_key(key: str) -> str:
    """The model key of a sharded key, the optimizer's `optimizer.state.<field>.` taken off."""
    if key.startswith("optimizer.state."):
        return key[len("optimizer.state.") :].partition(".")[2]
    return key


def expert_count(md: Any, num_experts: Any, layers: int) -> int:
    """Experts per MoE layer on the expert dim of the `<mlp>.experts.experts.*` tensors of
    DCP metadata `md`: their common size there, when it agrees with `args.num_experts`
    (`num_experts`, when the args say); 0 when there are none or the sizes disagree (the
    tensors are then read as stored)."""
    lead = 1 if layers else 0
    dims = {
        tuple(m.size)[lead] if len(m.size) > lead else 0
        for k, m in md.state_dict_metadata.items()
        if hasattr(m, "size") and EXPERTS.match(_model_key(k))
    }
    if len(dims) != 1:
        return 0
    (e,) = dims
    return e if e > 1 and (not isinstance(num_experts, int) or num_experts == e) else 0


def split_experts(
    views: list[tuple[str, Callable[[], Any], int]], experts: int
) -> list[tuple[str, Callable[[], Any], int]]:
    """(name, getter, leading dims taken) views with each expert tensor's view replaced by
    one per expert: `<head>local_experts.<e>.<param>`, the slice at index e of its next dim."""
    out: list[tuple[str, Callable[[], Any], int]] = []
    for name, get, lead in views:
        m = EXPERTS.match(name)
        if m is None:
            out.append((name, get, lead))
            continue
        out += [
            (
                f"{m.group('head')}local_experts.{e}.{m.group('param')}",
                (lambda get=get, e=e: get()[e]),
                lead + 1,
            )
            for e in range(experts)
        ]
    return out


def experts_in_order(rest: list[str]) -> list[str]:
    """A layer's parameter names in module (named_parameters) order: SequentialMLP registers
    its experts one after another, each expert's parameters together, where the split views
    list each parameter across the experts."""
    out: list[str] = []
    done: set[str] = set()
    for r in rest:
        m = _LOCAL.match(r)
        if m is None:
            out.append(r)
            continue
        head = m.group("head")
        if head in done:
            continue
        done.add(head)
        mine = [x for x in (_LOCAL.match(y) for y in rest) if x and x.group("head") == head]
        params = list(dict.fromkeys(x.group("param") for x in mine))
        ids = sorted({int(x.group("e")) for x in mine})
        out += [f"{head}{e}.{q}" for e in ids for q in params]
    return out
