"""OLMo-core Transformer (olmo_core.nn.transformer.model.Transformer): OLMo-core 3.0's
forward with the default or the reordered-norm block."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptforensics.trainers.layers import Attn, ReferenceError, attend, norm, rotary


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
    return norm(kind, dim, float(cfg.get("eps", 1e-5)), bias=bool(cfg.get("bias", True)))


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
        q, k = rotary(q, self.a), rotary(k, self.a)
        return self.w_out(attend(q, k, v, self.a, self.scale))


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
