"""A transformers checkpoint read under the names and layout its model has in memory.

transformers 5 keeps some weights in memory otherwise than on disk: Mixture-of-Experts blocks
hold their experts fused (one `experts.gate_up_proj` over all experts, written back as one
`experts.N.gate_proj.weight` per expert by `save_pretrained`), and families renamed since
their checkpoints were published load old keys under new names (GPT-NeoX's `embed_out` is
`lm_head`). The Trainer's `optimizer.pt` follows the model in memory. So that the diff (weights
against their optimizer state) and the replay (weights into the model) meet, the checkpoint is
presented as transformers' own loading path presents it: its conversion mapping
(`conversion_mapping.get_model_conversion_mapping`, the renames and the fusing operations
`from_pretrained` applies) on the stored tensors, one memory tensor at a time when read.
`Checkpoint.layout` keeps which stored tensors each memory tensor came from (the per-expert
names), for reports.
"""

from __future__ import annotations

import functools
import json
import logging
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import torch

from ckptforensics.formats.base import Checkpoint, TensorMeta
from ckptforensics.trainers.hf.order import param_order

if TYPE_CHECKING:
    from torch import nn

__all__ = ["meta_model", "apply_memory_layout", "model_params"]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4)
def meta_model(config_json: str) -> tuple[nn.Module | None, str]:
    """The model config.json describes, built on the meta device (no memory, no init), or
    None and why not. Cached per config: both checkpoints of a pair share it, and building
    costs the seconds of importing transformers."""
    config = json.loads(config_json)
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install 'ckptforensics[hf]')"
    try:
        cfg = transformers.AutoConfig.for_model(**config)
        archs = config.get("architectures") or []
        cls = getattr(transformers, archs[0], None) if archs else None
        with torch.device("meta"):
            model = (
                cls(cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(cfg)
            )
    except Exception as e:  # a config transformers cannot build; said in the report
        return (
            None,
            f"transformers cannot build the model from config.json ({type(e).__name__}: {e})",
        )
    return model, ""


def model_params(config: dict[str, Any]) -> tuple[list[tuple[str, tuple[int, ...]]] | None, str]:
    """(name, shape) of the model's trainable parameters in `named_parameters()` order (the
    order the Trainer's optimizer holds them in), from the model built on the meta device."""
    model, why = meta_model(json.dumps(config, sort_keys=True))
    if model is None:
        return None, why
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad], ""


def _template_matches(ckpt: Checkpoint, config: dict[str, Any]) -> bool:
    """The family's fixed parameter order (`order.param_order`, checked against transformers
    in the tests) names every stored tensor: disk and memory agree, nothing to convert."""
    order = param_order(config)
    if order is None:
        return False
    stored = set(ckpt.names()) | set(ckpt.aliases)
    return {n for n, _ in order} <= stored and len(stored) <= len(order) + 1


def apply_memory_layout(ckpt: Checkpoint) -> None:
    """Present `ckpt`'s weights under the names and layout transformers' `from_pretrained`
    gives them in memory (see the module's docstring); a no-op where the two agree, where
    there is no config, or where transformers is not installed (said in the notes)."""
    config = ckpt.config
    if not config or "model_type" not in config or _template_matches(ckpt, config):
        return
    model, why = meta_model(json.dumps(config, sort_keys=True))
    if model is None:
        log.debug("%s: weights read as stored: %s", ckpt.path, why)
        return
    groups = _groups(ckpt, model)
    if not groups:
        return
    memory = model.state_dict()
    derived: dict[str, tuple[list[str], TensorMeta, Any]] = {}
    for target, (proto, sources) in groups.items():
        meta = TensorMeta(tuple(memory[target].shape), ckpt.meta(sources[0][0]).dtype)
        derived[target] = (
            [s for s, _ in sources],
            meta,
            _loader(model, target, proto, sources),
        )
    ckpt.regroup(derived)
    fused = sum(1 for s, _, _ in derived.values() if len(s) > 1)
    ckpt.notes.append(
        f"weights read as transformers loads them: {len(derived) - fused} renamed, "
        f"{fused} fused from {sum(len(s) for s, _, _ in derived.values() if len(s) > 1)} stored tensors"
    )


def _groups(ckpt: Checkpoint, model: nn.Module) -> dict[str, tuple[Any, list[tuple[str, str]]]]:
    """Memory name -> (the converter transformers applies, or None for a rename; the stored
    names feeding it with the source pattern each matched), for stored names that change."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    try:
        conversions = get_model_conversion_mapping(model)
    except Exception:  # a mapping this transformers cannot build: the stored names stay
        log.debug("%s: no conversion mapping", ckpt.path, exc_info=True)
        return {}
    if not conversions:
        return {}
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    memory = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for name in ckpt.names():
        target, pattern = rename_source_key(name, renamings, converters, prefix, memory)
        if target not in memory or (target == name and pattern is None):
            continue
        proto = by_pattern[pattern] if pattern is not None else None
        out.setdefault(target, (proto, []))[1].append((name, pattern or name))
    return out


def _loader(model: nn.Module, target: str, proto: Any, sources: list[tuple[str, str]]) -> Any:
    """A builder for one memory tensor (`Checkpoint.regroup`): its stored tensors passed
    through a fresh copy of transformers' converter (the stacking of experts, the
    concatenation of gate and up), or the one stored tensor for a rename."""
    if proto is None:
        ((name, _),) = sources
        return lambda read: read(name)

    def build(read: Any) -> torch.Tensor:
        conv = deepcopy(proto)
        for name, pattern in sources:
            conv.add_tensor(target, name, pattern, read(name))
        got = conv.convert(target, model=model, config=model.config)[target]
        return got[0] if isinstance(got, list) else got

    return build
