"""Megatron GPT (megatron.core.models.gpt.GPTModel): megatron-core 0.19's forward with its
module names, the local or the Transformer-Engine (fused norm) layer spec; MoE layers
(`moe.py`: TopKRouter, SequentialMLP experts, the aux and z losses' gradients)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptforensics.trainers.layers import Attn, ReferenceError, attend, norm, rotary
from ckptforensics.trainers.megatron.moe import MegatronMoE


def _attend_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Attn, scale: float, softmax_fp32: bool
) -> torch.Tensor:
    """megatron-core's local `DotProductAttention` in bf16/fp16, as it rounds: scores
    `baddbmm(q, k^T, alpha=scale)` in the input dtype, the causal mask filled with -10000,
    softmax in that dtype (fp32 with `attention_softmax_in_fp32`), `bmm` with v. In fp32 the
    fused `scaled_dot_product_attention` gives megatron-core's numbers already (`attend`)."""
    rep = a.n_heads // a.n_kv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    b, t, h, d = q.shape
    qh, kh, vh = (x.transpose(1, 2).reshape(b * h, t, d) for x in (q, k, v))
    scores = torch.baddbmm(
        torch.empty(b * h, t, t, dtype=q.dtype, device=q.device),
        qh,
        kh.transpose(1, 2),
        beta=0.0,
        alpha=scale,
    )
    scores = scores.view(b, h, t, t)
    if softmax_fp32:
        scores = scores.float()
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1).to(q.dtype)
    out = torch.bmm(probs.view(b * h, t, t), vh).view(b, h, t, d)
    return out.transpose(1, 2).flatten(2)


_MEGATRON_REFUSED = {
    "multi_latent_attention": "multi-latent attention",
    "use_rope_scaling": "Llama-3.1 RoPE scaling",
    "mrope_section": "multimodal RoPE",
    "attention_output_gate": "gated attention output",
    "qk_l2_norm": "L2 QK-norm",
    "experimental_attention_variant": "an experimental attention variant",
    "apply_residual_connection_post_layernorm": "residual taken after the layer norm",
}


def is_megatron_args(cfg: dict[str, Any] | None) -> bool:
    """Megatron-LM's parsed `args` (legacy `args`, torch_dist common state)."""
    return bool(cfg) and all(
        k in cfg for k in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size")
    )


