"""Mixture-of-Experts in the replay: the loss the trainer optimised, and what the routers did.

A transformers MoE model (Qwen3-MoE, Mixtral, gpt-oss, OLMoE, ...) configured with
`output_router_logits` returns its load-balancing loss as `aux_loss` and adds
`router_aux_loss_coef * aux_loss` to the loss it returns when it is given labels: that sum is
what the Trainer optimises and logs (e.g. `Qwen3MoeForCausalLM.forward`). The replay computes
the language-model loss from the logits itself (per row, per token), so it adds the model's own
auxiliary term the same way, or no replayed step would match the log.

The router logits the model returns (one [tokens, experts] tensor per MoE layer) give the
routing evidence of each pass: each expert's share of the routed token slots (top-k), the
largest router logit, and the mean routing entropy; reduced on the device, read once a step.

A model whose MoE layers route under a capacity (DeepSpeed-MoE's `TopKGate`) returns its gates'
load-balancing losses to the model's own code, which weights and adds them: its trainer's module
hooks the gates (`router_gates`, asked of every trainer) and each gate call's figures give the
aux term (`gate_aux`: `router_aux_loss_coef` x the summed `l_aux`, the weight HF models name
so) and the same routing figures, with the tokens each expert kept and those dropped past its
capacity (`gate_figures`, `GateFigures`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptforensics.trainers import frameworks

__all__ = [
    "aux_term",
    "RouterFigures",
    "router_figures",
    "router_modules",
    "GateFigures",
    "router_gates",
    "gate_aux",
    "gate_figures",
]


def aux_term(
    model: nn.Module,
    out: Any,
    mask: torch.Tensor | None = None,
    parts: list[tuple[int, int]] | None = None,
    summed: bool = True,
) -> torch.Tensor | None:
    """`router_aux_loss_coef * aux_loss` as the trainer's loss holds it, or None for a model
    that returns no auxiliary loss (dense, or routers' logits not output).

    Under gradient accumulation the trainer calls the model once per micro-batch (`parts`: row
    ranges), and each call adds its own micro-batch's load-balancing loss: the step's term is
    their sum where the trainer sums the micro-batches' losses (`summed`: the HF Trainer with a
    model that takes `num_items_in_batch`, its language-model losses then already normalised
    by the step's tokens), else their mean (each loss divided by the accumulation steps). Each
    part's loss is the model's own function (`load_balancing_loss_func` of its modeling
    module) on that part's router logits."""
    aux = getattr(out, "aux_loss", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    if not isinstance(aux, torch.Tensor) or coef is None:
        return None
    if not parts or len(parts) <= 1:
        return float(coef) * aux
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    logits = getattr(out, "router_logits", None)
    if fn is None or not logits:
        return float(coef) * aux  # no way to split it: the whole batch's
    rows = parts[-1][1]
    per = [
        fn(
            tuple(
                lg.reshape(rows, -1, lg.shape[-1])[lo:hi].reshape(-1, lg.shape[-1]) for lg in logits
            ),
            getattr(model, "num_experts", None),
            getattr(model, "num_experts_per_tok", 2),
            mask[lo:hi] if mask is not None else None,
        )
        for lo, hi in parts
    ]
    total = torch.stack([torch.as_tensor(x, device=aux.device) for x in per]).sum()
    return float(coef) * (total if summed else total / len(parts))


@dataclass(frozen=True, slots=True)
class RouterFigures:
    """One pass's routing, per MoE layer (in the model's order).

    Attributes:
        load: each expert's share of the routed token slots (top-k picks / all picks).
        logit_max: the largest |router logit|.
        entropy: mean entropy of the routing softmax over experts (nats; ln E is uniform).
        top_k: the experts each token is sent to.
        modules: the routers' module names, one per layer, where the model's routers are
            modules of their own (transformers' `*Router`), else "MoE layer i".
    """

    load: tuple[tuple[float, ...], ...]
    logit_max: tuple[float, ...]
    entropy: tuple[float, ...]
    top_k: int = 1
    modules: tuple[str, ...] = ()


def _top_k(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(
        getattr(cfg, "num_experts_per_tok", 0) or getattr(model, "num_experts_per_tok", 0) or 1
    )


def router_modules(model: nn.Module) -> tuple[str, ...]:
    """The router modules of a transformers MoE model, in layer order (`*Router` classes:
    Qwen3-MoE's and Mixtral's `mlp.gate`, gpt-oss's `mlp.router`)."""
    return tuple(n for n, m in model.named_modules() if type(m).__name__.endswith("Router"))


def router_figures(
    model: nn.Module, out: Any, mask: torch.Tensor | None, modules: tuple[str, ...] = ()
) -> RouterFigures | None:
    """The routing figures of a forward's `router_logits` (None for a model without them).
    Padding positions (`mask` 0) are left out, as the load-balancing loss leaves them out."""
    logits = getattr(out, "router_logits", None)
    if not logits:
        return None
    k = _top_k(model)
    keep = mask.reshape(-1).bool() if mask is not None else None
    rows = []
    for lg in logits:
        x = lg.detach().float().reshape(-1, lg.shape[-1])
        if keep is not None and keep.numel() == x.shape[0]:
            x = x[keep.to(x.device)]
        e = x.shape[-1]
        picks = torch.zeros(e, device=x.device).scatter_add_(
            0,
            x.topk(min(k, e), dim=-1).indices.reshape(-1),
            torch.ones(x.shape[0] * min(k, e), device=x.device),
        )
        p = torch.softmax(x, dim=-1)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        rows.append(
            torch.cat([picks / picks.sum().clamp_min(1), x.abs().amax().reshape(1), ent.reshape(1)])
        )
    table = torch.stack(rows).tolist()  # the one host read of the pass's routing
    return RouterFigures(
        load=tuple(tuple(r[:-2]) for r in table),
        logit_max=tuple(r[-2] for r in table),
        entropy=tuple(r[-1] for r in table),
        top_k=k,
        modules=modules
        if len(modules) == len(table)
        else tuple(f"MoE layer {i}" for i in range(len(table))),
    )


@dataclass(frozen=True, slots=True)
class GateFigures(RouterFigures):
    """The routing of a pass whose gates route under a capacity, per MoE layer: the
    `RouterFigures` (`load`: each expert's share of the routes the router picked, before the
    cut) and what the capacity did.

    Attributes:
        routed: each expert's routes (tokens x top-k picks) before the capacity cut.
        tokens: each expert's routes the cut kept (the tokens it processed).
        dropped: the routes dropped past their expert's capacity (their tokens pass the layer
            on the residual alone).
        capacity: the routes an expert takes at most.
        drawn: per layer, what its gate drew from torch's RNG this pass ("" where nothing):
            a replay cannot redraw it, so its routing, and the loss, may part from the run's.
    """

    routed: tuple[tuple[int, ...], ...] = ()
    tokens: tuple[tuple[int, ...], ...] = ()
    dropped: tuple[int, ...] = ()
    capacity: tuple[int, ...] = ()
    drawn: tuple[str, ...] = ()


def router_gates(model: nn.Module) -> Any | None:
    """Hooks on the model's capacity-routing gates, from the trainer whose MoE layers they
    are (each trainer module's `router_gates(model)`, asked in turn), or None."""
    for fw in frameworks():
        fn = getattr(fw, "router_gates", None)
        tap = fn(model) if fn is not None else None
        if tap is not None:
            return tap
    return None


def gate_aux(model: nn.Module, calls: list[tuple[str, Any]]) -> torch.Tensor | None:
    """`router_aux_loss_coef` x the gates' summed load-balancing losses, as the model adds them
    to its loss; None where the model names no weight (or no gate was called)."""
    coef = getattr(model, "router_aux_loss_coef", None)
    if coef is None or not calls:
        return None
    return float(coef) * torch.stack([c.l_aux.reshape(()) for _, c in calls]).sum()


def gate_figures(calls: list[tuple[str, Any]]) -> GateFigures | None:
    """The routing figures of a pass's gate calls (`logits` [S, E], `routed` and `kept` [E],
    `capacity`, `top_k` each), reduced on the device and read once."""
    if not calls:
        return None
    rows = []
    for _, c in calls:
        x, routed = c.logits.reshape(-1, c.logits.shape[-1]), c.routed
        p = torch.softmax(x, dim=-1)
        ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean()
        rows.append(
            torch.cat(
                [
                    routed / routed.sum().clamp_min(1),
                    routed,
                    c.kept.to(routed.device),
                    x.abs().amax().reshape(1),
                    ent.reshape(1),
                    c.capacity.to(routed.device).reshape(1),
                ]
            )
        )
    e = calls[0][1].routed.numel()
    table = torch.stack(rows).tolist()  # the one host read of the pass's routing
    routed_ = tuple(tuple(int(v) for v in r[e : 2 * e]) for r in table)
    kept = tuple(tuple(int(v) for v in r[2 * e : 3 * e]) for r in table)
    dropped = tuple(sum(a) - sum(b) for a, b in zip(routed_, kept, strict=True))
    drawn = tuple(
        ", ".join(x for x in (c.drawn, c.drawn_if_full if n else "") if x)
        for (_, c), n in zip(calls, dropped, strict=True)
    )
    return GateFigures(
        load=tuple(tuple(r[:e]) for r in table),
        logit_max=tuple(r[3 * e] for r in table),
        entropy=tuple(r[3 * e + 1] for r in table),
        top_k=calls[0][1].top_k,
        modules=tuple(n for n, _ in calls),
        routed=routed_,
        tokens=kept,
        dropped=dropped,
        capacity=tuple(int(r[3 * e + 2]) for r in table),
        drawn=drawn,
    )
