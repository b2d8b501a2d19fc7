"""Reference models for runs whose framework cannot run here: Megatron GPT and OLMo-core.

Megatron-core needs CUDA and OLMo-core is rarely installed beside the tool, yet the run
recorded everything needed to rebuild the network: Megatron's `args`, OLMo-core's experiment
`config.json`. These modules follow each framework's forward pass (megatron-core 0.19
`GPTModel` with the local or Transformer-Engine layer spec; OLMo-core 3.0 `Transformer` with
the default or reordered-norm block) and carry its parameter names, so the checkpoint loads
strictly. Faithfulness is not assumed: every replay compares itself with *after*, and the
fixtures of both frameworks replay onto their *after* (tests/test_real_formats.py). An option
this code does not implement is refused by name, never approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ReferenceError",
    "megatron_gpt",
    "olmo_transformer",
    "is_megatron_args",
    "is_olmo_model_config",
]


class ReferenceError(ValueError):
    """The recorded config asks for something the reference model does not implement."""


@dataclass(frozen=True, slots=True)
class Attn:
    """What attention needs, whatever the framework calls it."""

    n_heads: int
    n_kv: int
    head_dim: int
    rope_theta: float | None  # None: no rotary embedding (learned positions)
    rope_dim: int
    rope_interleaved: bool


def _rotary(x: torch.Tensor, a: Attn, in_dtype: bool = False) -> torch.Tensor:
    """RoPE on [B, T, H, D], the angles in fp32 (both frameworks): halves rotated (GPT-NeoX /
    `_rotate_half`) or adjacent pairs (interleaved). Applied in fp32, or with `in_dtype` in
    x's dtype with cos and sin rounded to it (megatron-core's `_apply_rotary_pos_emb_bshd`:
    `cos.to(t.dtype)`; the same numbers in fp32)."""
    if a.rope_theta is None:
        return x
    t = x.shape[1]
    inv = 1.0 / (
        a.rope_theta
        ** (torch.arange(0, a.rope_dim, 2, device=x.device, dtype=torch.float32) / a.rope_dim)
    )
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    ang = ang.repeat_interleave(2, dim=-1) if a.rope_interleaved else torch.cat((ang, ang), dim=-1)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    if in_dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot, rest = (
        (x[..., : a.rope_dim] if in_dtype else x[..., : a.rope_dim].float()),
        x[..., a.rope_dim :],
    )
    if a.rope_interleaved:
        pairs = rot.unflatten(-1, (-1, 2))
        turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    out = (rot * cos + turned * sin).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.numel() else out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Attn, scale: float
) -> torch.Tensor:
    """Causal attention over [B, T, H, D] inputs (K/V repeated per query group), [B, T, H*D] out."""
    rep = a.n_heads // a.n_kv
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    return out.transpose(1, 2).flatten(2)


def _attend_megatron(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Attn, scale: float, softmax_fp32: bool
) -> torch.Tensor:
    """megatron-core's local `DotProductAttention` in bf16/fp16, as it rounds: scores
    `baddbmm(q, k^T, alpha=scale)` in the input dtype, the causal mask filled with -10000,
    softmax in that dtype (fp32 with `attention_softmax_in_fp32`), `bmm` with v. In fp32 the
    fused `scaled_dot_product_attention` gives megatron-core's numbers already (`_attend`)."""
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


def _norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)


# --------------------------------------------------------------------------------------------
# Megatron GPT (megatron.core.models.gpt.GPTModel)
# --------------------------------------------------------------------------------------------

