"""Reference models for runs whose framework cannot run here: Megatron GPT and OLMo-core.

Megatron-core needs CUDA and OLMo-core is rarely installed beside the tool, yet the run
recorded everything needed to rebuild the network: Megatron's `args`, OLMo-core's experiment
`config.json`. These modules follow each framework's forward pass (megatron-core 0.19
`GPTModel` with the local or Transformer-Engine layer spec; OLMo-core 3.0 `Transformer` with
the default or reordered-norm block) and carry its parameter names, so the checkpoint loads
strictly. Faithfulness is not assumed: every replay compares itself with *after*, and the
fixtures of both frameworks replay onto their *after* (tests/test_real_formats.py). An option
this code does not implement is refused by name, never approximated.

One module a framework: `megatron` (`megatron_gpt`), `olmo` (`olmo_transformer`), over
`layers` (what both forwards share: RoPE, causal attention, the norms, `ReferenceError`).
"""

from __future__ import annotations

from ckptforensics.trainers.layers import Attn as Attn
from ckptforensics.trainers.layers import ReferenceError
from ckptforensics.trainers.megatron.model import MegatronGPT as MegatronGPT
from ckptforensics.trainers.megatron.model import is_megatron_args, megatron_gpt
from ckptforensics.trainers.olmo_core.model import OlmoTransformer as OlmoTransformer
from ckptforensics.trainers.olmo_core.model import is_olmo_model_config, olmo_transformer

__all__ = [
    "ReferenceError",
    "megatron_gpt",
    "olmo_transformer",
    "is_megatron_args",
    "is_olmo_model_config",
]
