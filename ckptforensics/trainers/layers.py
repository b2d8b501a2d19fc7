"""What the reference forwards share: attention's shape, RoPE, causal attention, the norms,
and the error that refuses an option by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


def rotary(x: torch.Tensor, a: Attn, in_dtype: bool = False) -> torch.Tensor:
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


def attend(
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


def norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(dim, eps=eps)
    return nn.LayerNorm(dim, eps=eps, bias=bias)
