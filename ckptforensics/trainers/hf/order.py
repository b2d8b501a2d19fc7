"""`named_parameters()` order of common HF causal-LM families, from config.json alone.

The Trainer saves `optimizer.pt` with integer ids in `named_parameters()` order (no names),
and safetensors files list tensors sorted, not in module order; building the model with
transformers to learn the order costs seconds of import. For the families below the order
is fixed by the modeling code and written out here; `tests/test_hf_order.py` checks every
template against transformers' own model for several configs (tied/untied, GQA, biases).
Anything else (or any template whose names and shapes do not match the checkpoint's
weights) falls back to building the model with transformers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["param_order"]

Param = tuple[str, tuple[int, ...]]


def param_order(config: dict[str, Any]) -> list[Param] | None:
    """(name, shape) per trainable parameter in `named_parameters()` order, or None when
    the family has no template here."""
    kind = config.get("model_type")
    archs = config.get("architectures") or []
    if kind in ("llama", "mistral", "qwen2") and (not archs or archs[0].endswith("ForCausalLM")):
        return _llama(config, qkv_bias=kind == "qwen2")
    if kind == "gpt2" and (not archs or archs[0] == "GPT2LMHeadModel"):
        return _gpt2(config)
    return None


def _tied(config: dict[str, Any], default: bool) -> bool:
    return bool(config.get("tie_word_embeddings", default))


def _llama(c: dict[str, Any], qkv_bias: bool) -> list[Param] | None:
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    attn_bias = bool(c.get("attention_bias", False))
    mlp_bias = bool(c.get("mlp_bias", False))
    if c.get("model_type") == "qwen2" and attn_bias:
        return None  # Qwen2 has no attention_bias switch: its q/k/v always carry a bias
    out: list[Param] = [("model.embed_tokens.weight", (v, h))]
    for i in range(n):
        p = f"model.layers.{i}."
        for name, shape, bias in (
            ("self_attn.q_proj", (heads * hd, h), attn_bias or qkv_bias),
            ("self_attn.k_proj", (kv * hd, h), attn_bias or qkv_bias),
            ("self_attn.v_proj", (kv * hd, h), attn_bias or qkv_bias),
            ("self_attn.o_proj", (h, heads * hd), attn_bias),
            ("mlp.gate_proj", (inter, h), mlp_bias),
            ("mlp.up_proj", (inter, h), mlp_bias),
            ("mlp.down_proj", (h, inter), mlp_bias),
        ):
            out.append((f"{p}{name}.weight", shape))
            if bias:
                out.append((f"{p}{name}.bias", (shape[0],)))
        out += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not _tied(c, False):
        out.append(("lm_head.weight", (v, h)))
    return out


def _gpt2(c: dict[str, Any]) -> list[Param]:
    h, v, n = c.get("n_embd", 768), c.get("vocab_size", 50257), c.get("n_layer", 12)
    pos = c.get("n_positions", 1024)
    inner = c.get("n_inner") or 4 * h
    out: list[Param] = [("transformer.wte.weight", (v, h)), ("transformer.wpe.weight", (pos, h))]
    for i in range(n):
        p = f"transformer.h.{i}."
        out += [
            (f"{p}ln_1.weight", (h,)), (f"{p}ln_1.bias", (h,)),
            (f"{p}attn.c_attn.weight", (h, 3 * h)), (f"{p}attn.c_attn.bias", (3 * h,)),
            (f"{p}attn.c_proj.weight", (h, h)), (f"{p}attn.c_proj.bias", (h,)),
            (f"{p}ln_2.weight", (h,)), (f"{p}ln_2.bias", (h,)),
            (f"{p}mlp.c_fc.weight", (h, inner)), (f"{p}mlp.c_fc.bias", (inner,)),
            (f"{p}mlp.c_proj.weight", (inner, h)), (f"{p}mlp.c_proj.bias", (h,)),
        ]  # fmt: skip
    out += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
    if not _tied(c, True):
        out.append(("lm_head.weight", (v, h)))
    return out
