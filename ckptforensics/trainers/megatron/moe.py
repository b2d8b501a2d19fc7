"""megatron-core 0.19's MoE layer (`MoELayer` with `TopKRouter`, `SequentialMLP` experts, the
allgather dispatcher) for the reference GPT (`model.py`), with its load-balancing and router
z-losses entering the gradient as megatron-core makes them enter it.

What the run logged and what it optimised (megatron-core 0.19.2, read in its source):

- Megatron-LM's printed `lm loss` (and `train_step`'s `loss_dict["lm loss"]`) is the language-model
  loss alone: `pretrain_gpt.loss_func` reports the masked token losses' sum and count. The routers'
  `load_balancing_loss` and `z_loss` are recorded in the MoE metrics tracker (divided by their
  coefficients) and printed after it, never added to it.
- They reach the gradient only through `MoEAuxLossAutoScaler` (moe_utils.py): an autograd
  function that returns its activation unchanged (the router's `probs` for the aux loss, its
  `logits` for the z-loss) and whose backward hands the loss a gradient of
  `main_loss_backward_scale` (no forward term). The pipeline schedule sets that scale to
  `loss_scale / num_microbatches` (`calculate_per_token_loss` off; loss_scale 1 without a
  grad scaler), the weight each micro-batch's LM loss gets; DDP then averages over the
  data-parallel ranks. So the step's gradient is that of
  `lm loss + mean over the global batch's micro-batches of (aux + z)`, with each layer's
  losses computed on its micro-batch's tokens alone.
- Aux loss (`switch_load_balancing_loss_func`, `moe_router_load_balancing_type` aux_loss):
  `E * coeff / (topk * T^2) * sum_e(sum_tokens softmax(logits)_e * tokens_e)`, tokens_e the
  top-k picks of the fp32 softmax scores, T the micro-batch's tokens; the coefficient as set,
  not divided by the layers. Z-loss (`z_loss_func`): `coeff * mean(logsumexp(logits)^2)`.
  Both only in training with gradients on (`self.training and torch.is_grad_enabled()`).

The replay's loss is then the LM loss (what the log holds) and the model adds the MoE losses'
gradients itself (`_AuxGrad`, the autoscaler's twin), scaled by the micro-batch's share of
the global batch (`micro_batch_size / global_batch_size` from the checkpoint's args: one
process, whole batch or micro-batch at a time), so the replayed update is the run's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptforensics.trainers.layers import ReferenceError

__all__ = ["MegatronMoE", "check_moe_args"]

# megatron-core settings this reference does not implement (arg -> what it is)
_MOE_REFUSED = {
    "moe_expert_capacity_factor": "MoE token dropping (expert capacity)",
    "moe_shared_expert_intermediate_size": "MoE shared experts",
    "moe_input_jitter_eps": "MoE router input jitter",
    "moe_router_enable_expert_bias": "MoE router expert bias",
    "moe_router_group_topk": "group-limited MoE routing",
    "moe_apply_probs_on_input": "MoE probs applied on the experts' input",
    "moe_router_force_load_balancing": "forced MoE load balancing",
    "moe_router_force_biased": "biased MoE router logits",
    "moe_enable_routing_replay": "MoE routing replay",
    "moe_latent_size": "MoE latent projections",
    "calculate_per_token_loss": "per-token loss scaling of the MoE losses",
}


def check_moe_args(args: dict[str, Any]) -> None:
    """Raise ReferenceError for a MoE setting the reference does not implement."""
    for key, what in _MOE_REFUSED.items():
        if args.get(key):
            raise ReferenceError(what)
    lb = args.get("moe_router_load_balancing_type") or "aux_loss"
    if any(t not in ("aux_loss", "none") for t in ([lb] if isinstance(lb, str) else lb)):
        raise ReferenceError(f"MoE load balancing {lb!r}")
    if str(args.get("moe_router_score_function") or "softmax") not in ("softmax", "sigmoid"):
        raise ReferenceError(f"MoE score function {args.get('moe_router_score_function')!r}")
    freq = args.get("moe_layer_freq", 1)
    if (freq if isinstance(freq, int) else min(freq or [1])) != 1:
        raise ReferenceError("MoE on some layers only (moe_layer_freq)")


class _AuxGrad(torch.autograd.Function):
    """megatron-core's `MoEAuxLossAutoScaler`: `x` unchanged; in backward, `loss` gets the
    gradient `scale` (its term in the step's gradient, in none of the logged loss)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * ctx.scale, None


class _Router(nn.Module):
    """TopKRouter's gating linear (`weight` [E, h], `bias` with add_bias_linear)."""

    def __init__(self, hidden: int, experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.zeros(experts)) if bias else None


class _Experts(nn.Module):
    """SequentialMLP: `local_experts.<e>` (the names the torch_dist reader gives each expert)."""

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(experts)


class MegatronMoE(nn.Module):
    """MoELayer's forward on [batch, seq, hidden]: the pre-MLP norm where the checkpoint names
    it under the MLP (`linear_fc1.layer_norm_weight`, TE names), the router, top-k, each
    expert on its tokens in token order with its prob scaling the activation (MLP's
    `per_token_scale`), the outputs summed back (unpermute); the aux and z losses per
    micro-batch of `micro_batch_size` rows, added to the gradient (`_AuxGrad`)."""

    def __init__(
        self,
        args: dict[str, Any],
        norm: nn.Module | None,
        make_expert: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        check_moe_args(args)
        h, e = int(args["hidden_size"]), int(args["num_experts"])
        if norm is not None:  # the pre-MLP norm saved as TE's fused `linear_fc1.layer_norm_*`
            self.linear_fc1 = _FusedNorm(norm)
        self.router = _Router(h, e, bool(args.get("add_bias_linear", True)))
        ffn = int(args.get("moe_ffn_hidden_size") or args.get("ffn_hidden_size") or 4 * h)
        self.experts = _Experts([make_expert(ffn) for _ in range(e)])
        self.n_experts, self.topk = e, int(args.get("moe_router_topk") or 2)
        self.pre_softmax = bool(args.get("moe_router_pre_softmax"))
        self.score = str(args.get("moe_router_score_function") or "softmax")
        self.scaling = args.get("moe_router_topk_scaling_factor")
        self.router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
            str(args.get("moe_router_dtype"))
        )
        lb = args.get("moe_router_load_balancing_type") or "aux_loss"
        coeff = args.get("moe_aux_loss_coeff") or 0.0
        if not isinstance(lb, str):  # a list of types, one coefficient each
            coeff = dict(zip(lb, coeff, strict=False)).get("aux_loss", 0.0)
        elif lb != "aux_loss":
            coeff = 0.0
        self.aux_coeff = float(coeff)
        z = args.get("moe_z_loss_coeff")
        self.z_coeff = float(z) if z is not None else None
        mbs, gbs = args.get("micro_batch_size"), args.get("global_batch_size")
        self.mbs = int(mbs) if mbs else None
        # the autoscaler's scale: loss_scale / num_microbatches, then DDP's mean over the ranks
        self.grad_scale = int(mbs) / int(gbs) if mbs and gbs else None
        # the last training forward's losses over its micro-batches (per micro-batch summed,
        # divided by their coefficients: Megatron's tracker figures), for the record
        self.last_losses: dict[str, float] = {}

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.router.weight, self.router.bias
        rd = self.router_dtype or x.dtype
        if rd == x.dtype and rd == w.dtype:
            return F.linear(x, w, b)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(rd), w.to(rd), None if b is None else b.to(rd))

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        if self.score == "softmax":
            return torch.softmax(logits, dim=-1, dtype=torch.float32)
        s = torch.sigmoid(logits.float())
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """topk_routing_with_score_function (unfused): [N, E] probs and routing map."""
        k = self.topk
        if self.score == "softmax":
            if self.pre_softmax:
                probs, top = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), k, dim=1)
            else:
                scores, top = torch.topk(logits, k, dim=1)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        else:
            probs, top = torch.topk(torch.sigmoid(logits.float()), k, dim=1)
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else probs
        if self.scaling:
            probs = probs * float(self.scaling)
        probs = probs.type_as(logits)
        dense = torch.zeros_like(logits).scatter(1, top, probs)
        return dense, torch.zeros_like(logits, dtype=torch.int).scatter(1, top, 1).bool()

    def _parts(self, rows: int, seq: int) -> list[tuple[int, int]]:
        """Token ranges of the forward's micro-batches ([b, t] flattened row-major)."""
        m = self.mbs or rows
        return [(lo * seq, min(lo + m, rows) * seq) for lo in range(0, rows, m)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "linear_fc1"):
            x = self.linear_fc1(x)
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = self._logits(flat)
        train = self.training and torch.is_grad_enabled()
        parts = self._parts(b, t)
        scale = self.grad_scale if self.grad_scale is not None else 1.0 / len(parts)
        if train and self.z_coeff is not None:  # Router.apply_z_loss, on the logits
            z = torch.stack(
                [
                    torch.logsumexp(logits[lo:hi], dim=-1).square().mean() * self.z_coeff
                    for lo, hi in parts
                ]
            ).sum()
            logits = _AuxGrad.apply(logits, z, scale)
            self.last_losses["z_loss"] = float(z.detach()) / self.z_coeff
        probs, routing = self._route(logits)
        if train and self.aux_coeff > 0:  # Router._apply_aux_loss, on the probs
            aux = torch.stack([self._aux(logits[lo:hi]) for lo, hi in parts]).sum()
            probs = _AuxGrad.apply(probs, aux, scale)
            self.last_losses["load_balancing_loss"] = float(aux.detach()) / self.aux_coeff
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts.local_experts):
            idx = routing[:, e].nonzero().squeeze(1)  # the allgather dispatcher's order
            y = expert(flat.index_select(0, idx), probs[idx, e])
            out = out.index_add(0, idx, y.to(out.dtype))
        return out.view(b, t, h)

    def _aux(self, logits: torch.Tensor) -> torch.Tensor:
        """switch_load_balancing_loss_func on one micro-batch's tokens."""
        scores = self._scores(logits)
        top = torch.topk(scores, self.topk, dim=1).indices
        tokens = torch.zeros_like(logits, dtype=torch.int).scatter(1, top, 1).sum(0)
        n = logits.shape[0]
        return torch.sum(scores.sum(0) * tokens) * (
            self.n_experts * self.aux_coeff / (self.topk * n * n)
        )


class _FusedNorm(nn.Module):
    """An MoE layer's pre-MLP norm under TE's fused names (`linear_fc1.layer_norm_weight`,
    `layer_norm_bias`), as torch_dist saves the local spec's norm: the norm alone (the MoE
    MLP has no fc1 of its own)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.rms, self.eps = isinstance(norm, nn.RMSNorm), float(getattr(norm, "eps", 1e-5) or 1e-5)
        d = int(norm.weight.shape[0])
        self.layer_norm_weight = nn.Parameter(torch.ones(d))
        self.layer_norm_bias = None if self.rms else nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        return F.layer_norm(
            x, (x.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
