"""Rebuild the model and its optimizer from a checkpoint, exactly as the trainer left them.

The model a run's recorded config describes is its framework's (`model` hook, trainers/);
transformers from a `config.json` (`trainers.config_model`) and a `--model` factory are built
for every run.
Over 400 lines: the weights and the optimizer state are read into one model with one name
map (`load_weights`, then `build_optimizer` by the same names and shards); engine/replay/session.py
takes both from here."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckptforensics.core.callables import ModelSpecError, call_factory, load_callable
from ckptforensics.core.errors import IncompatibleCheckpoints
from ckptforensics.engine.replay.distributed import local_rows
from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers import config_model, hook
from ckptforensics.trainers.base import LossNorm

__all__ = [
    "load_callable",
    "build_model",
    "call_factory",
    "load_weights",
    "ModelSpecError",
    "LossNorm",
    "trainer_loss_norm",
    "padding_rows_trained",
    "tied_padding_rows",
    "set_padding_rows",
]

log = logging.getLogger(__name__)


def build_model(spec: str | None, ckpt: Checkpoint) -> tuple[nn.Module, str]:
    """The model named by `spec`, or, when spec is None, by the config the run recorded:
    HF config.json (transformers), Megatron `args` or OLMo-core config.json (reference
    models, `replay.reference`), LitGPT model_config.yaml (litgpt), the LightningModule
    class path LightningCLI records in `hyper_parameters` (trainers/lightning).

    A factory receives the checkpoint's model config (nanoGPT `model_args`, Lightning
    hyper-parameters) as the keyword arguments its signature accepts.

    Returns:
        (model, how it was built: the call with its arguments, for `replay.config`).
    """
    if spec is None:
        built = _from_recorded_config(ckpt)
        if built is not None:
            return built
    if (
        spec is None
        or spec.endswith("config.json")
        or (Path(spec).is_dir() and (Path(spec) / "config.json").is_file())
    ):
        return config_model(
            spec, ckpt
        ), f"transformers from {'config.json' if spec is None else spec}"
    fn = load_callable(spec, "--model")
    model, desc = call_factory(fn, spec, ckpt.config)
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"--model {spec!r}: returned {type(model).__name__}, not an nn.Module")
    return model, desc


def _from_recorded_config(ckpt: Checkpoint) -> tuple[nn.Module, str] | None:
    """A model from what the run recorded, by the `model` hook of the framework that wrote
    it (trainers/: Megatron `args`, OLMo-core's config.json, LitGPT's model_config.yaml, a
    LightningCLI class path). None when it has none or it does not apply."""
    fn = hook(ckpt, "model")
    return fn(ckpt) if fn is not None else None


def trainer_loss_norm(model: nn.Module, ckpt: Checkpoint) -> LossNorm:
    """The loss normalisation the run's trainer used: the `loss_norm` hook of the framework
    that wrote `ckpt` (trainers/hf: the HF Trainer's), else the mean over target tokens."""
    fn = hook(ckpt, "loss_norm")
    found = fn(model, ckpt) if fn is not None else None
    return found or LossNorm("targets", "mean over the step's target tokens")


def _prefix_map(model_keys: list[str], ckpt_names: set[str]) -> Callable[[str], str]:
    """Model key -> checkpoint name, allowing one wrapper prefix ('model.', '_orig_mod.').

    A prefix is taken only when it maps every parameter of the model onto the checkpoint.
    """
    if not model_keys or all(k in ckpt_names for k in model_keys):
        return lambda k: k
    first = model_keys[0]
    for n in sorted(ckpt_names):
        if n.endswith("." + first):
            pre = n[: -len(first)]
            if sum(pre + k in ckpt_names for k in model_keys) > sum(
                k in ckpt_names for k in model_keys
            ):
                return lambda key, pre=pre: pre + key
    return lambda k: k


def load_weights(model: nn.Module, ckpt: Checkpoint, ranks: Any = None) -> Callable[[str], str]:
    """Load the checkpoint's weights strictly (tied weights filled from their owner).

    With `ranks` (a torchrun replay, `replay.distributed`), the model's parameters are
    FSDP2 shards: each is filled with only its rows of the stored tensor.

    Returns:
        The model-key -> checkpoint-name mapping used (for optimizer state).

    Raises:
        IncompatibleCheckpoints: missing, unexpected or mis-shaped tensors, listing the first.
    """
    sd = model.state_dict()
    names = set(ckpt.names()) | set(ckpt.aliases)
    to_ckpt = _prefix_map([k for k, _ in model.named_parameters()], names)
    ties = _model_ties(model)
    missing, shapes, new = [], [], {}
    for key, ref in sd.items():
        name = to_ckpt(key)
        src = ckpt.aliases.get(name, name)
        if src not in ckpt.names():
            if _is_derived_buffer(model, key):
                new[key] = ref
                continue
            # A weight the model ties to another (GPT-2's lm_head to wte): HF stores it once.
            twin = next(
                (
                    t
                    for t in ties.get(key, ())
                    if ckpt.aliases.get(to_ckpt(t), to_ckpt(t)) in ckpt.names()
                ),
                None,
            )
            if twin is not None:
                ckpt.aliases.setdefault(name, ckpt.aliases.get(to_ckpt(twin), to_ckpt(twin)))
                src = ckpt.aliases[name]
            else:
                missing.append(key)
                continue
        if tuple(ckpt.meta(src).shape) != tuple(ref.shape):
            shapes.append(f"{key} {list(ckpt.meta(src).shape)} vs model {list(ref.shape)}")
            continue
        if ranks is not None and hasattr(ref, "to_local"):
            _fill_shard(ref, ckpt, src, ranks)
            continue
        new[key] = ckpt.tensor(src).to(ref.dtype).clone()
    used = {ckpt.aliases.get(to_ckpt(k), to_ckpt(k)) for k in sd}
    unexpected = sorted(n for n in ckpt.names() if n not in used)
    if missing or shapes or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing in the checkpoint (first: {sorted(missing)[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} not in the model (first: {unexpected[:3]})")
        if shapes:
            parts.append(f"shape mismatch: {shapes[0]}")
        raise IncompatibleCheckpoints(f"--model does not match {ckpt.path}: " + "; ".join(parts))
    if ranks is None:
        model.load_state_dict(new, strict=True)
    else:
        with torch.no_grad():  # buffers (not sharded) and anything else read whole
            for key, t in new.items():
                sd[key].copy_(t)
    return to_ckpt


def _fill_shard(param: Any, ckpt: Checkpoint, name: str, ranks: Any) -> None:
    """Copy this rank's rows of checkpoint tensor `name` into the DTensor `param`."""

    local = local_rows(
        ranks,
        param,
        ckpt.meta(name).shape,
        lambda lo, hi: ckpt.rows(name, lo, hi),
        lambda: ckpt.tensor(name),
    )
    with torch.no_grad():
        param.to_local().copy_(local)


def _model_ties(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the other names of the same Parameter (tied weights)."""
    by_param: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(n)
    return {
        n: tuple(o for o in group if o != n)
        for group in by_param.values()
        if len(group) > 1
        for n in group
    }


def _is_derived_buffer(model: nn.Module, key: str) -> bool:
    """Non-persistent-like buffers (rotary inv_freq, causal masks) rebuilt by the model itself."""
    return key not in dict(model.named_parameters()) and key.endswith(
        ("inv_freq", "attn.bias", "masked_bias", "position_ids")
    )


def padding_rows_trained(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Embeddings whose padding row (`padding_idx`, a row whose gradient is always zeroed)
    is not the one config.json names, read from the data. transformers' Trainer aligns
    `config.pad_token_id` with the tokenizer's pad id after the model's embedding was built
    (`align_special_tokens`), so a saved config can name a row the run never froze and miss
    the one it did. The run's padding row is the one whose weights are still the zeros
    `nn.Embedding` starts it with and whose second moment never saw a gradient; where exactly
    one row is, it is the padding row; where none is and the named row trained, there is
    none. An embedding tied to the output head is left as built: the head's gradient reaches
    every row, the padding row included, so a trained second moment there says nothing about
    the lookup (held-out draw 9545: a tied Llama built with pad id 0, replayed unpadded, missed
    *after* on 24% of elements). The changes are returned for `replay.config`. One process
    only (a sharded row lives on one rank)."""
    fixed = []
    ties = _model_ties(model)
    for name, m in model.named_modules():
        if not isinstance(m, nn.Embedding) or _tied_embedding(ties, name):
            continue
        v = (opt.state.get(m.weight) or {}).get("exp_avg_sq")
        if (
            not isinstance(v, torch.Tensor)
            or hasattr(v, "to_local")
            or v.dim() != 2
            or v.shape != m.weight.shape
        ):
            continue
        frozen = (
            torch.nonzero((v.abs().sum(1) == 0) & (m.weight.detach().abs().sum(1) == 0))
            .flatten()
            .tolist()
        )
        was = m.padding_idx
        if len(frozen) == 1:
            m.padding_idx = frozen[0]
        elif was is not None and bool(v[was].abs().sum() > 0):
            m.padding_idx = None
        if m.padding_idx != was:
            fixed.append(f"{name} {was} -> {m.padding_idx}")
    return fixed


def _tied_embedding(ties: dict[str, tuple[str, ...]], name: str) -> bool:
    """Whether the embedding module `name` shares its weight (`_model_ties`) with another."""
    return (f"{name}.weight" if name else "weight") in ties


def tied_padding_rows(model: nn.Module) -> dict[str, int]:
    """Embeddings tied to an output head that zero a padding row, by module name: whether the
    run zeroed that row's lookup gradient is not in its moments (the head trains the row
    anyway), so the replay asks the log (`settle.settle_padding`)."""
    ties = _model_ties(model)
    return {
        name: m.padding_idx
        for name, m in model.named_modules()
        if isinstance(m, nn.Embedding) and _tied_embedding(ties, name) and m.padding_idx is not None
    }


def set_padding_rows(model: nn.Module, rows: dict[str, int | None]) -> None:
    """Give the named embeddings these padding rows (None: no padding row)."""
    for name, m in model.named_modules():
        if name in rows and isinstance(m, nn.Embedding):
            m.padding_idx = rows[name]