class _NormLinear(nn.Module):
    """Transformer Engine's LayerNormLinear (names `layer_norm_weight`, `weight`): the norm
    fused into the following projection, as the TE layer spec saves it."""

    def __init__(self, norm: nn.Module, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.rms, self.eps = isinstance(norm, nn.RMSNorm), float(norm.eps or 1e-5)
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.layer_norm_weight = nn.Parameter(torch.ones(d_in))
        self.layer_norm_bias = None if self.rms else nn.Parameter(torch.zeros(d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            h = F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps)
        else:
            h = F.layer_norm(
                x, (x.shape[-1],), self.layer_norm_weight, self.layer_norm_bias, self.eps
            )
        return F.linear(h, self.weight, self.bias)


class _MegatronAttention(nn.Module):
    def __init__(self, args: dict[str, Any], a: Attn, fused_norm: bool) -> None:
        super().__init__()
        h, bias = args["hidden_size"], bool(args.get("add_bias_linear", True))
        qkv_bias = bias or bool(args.get("add_qkv_bias", False))
        qkv_out = (a.n_heads + 2 * a.n_kv) * a.head_dim
        self.a = a
        if fused_norm:
            self.linear_qkv: nn.Module = _NormLinear(_megatron_norm(args, h), h, qkv_out, qkv_bias)
        else:
            self.linear_qkv = nn.Linear(h, qkv_out, bias=qkv_bias)
        self.linear_proj = nn.Linear(a.n_heads * a.head_dim, h, bias=bias)
        if args.get("qk_layernorm"):
            self.q_layernorm = _megatron_norm(args, a.head_dim)
            self.k_layernorm = _megatron_norm(args, a.head_dim)
        scale = args.get("softmax_scale")
        self.scale = float(scale) if scale else 1.0 / math.sqrt(a.head_dim)
        # validate_args turns it on with apply_query_key_layer_scaling (whose rescaling of
        # the scores cancels out in fp32)
        self.softmax_fp32 = bool(
            args.get("attention_softmax_in_fp32") or args.get("apply_query_key_layer_scaling")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        b, t, _ = x.shape
        # [b, t, ng, (np/ng + 2) * hn]: each query group's heads, then its key, then its value.
        mixed = self.linear_qkv(x).view(b, t, a.n_kv, (a.n_heads // a.n_kv + 2) * a.head_dim)
        q, k, v = mixed.split([a.n_heads // a.n_kv * a.head_dim, a.head_dim, a.head_dim], dim=3)
        q = q.reshape(b, t, a.n_heads, a.head_dim)
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        low = q.dtype in (torch.bfloat16, torch.float16)  # Megatron --bf16/--fp16 weights
        q, k = rotary(q, a, in_dtype=low), rotary(k, a, in_dtype=low)
        if low:
            return self.linear_proj(_attend_megatron(q, k, v, a, self.scale, self.softmax_fp32))
        return self.linear_proj(attend(q, k, v, a, self.scale))


def _megatron_norm(args: dict[str, Any], dim: int) -> nn.Module:
    kind = {"RMSNorm": "rms", "LayerNorm": "layer"}.get(str(args.get("normalization", "LayerNorm")))
    if kind is None:
        raise ReferenceError(f"normalization {args.get('normalization')!r}")
    if args.get("layernorm_zero_centered_gamma") or args.get("apply_layernorm_1p"):
        raise ReferenceError("zero-centred layer-norm gamma")
    return norm(kind, dim, float(args.get("layernorm_epsilon") or args.get("norm_epsilon") or 1e-5))


class _MegatronMLP(nn.Module):
    def __init__(self, args: dict[str, Any], fused_norm: bool, ffn: int | None = None) -> None:
        super().__init__()
        h, bias = args["hidden_size"], bool(args.get("add_bias_linear", True))
        ffn = ffn or int(args.get("ffn_hidden_size") or 4 * h)
        self.glu = bool(args.get("swiglu"))
        out = 2 * ffn if self.glu else ffn
        if fused_norm:
            self.linear_fc1: nn.Module = _NormLinear(_megatron_norm(args, h), h, out, bias)
        else:
            self.linear_fc1 = nn.Linear(h, out, bias=bias)
        self.linear_fc2 = nn.Linear(ffn, h, bias=bias)
        self.squared_relu = bool(args.get("squared_relu"))
        # megatron's fused bias-GeLU kernel is the tanh approximation; F.gelu otherwise
        self.gelu_tanh = bool(args.get("bias_gelu_fusion")) and bias

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """`scale`: an expert's routing prob per token (MLP's `per_token_scale`)."""
        y = self.linear_fc1(x)
        if self.glu:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        elif self.squared_relu:
            y = F.relu(y).pow(2)
        else:
            y = F.gelu(y, approximate="tanh" if self.gelu_tanh else "none")
        if scale is not None:
            y = (y * scale.unsqueeze(-1)).to(y.dtype)
        return self.linear_fc2(y)


class _MegatronLayer(nn.Module):
    def __init__(self, args: dict[str, Any], a: Attn, fused_norm: bool) -> None:
        super().__init__()
        h = args["hidden_size"]
        self.input_layernorm = nn.Identity() if fused_norm else _megatron_norm(args, h)
        self.self_attention = _MegatronAttention(args, a, fused_norm)
        self.pre_mlp_layernorm = nn.Identity() if fused_norm else _megatron_norm(args, h)
        if args.get("num_experts"):
            self.mlp: nn.Module = MegatronMoE(
                args,
                _megatron_norm(args, h) if fused_norm else None,
                lambda ffn: _MegatronMLP(args, False, ffn),
            )
        else:
            self.mlp = _MegatronMLP(args, fused_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Stack(nn.Module):
    def __init__(self, layers: list[nn.Module], final: nn.Module | None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if final is not None:
            self.final_layernorm = final

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x) if hasattr(self, "final_layernorm") else x


class _MegatronEmbedding(nn.Module):
    def __init__(self, args: dict[str, Any], learned_positions: bool) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(int(args["padded_vocab_size"]), args["hidden_size"])
        if learned_positions:
            self.position_embeddings = nn.Embedding(
                int(args["max_position_embeddings"]), args["hidden_size"]
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids)
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(torch.arange(ids.shape[1], device=ids.device))[None]
        return x


class MegatronGPT(nn.Module):
    """megatron-core GPTModel's forward in [batch, seq, hidden] layout (megatron runs
    [seq, batch, hidden]; the arithmetic per token is the same)."""

    def __init__(self, args: dict[str, Any], fused_norm: bool) -> None:
        super().__init__()
        for key, what in _MEGATRON_REFUSED.items():
            if args.get(key):
                raise ReferenceError(what)
        pos = str(args.get("position_embedding_type", "learned_absolute"))
        if pos not in ("rope", "learned_absolute", "none"):
            raise ReferenceError(f"position embedding {pos!r}")
        n_heads = int(args["num_attention_heads"])
        n_kv = (
            int(args.get("num_query_groups") or n_heads)
            if args.get("group_query_attention")
            else n_heads
        )
        head_dim = int(args.get("kv_channels") or args["hidden_size"] // n_heads)
        a = Attn(
            n_heads=n_heads,
            n_kv=n_kv,
            head_dim=head_dim,
            rope_theta=float(args.get("rotary_base") or 10000) if pos == "rope" else None,
            rope_dim=int(head_dim * float(args.get("rotary_percent") or 1.0)),
            rope_interleaved=bool(args.get("rotary_interleaved")),
        )
        self.embedding = _MegatronEmbedding(args, pos == "learned_absolute")
        layers = [_MegatronLayer(args, a, fused_norm) for _ in range(int(args["num_layers"]))]
        self.decoder = _Stack(layers, _megatron_norm(args, args["hidden_size"]))
        self.tied = not args.get("untie_embeddings_and_output_weights", False)
        if not self.tied:
            self.output_layer = nn.Linear(
                args["hidden_size"], int(args["padded_vocab_size"]), bias=False
            )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.decoder(self.embedding(input_ids))
        w = self.embedding.word_embeddings.weight if self.tied else self.output_layer.weight
        return F.linear(h, w)


def megatron_gpt(args: dict[str, Any], names: list[str]) -> tuple[nn.Module, str]:
    """The Megatron GPT that `args` describe; TE-style fused norm names when the checkpoint has them."""
    fused = any(n.endswith("linear_qkv.layer_norm_weight") for n in names)
    if args.get("num_experts") and not any(".mlp.experts.local_experts." in n for n in names):
        # experts under other names (GroupedMLP's weight1/weight2, TEGroupedMLP's per-expert
        # linear_fc1.weight<e> in a legacy save) or none: only SequentialMLP's are read
        raise ReferenceError("the reference Megatron GPT does not implement mixture of experts")
    try:
        model = MegatronGPT(args, fused)
    except ReferenceError as e:
        raise ReferenceError(f"the reference Megatron GPT does not implement {e}") from None
    spec = "Transformer Engine names (fused layer norms)" if fused else "local spec names"
    if args.get("num_experts"):
        spec += (
            f"; MoE layers of {args['num_experts']} experts, top-{args.get('moe_router_topk') or 2}: "
            "the routers' load-balancing and z-losses in the gradient alone, as megatron-core's "
            "MoEAuxLossAutoScaler adds them, not in the logged lm loss"
        )
    return (
        model,
        f"reference Megatron GPT from the checkpoint's args ({spec}; megatron-core 0.19 GPTModel forward)",
    )
