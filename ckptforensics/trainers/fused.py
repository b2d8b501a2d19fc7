"""Fused tensors named by what they compute: which part of a fused norm-linear, QKV or gate-up
weight an element belongs to (the norm; q, k or v and its head; gate or up).

A finding that points at rows of `linear_qkv.weight` means little until it says "k of query
group 1"; where the rows fall depends on the layout the model's own code splits them by:

- Megatron's `linear_qkv` (`attention.py`, `get_query_key_value_tensors`): output units
  interleaved per query group, `[ng, (np/ng + 2) * hn]`: each group's query heads, its key,
  its value;
- GPT-NeoX's `query_key_value`: interleaved per head, `[np, 3 * hn]` (q, k, v of each head);
  Falcon's, by its config: grouped as Megatron's (`new_decoder_architecture`), concatenated
  with one key and value head (`multi_query`), else per head as GPT-NeoX's;
- HF's concatenated layouts: Phi-3's `qkv_proj` `[q (np*hn); k (ng*hn); v (ng*hn)]`, GPT-2's
  `c_attn` (a `Conv1D`: its output units are the weight's columns) `[q; k; v]`;
- gate-up: Phi-3's `gate_up_proj` and Megatron's `linear_fc1` with SwiGLU, `[gate; up]`
  (both `chunk(2)`, the first half through the activation);
- a norm fused into the next projection (Transformer Engine's `LayerNormLinear`, Megatron's
  `layer_norm_weight` / `layer_norm_bias`) is that norm.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Heads",
    "FusedLayout",
    "LAYOUTS",
    "layout_for",
    "part_of",
    "computes",
    "heads_from_config",
    "experts_from_config",
]


@dataclass(frozen=True, slots=True)
class Heads:
    """Attention's shape as the model's config states it.

    Attributes:
        n_heads: query heads.
        n_kv: key/value heads (query groups); `n_heads` without GQA.
        head_dim: channels per head.
        glu: the MLP's first projection is a fused [gate; up] (SwiGLU, GeGLU).
        qkv: how the model's own code splits its fused QKV where the config decides it
            ('grouped', 'per_head', 'concat'; Falcon's three architectures); None: the
            layout the tensor's name implies.
    """

    n_heads: int
    n_kv: int
    head_dim: int
    glu: bool = False
    qkv: str | None = None


@dataclass(frozen=True, slots=True)
class FusedLayout:
    """One fused tensor kind: which parameter names carry it and how an output unit maps to
    its part.

    Attributes:
        kind: 'norm', 'qkv' or 'gate_up'.
        suffixes: parameter-name endings that carry it (`.linear_qkv.weight`).
        unit_dim: the weight's dim that holds the output units (1 for a `Conv1D`).
        part: (output unit, units, heads) -> part name; None where the config does not say
            how the tensor splits (a `linear_fc1` without SwiGLU, a shape the heads do not give).
    """

    kind: str
    suffixes: tuple[str, ...]
    unit_dim: int
    part: Callable[[int, int, Heads | None], str | None]


def _qkv(split: Callable[[int, Heads], str]) -> Callable[[int, int, Heads | None], str | None]:
    """A QKV split (the config's, else the name's), applied only where the tensor has the
    units this config gives q, k and v."""

    def part(u: int, units: int, h: Heads | None) -> str | None:
        if h is None or units != (h.n_heads + 2 * h.n_kv) * h.head_dim or h.n_heads % h.n_kv:
            return None
        return _SPLITS.get(h.qkv or "", split)(u, h)

    return part


def _megatron_qkv(u: int, h: Heads) -> str:
    """[ng, (np/ng + 2) * hn]: each query group's heads, then its key, then its value."""
    per = h.n_heads // h.n_kv
    g, r = divmod(u, (per + 2) * h.head_dim)
    slot = r // h.head_dim
    if slot < per:
        return f"q (head {g * per + slot}, query group {g})"
    return f"{'k' if slot == per else 'v'} (query group {g})"


def _neox_qkv(u: int, h: Heads) -> str:
    """[np, 3 * hn]: each head's q, k, v in turn."""
    head, r = divmod(u, 3 * h.head_dim)
    return f"{'qkv'[r // h.head_dim]} (head {head})"


def _concat_qkv(u: int, h: Heads) -> str:
    """[q (np*hn); k (ng*hn); v (ng*hn)]."""
    q, kv = h.n_heads * h.head_dim, h.n_kv * h.head_dim
    if u < q:
        return f"q (head {u // h.head_dim})"
    part, off = ("k", u - q) if u < q + kv else ("v", u - q - kv)
    return f"{part} (head {off // h.head_dim})"


# The QKV splits a config may name (`Heads.qkv`).
_SPLITS: dict[str, Callable[[int, Heads], str]] = {
    "grouped": _megatron_qkv,
    "per_head": _neox_qkv,
    "concat": _concat_qkv,
}


def _gate_up(needs_glu: bool) -> Callable[[int, int, Heads | None], str | None]:
    """[gate; up], `chunk(2)`: the first half goes through the activation. A name that says
    gate-up is enough; Megatron's `linear_fc1` is fused only with `--swiglu`."""

    def part(u: int, units: int, h: Heads | None) -> str | None:
        if units % 2 or (needs_glu and (h is None or not h.glu)):
            return None
        return "gate" if u < units // 2 else "up"

    return part


# Known fused tensors, by the names their frameworks give them.
LAYOUTS: tuple[FusedLayout, ...] = (
    FusedLayout("norm", (".layer_norm_weight", ".layer_norm_bias"), 0, lambda *_: "norm"),
    FusedLayout("qkv", (".linear_qkv.weight", ".linear_qkv.bias"), 0, _qkv(_megatron_qkv)),
    FusedLayout("qkv", (".query_key_value.weight", ".query_key_value.bias"), 0, _qkv(_neox_qkv)),
    FusedLayout("qkv", (".qkv_proj.weight", ".qkv_proj.bias"), 0, _qkv(_concat_qkv)),
    # GPT-2's `c_attn` is a Conv1D (units on dim 1), nanoGPT's an nn.Linear (dim 0): the dim
    # whose size is q + k + v decides (a [C, 3C] weight cannot fit both).
    FusedLayout("qkv", (".c_attn.weight",), 1, _qkv(_concat_qkv)),
    FusedLayout("qkv", (".c_attn.weight", ".c_attn.bias"), 0, _qkv(_concat_qkv)),
    FusedLayout("gate_up", (".gate_up_proj.weight", ".gate_up_proj.bias"), 0, _gate_up(False)),
    FusedLayout("gate_up", (".linear_fc1.weight", ".linear_fc1.bias"), 0, _gate_up(True)),
)


def layout_for(name: str) -> FusedLayout | None:
    """The fused layout a parameter name carries, if any."""
    return next((f for f in LAYOUTS if name.endswith(f.suffixes)), None)


def part_of(
    name: str, index: tuple[int, ...], shape: tuple[int, ...], heads: Heads | None
) -> str | None:
    """The part of fused tensor `name` that element `index` belongs to.

    Args:
        name: the parameter's checkpoint name.
        index: the element's position (unravelled).
        shape: the tensor's shape.
        heads: the model's attention shape (`heads_from_config`; None: the norm and gate-up
            parts only).

    Returns:
        'norm', 'q (head 3)', 'k (query group 1)', 'gate', 'up', ...; None for a tensor that is
        not fused or whose config does not say how it splits.

    Example:
        >>> part_of("decoder.layers.0.self_attention.linear_qkv.weight", (48, 0), (64, 32),
        ...         Heads(n_heads=4, n_kv=2, head_dim=8))
        'k (query group 1)'
    """
    for lay in LAYOUTS:
        if name.endswith(lay.suffixes) and len(index) > lay.unit_dim < len(shape):
            part = lay.part(index[lay.unit_dim], shape[lay.unit_dim], heads)
            if part is not None:
                return part
    return None


# What each fused kind computes, in the words a finding uses.
_COMPUTES = {"norm": "norm", "qkv": "q, k, v projections", "gate_up": "gate, up projections"}


def computes(module: str, params: Iterable[str], heads: Heads | None = None) -> str | None:
    """What a fused module computes, from its own parameters' names: 'norm fused with the
    q, k, v projections' for Megatron's TE-layout `linear_qkv`, 'q, k, v projections' for
    GPT-2's `c_attn`; None for a module that fuses nothing.

    A `linear_fc1` is a gate-up pair only under SwiGLU (`heads.glu`)."""
    kinds: list[str] = []
    for n in sorted(params):
        if not n.startswith(module + ".") or "." in n[len(module) + 1 :]:
            continue  # not this module's own parameter
        lay = layout_for(n)
        if lay is None or lay.kind in kinds:
            continue
        if lay.kind == "gate_up" and n.endswith(".linear_fc1.weight") and not (heads and heads.glu):
            continue
        kinds.append(lay.kind)
    if not kinds:
        return None
    words = [_COMPUTES[k] for k in sorted(kinds, key=list(_COMPUTES).index)]
    if words == ["norm"]:  # TE's LayerNormLinear ahead of a plain projection
        return "norm fused with the projection"
    return words[0] if len(words) == 1 else f"{words[0]} fused with the {words[1]}"


def _int(cfg: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def experts_from_config(cfg: dict[str, Any] | None) -> int | None:
    """The routed experts of a MoE layer as an HF `config.json` (`num_experts`: Qwen-MoE,
    OLMoE; `num_local_experts`: Mixtral, gpt-oss; `n_routed_experts`: DeepSeek) or Megatron's
    `args` (`num_experts`) state it; None for a dense model or a config that does not say."""
    return _int(cfg, "num_experts", "num_local_experts", "n_routed_experts") if cfg else None


def heads_from_config(cfg: dict[str, Any] | None) -> Heads | None:
    """The attention shape an HF `config.json` or Megatron's `args` state (None: not stated).

    Megatron: `num_attention_heads`, `num_query_groups` (with `group_query_attention`),
    `kv_channels`, `swiglu`; HF: `num_attention_heads` / `n_head`, `num_key_value_heads`,
    `head_dim`, and a gated MLP where its fused gate-up is named (`gate_up_proj`).
    """
    if not cfg:
        return None
    n = _int(cfg, "num_attention_heads", "n_head", "num_heads")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    if n is None or hidden is None:
        return None
    if "padded_vocab_size" in cfg:  # Megatron's args
        kv = _int(cfg, "num_query_groups") if cfg.get("group_query_attention") else None
        hd = _int(cfg, "kv_channels") or hidden // n
        return Heads(n, kv or n, hd, bool(cfg.get("swiglu")))
    kv = _int(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads") or n
    hd = _int(cfg, "head_dim") or hidden // n
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or "")
    glu = "glu" in act or str(cfg.get("model_type")) in ("phi3", "phimoe")
    qkv = None
    if cfg.get("model_type") == "falcon":  # one name, three layouts (`FalconAttention`)
        if cfg.get("new_decoder_architecture"):
            qkv, kv = "grouped", _int(cfg, "num_kv_heads", "n_head_kv") or n
        elif cfg.get("multi_query", True):
            qkv, kv = "concat", 1
        else:
            qkv, kv = "per_head", n
    return Heads(n, kv, hd, glu, qkv)