_MEGATRON_REFUSED = {
    "num_experts": "mixture of experts",
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
        q, k = _rotary(q, a, in_dtype=low), _rotary(k, a, in_dtype=low)
        if low:
            return self.linear_proj(_attend_megatron(q, k, v, a, self.scale, self.softmax_fp32))
        return self.linear_proj(_attend(q, k, v, a, self.scale))


def _megatron_norm(args: dict[str, Any], dim: int) -> nn.Module:
    kind = {"RMSNorm": "rms", "LayerNorm": "layer"}.get(str(args.get("normalization", "LayerNorm")))
    if kind is None:
        raise ReferenceError(f"normalization {args.get('normalization')!r}")
    if args.get("layernorm_zero_centered_gamma") or args.get("apply_layernorm_1p"):
        raise ReferenceError("zero-centred layer-norm gamma")
    return _norm(
        kind, dim, float(args.get("layernorm_epsilon") or args.get("norm_epsilon") or 1e-5)
    )


class _MegatronMLP(nn.Module):
    def __init__(self, args: dict[str, Any], fused_norm: bool) -> None:
        super().__init__()
        h, bias = args["hidden_size"], bool(args.get("add_bias_linear", True))
        ffn = int(args.get("ffn_hidden_size") or 4 * h)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.glu:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        elif self.squared_relu:
            y = F.relu(y).pow(2)
        else:
            y = F.gelu(y, approximate="tanh" if self.gelu_tanh else "none")
        return self.linear_fc2(y)


class _MegatronLayer(nn.Module):
    def __init__(self, args: dict[str, Any], a: Attn, fused_norm: bool) -> None:
        super().__init__()
        h = args["hidden_size"]
        self.input_layernorm = nn.Identity() if fused_norm else _megatron_norm(args, h)
        self.self_attention = _MegatronAttention(args, a, fused_norm)
        self.pre_mlp_layernorm = nn.Identity() if fused_norm else _megatron_norm(args, h)
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
    try:
        model = MegatronGPT(args, fused)
    except ReferenceError as e:
        raise ReferenceError(f"the reference Megatron GPT does not implement {e}") from None
    spec = "Transformer Engine names (fused layer norms)" if fused else "local spec names"
    return (
        model,
        f"reference Megatron GPT from the checkpoint's args ({spec}; megatron-core 0.19 GPTModel forward)",
    )


# --------------------------------------------------------------------------------------------
# OLMo-core Transformer (olmo_core.nn.transformer.model.Transformer)
# --------------------------------------------------------------------------------------------


def is_olmo_model_config(cfg: dict[str, Any] | None) -> bool:
    """The `model` section of an OLMo-core experiment config (`_CLASS_` names its class)."""
    return bool(cfg) and str(cfg.get("_CLASS_", "")).startswith("olmo_core.") and "block" in cfg


def _olmo_norm(cfg: dict[str, Any] | None, dim: int) -> nn.Module:
    if cfg is None:
        return nn.Identity()
    name = str(cfg.get("name", "default"))
    kind = {"rms": "rms", "fused_rms": "rms", "default": "layer"}.get(name)
    if kind is None:
        raise ReferenceError(f"layer norm {name!r}")
    return _norm(kind, dim, float(cfg.get("eps", 1e-5)), bias=bool(cfg.get("bias", True)))


class _OlmoAttention(nn.Module):
    def __init__(self, d: int, m: dict[str, Any]) -> None:
        super().__init__()
        for key in ("clip_qkv", "window_size", "gate", "scalable_softmax", "attention_sinks"):
            if m.get(key):
                raise ReferenceError(f"attention option {key}")
        n_heads = int(m["n_heads"])
        n_kv = int(m.get("n_kv_heads") or n_heads)
        head_dim = int(m.get("head_dim") or d // n_heads)
        rope = m.get("rope")
        if rope and str(rope.get("name", "default")) != "default":
            raise ReferenceError(f"RoPE {rope.get('name')!r}")
        if rope and rope.get("scaling"):
            raise ReferenceError("RoPE scaling")
        self.a = Attn(
            n_heads=n_heads,
            n_kv=n_kv,
            head_dim=head_dim,
            rope_theta=float(rope.get("theta", 500_000)) if rope else None,
            rope_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
            if rope
            else head_dim,
            rope_interleaved=False,
        )
        bias = bool(m.get("bias", True))
        self.w_q = nn.Linear(d, n_heads * head_dim, bias=bias)
        self.w_k = nn.Linear(d, n_kv * head_dim, bias=bias)
        self.w_v = nn.Linear(d, n_kv * head_dim, bias=bias)
        self.w_out = nn.Linear(n_heads * head_dim, d, bias=bias)
        self.head_norm = bool(m.get("use_head_qk_norm"))
        if m.get("qk_norm"):
            self.q_norm = _olmo_norm(
                m["qk_norm"], head_dim if self.head_norm else n_heads * head_dim
            )
            self.k_norm = _olmo_norm(m["qk_norm"], head_dim if self.head_norm else n_kv * head_dim)
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.w_q(x), self.w_k(x), self.w_v(x)
        normed = hasattr(self, "q_norm")
        if normed and not self.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.view(b, t, -1, self.a.head_dim) for z in (q, k, v))
        if normed and self.head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotary(q, self.a), _rotary(k, self.a)
        return self.w_out(_attend(q, k, v, self.a, self.scale))


class _OlmoFeedForward(nn.Module):
    def __init__(self, d: int, f: dict[str, Any]) -> None:
        super().__init__()
        if str(f.get("activation", "silu")) != "silu" or str(f.get("name", "default")) != "default":
            raise ReferenceError(f"feed-forward {f.get('name')!r} with {f.get('activation')!r}")
        hidden, bias = int(f["hidden_size"]), bool(f.get("bias", True))
        self.w1 = nn.Linear(d, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, d, bias=bias)
        self.w3 = nn.Linear(d, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _OlmoBlock(nn.Module):
    def __init__(self, d: int, blk: dict[str, Any]) -> None:
        super().__init__()
        self.kind = str(blk.get("name", "default"))
        if self.kind not in ("default", "reordered_norm"):
            raise ReferenceError(f"block {self.kind!r}")
        mixer = blk.get("sequence_mixer") or blk.get("attention")
        if not mixer or str(mixer.get("name", "default")) != "default":
            raise ReferenceError("a sequence mixer other than default attention")
        self.attention = _OlmoAttention(d, mixer)
        self.attention_norm = _olmo_norm(blk.get("layer_norm"), d)
        self.feed_forward = _OlmoFeedForward(d, blk["feed_forward"])
        self.feed_forward_norm = _olmo_norm(blk.get("layer_norm"), d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "reordered_norm":  # OLMo 2: norm the sublayer's output
            h = x + self.attention_norm(self.attention(x))
            return h + self.feed_forward_norm(self.feed_forward(h))
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.feed_forward_norm(h))


class _OlmoHead(nn.Module):
    def __init__(self, d: int, vocab: int, head: dict[str, Any]) -> None:
        super().__init__()
        if head.get("layer_norm"):
            self.norm = _olmo_norm(head["layer_norm"], d)
        self.w_out = nn.Linear(d, vocab, bias=bool(head.get("bias", True)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(self.norm(x) if hasattr(self, "norm") else x)


class OlmoTransformer(nn.Module):
    """OLMo-core's Transformer: embeddings, blocks '0'..'n-1', lm_head (norm + w_out)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        name = str(cfg.get("name", "default"))
        if name != "default":
            raise ReferenceError(f"transformer {name!r}")
        if cfg.get("block_overrides"):
            raise ReferenceError("per-block overrides")
        d, vocab = int(cfg["d_model"]), int(cfg["vocab_size"])
        self.embeddings = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleDict(
            {str(i): _OlmoBlock(d, cfg["block"]) for i in range(int(cfg["n_layers"]))}
        )
        self.lm_head = _OlmoHead(d, vocab, cfg.get("lm_head") or {})
        if cfg.get("tie_word_embeddings"):
            self.lm_head.w_out.weight = self.embeddings.weight
        scale = cfg.get("embed_scale")
        self.embed_scale = float(scale) if scale else None

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        h = self.embeddings(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(h)


def olmo_transformer(cfg: dict[str, Any]) -> tuple[nn.Module, str]:
    """The OLMo-core Transformer that an experiment config's `model` section describes."""
    try:
        model = OlmoTransformer(cfg)
    except ReferenceError as e:
        raise ReferenceError(
            f"the reference OLMo-core transformer does not implement {e}"
        ) from None
    block = cfg["block"].get("name", "default")
    return (
        model,
        f"reference OLMo-core Transformer from config.json ({block} block; OLMo-core 3.0 forward)",
    )
