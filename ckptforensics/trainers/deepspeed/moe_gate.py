"""DeepSpeed-MoE's gates in a replay: what each `TopKGate` call decided, read from its output.

`deepspeed.moe.layer.MoE` routes through `MOELayer`, which calls its `TopKGate` once per
forward on the layer's tokens [S, d] (deepspeed 0.19.8, `sharded_moe.py`). The gate returns
what `top1gating` / `top2gating` / `topkgating` computed:

- `MOELayer` asks for sparse routes: `(l_aux, capacity, num_experts, indices [k, S], locations
  [k, S], gates [k, S], exp_counts [E])`, a route the capacity cut evicted holding expert -1;
- called without them (the dense form): `(l_aux, combine_weights [S, E, C], dispatch_mask
  [S, E, C], exp_counts [E])`, the kept routes the true entries of `dispatch_mask`.

`exp_counts` counts each expert's routes before the cut (`used_token` applied), `capacity` is
`ceil(S / E x capacity_factor x k)` and at least `min_capacity` (`_capacity`; with
`drop_tokens=False` the largest count, nothing dropped): the routes past it are dropped, their
tokens passing the layer on the residual alone. `l_aux` is the gate's load-balancing loss,
which the model adds to its loss with its own weight. The hook keeps each call's figures on the
device, no host read; the router logits are `wg`'s product as `TopKGate.forward` forms it
(fp32; its `Jitter` noise aside).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GateCall", "GateTap", "router_gates"]


@dataclass(frozen=True, slots=True)
class GateCall:
    """One gate call's routing, on the device.

    Attributes:
        l_aux: the gate's load-balancing loss (scalar, in the autograd graph).
        logits: the router logits [S, E] (fp32, detached).
        routed: each expert's routes before the capacity cut [E] (`exp_counts`).
        kept: each expert's routes the cut kept [E].
        capacity: the routes an expert takes at most (scalar).
        top_k: the experts each token is routed to.
        drawn: what the gate draws from torch's RNG in training, which no replay redraws
            (`_drawn`); "" where nothing.
        drawn_if_full: what it draws only when an expert is full (Random Token Selection picks
            the tokens a full expert keeps); "" where nothing.
    """

    l_aux: torch.Tensor
    logits: torch.Tensor
    routed: torch.Tensor
    kept: torch.Tensor
    capacity: torch.Tensor
    top_k: int
    drawn: str = ""
    drawn_if_full: str = ""


def _drawn(mod: nn.Module) -> tuple[str, str]:
    """The random parts of a `TopKGate`'s routing in training (deepspeed 0.19.8
    `sharded_moe.py`): noisy gating (`noisy_gate_policy` "Jitter" / "RSample"), top-2's second
    expert picked with Gumbel noise (`top2_2nd_expert_sampling`, on by default), and Random
    Token Selection (`use_rts`, on by default), which only decides which tokens a full expert
    keeps. Each is drawn from torch's global RNG."""
    always = []
    if getattr(mod, "noisy_gate_policy", None):
        always.append(f"{mod.noisy_gate_policy} noise")
    if getattr(mod, "k", 1) == 2 and getattr(mod, "top2_2nd_expert_sampling", False):
        always.append("the second expert sampled with Gumbel noise")
    full = "random token selection in full experts" if getattr(mod, "use_rts", False) else ""
    return ", ".join(always), full


class GateTap:
    """Forward hooks on a model's `TopKGate` modules; each gate's last call (`calls`)."""

    def __init__(self, gates: list[tuple[str, nn.Module]]) -> None:
        self.names = tuple(n for n, _ in gates)
        self._last: dict[str, GateCall] = {}
        self._handles = [m.register_forward_hook(self._hook(n), with_kwargs=True) for n, m in gates]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: tuple) -> None:
            x = args[0] if args else kwargs["input"]
            with torch.no_grad():
                logits = nn.functional.linear(x.detach().float(), mod.wg.weight.detach().float())
                e = logits.shape[-1]
                if len(out) == 7:  # sparse routes: expert -1 where the cut evicted the route
                    idx = out[3].reshape(-1).long()
                    kept = torch.zeros(e, device=logits.device).scatter_add_(
                        0, idx.clamp_min(0), (idx >= 0).float()
                    )
                    capacity = torch.as_tensor(out[1], device=logits.device).float()
                else:  # dense: dispatch_mask [S, E, C]
                    kept = out[2].sum((0, 2)).float()
                    capacity = torch.tensor(float(out[2].shape[-1]), device=logits.device)
                routed = out[-1].to(logits.device).float()
            self._last[name] = GateCall(
                out[0], logits, routed, kept, capacity.reshape(()), int(getattr(mod, "k", 1)),
                *_drawn(mod),
            )  # fmt: skip

        return hook

    def reset(self) -> None:
        self._last.clear()

    def calls(self) -> list[tuple[str, GateCall]]:
        """Each gate called since `reset`, in the model's order."""
        return [(n, self._last[n]) for n in self.names if n in self._last]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def router_gates(model: nn.Module) -> GateTap | None:
    """Hooks on `model`'s DeepSpeed gates, or None where it has none. DeepSpeed is not
    imported here: a model built with its MoE has imported it already."""
    sharded = sys.modules.get("deepspeed.moe.sharded_moe")
    gate = getattr(sharded, "TopKGate", None)
    if gate is None:
        return None
    gates = [(n, m) for n, m in model.named_modules() if isinstance(m, gate)]
    return GateTap(gates) if gates else None
