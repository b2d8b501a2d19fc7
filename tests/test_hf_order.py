"""The HF parameter-order templates equal transformers' own `named_parameters()`."""

from __future__ import annotations

import json

import pytest
import torch

from ckptforensics.trainers.hf.order import param_order

transformers = pytest.importorskip("transformers")

CONFIGS = [
    (
        "LlamaForCausalLM",
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "tie_word_embeddings": False,
        },
    ),
    (
        "LlamaForCausalLM",
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "vocab_size": 64,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    (
        "LlamaForCausalLM",
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "vocab_size": 64,
        },
    ),
    (
        "MistralForCausalLM",
        {
            "model_type": "mistral",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "vocab_size": 64,
        },
    ),
    (
        "Qwen2ForCausalLM",
        {
            "model_type": "qwen2",
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
            "tie_word_embeddings": True,
        },
    ),
    (
        "GPT2LMHeadModel",
        {
            "model_type": "gpt2",
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 64,
            "n_positions": 16,
        },
    ),
    (
        "GPT2LMHeadModel",
        {
            "model_type": "gpt2",
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 4,
            "vocab_size": 64,
            "n_positions": 16,
            "n_inner": 40,
            "tie_word_embeddings": False,
        },
    ),
]


@pytest.mark.parametrize(
    ("arch", "config"), CONFIGS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CONFIGS)]
)
def test_template_equals_the_model_transformers_builds(arch: str, config: dict) -> None:
    config = {**config, "architectures": [arch]}
    cfg = transformers.AutoConfig.for_model(**json.loads(json.dumps(config)))
    with torch.device("meta"):
        model = getattr(transformers, arch)(cfg)
    want = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    assert param_order(config) == want


def test_unknown_families_have_no_template() -> None:
    assert param_order({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}) is None
