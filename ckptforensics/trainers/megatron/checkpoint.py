"""Megatron-LM checkpoints: legacy `iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt`,
and torch_dist (`iter_NNNNNNN/` = a DCP directory + `metadata.json` + `common.pt`; MoE
experts one tensor per expert, `trainers/megatron/experts.py`).

Over 400 lines: one format's reader, both its layouts (legacy and torch_dist) and their
arguments; formats/ keeps one module per format.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import (
    CorruptCheckpoint,
    OptimizerMappingError,
)
from ckptforensics.formats.base import (
    Checkpoint,
    LazyState,
    OptimizerView,
    TensorMeta,
)
from ckptforensics.formats.dcp import DcpStore, getter, read_metadata
from ckptforensics.formats.inert import InertRecord, register_safe_globals
from ckptforensics.formats.optstate import group_hyper, optimizer_kind
from ckptforensics.formats.statedict import (
    add_state_dict,
    attach_optimizer,
    scaler_scalars,
    to_plain,
)
from ckptforensics.formats.torchfile import load_torch_file
from ckptforensics.trainers.megatron.experts import (
    EXPERTS,
    expert_count,
    experts_in_order,
    split_experts,
)

__all__ = [
    "is_megatron_dir",
    "open_megatron",
    "is_megatron_dist_dir",
    "open_megatron_dist",
    "iter_of",
    "TRACKER",
]

TRACKER = "latest_checkpointed_iteration.txt"

log = logging.getLogger(__name__)


# Enums in Megatron's `args` (every real save has them; `signal.Signals` is exit_signal),
# admitted as inert records by the restricted unpickler.
register_safe_globals(
    [
        ("megatron.core.enums", "ModelType", InertRecord),
        ("megatron.core.transformer.enums", "AttnBackend", InertRecord),
        ("megatron.core.transformer.enums", "AttnMaskType", InertRecord),
        ("megatron.core.transformer.enums", "InferenceCudaGraphScope", InertRecord),
        ("megatron.core.transformer.enums", "CudaGraphScope", InertRecord),
        ("megatron.core.rerun_state_machine", "RerunMode", InertRecord),
        ("megatron.core.rerun_state_machine", "RerunState", InertRecord),
        ("signal", "Signals", InertRecord),
    ]
)


def _rank_files(path: Path) -> list[Path]:
    return sorted(path.glob("mp_rank_*/model_optim_rng.pt"))


def _plain(v: object) -> bool:
    """An args value kept in `config`: scalars, and lists of strings (`--data-path`)."""
    return (
        isinstance(v, (int, float, str, bool))
        or v is None
        or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))
    )


def is_megatron_dir(path: Path) -> bool:
    """An `iter_N/` with `mp_rank_*/` rank dirs (even a rank dir whose file is missing)."""
    return path.is_dir() and (
        bool(_rank_files(path)) or any(d.is_dir() for d in path.glob("mp_rank_*"))
    )


def open_megatron(path: Path) -> Checkpoint:
    """The first model-parallel rank of a legacy Megatron checkpoint.

    `args` (an argparse.Namespace) loads as an inert record. With tensor or pipeline
    parallelism each rank holds a shard; only `mp_rank_00` is read, and the report says
    so. Moments kept by the distributed optimizer (`distrib_optim.pt`, flat buckets)
    are not mapped: the limitation is stated rather than guessed around.
    """
    files = _rank_files(path)
    obj, mapped = load_torch_file(files[0])
    if not isinstance(obj, dict) or "model" not in obj:
        raise CorruptCheckpoint(f"{files[0]}: Megatron checkpoint without 'model'")
    ckpt = Checkpoint(path=path, format="megatron", file_backed=mapped)
    model = obj["model"]
    if (
        isinstance(model, dict)
        and "language_model" in model
        and not any(hasattr(v, "shape") for v in model.values())
    ):
        model = _flatten(model)
    add_state_dict(ckpt, model)
    if "iteration" in obj:
        ckpt.scalars["global_step"] = int(obj["iteration"])
    _read_args(ckpt, obj.get("args"))
    if len(files) > 1:
        ckpt.notes.append(
            f"{len(files)} model-parallel ranks: only {files[0].parent.name} is read (a shard of each split tensor)"
        )
    opt = obj.get("optimizer")
    # fp16/bf16 runs wrap the torch state dict (`optimizer.optimizer`, grad_scaler, fp32
    # copies); an fp32 run saves the torch optimizer's state dict itself.
    inner = (
        (opt.get("optimizer") if isinstance(opt.get("optimizer"), dict) else opt)
        if isinstance(opt, dict)
        else None
    )
    if isinstance(opt, dict):
        ckpt.scalars.update(scaler_scalars(opt.get("grad_scaler")))
    if list(files[0].parent.glob("distrib_optim.pt")):
        ckpt.notes.append(
            "distributed optimizer (distrib_optim.pt): moments are flat buckets and are not mapped to parameters"
        )
    elif isinstance(inner, dict) and inner.get("state"):
        attach_optimizer(ckpt, inner, f"{files[0]}:optimizer")
        if isinstance(opt, dict) and opt.get("fp32_from_fp16_params"):
            _main_params_as_weights(
                ckpt,
                _legacy_main_params(ckpt, inner, opt["fp32_from_fp16_params"], files[0]),
                "fp32_from_fp16_params",
            )
    else:
        ckpt.notes.append("no optimizer state: weights only")
    sched = obj.get("opt_param_scheduler")
    if isinstance(sched, dict):
        ckpt.scalars["scheduler"] = to_plain(
            {k: v for k, v in sched.items() if isinstance(v, (int, float))}
        )
    return ckpt


def _flatten(d: dict, prefix: str = "") -> dict:
    """Older Megatron nests `model.language_model.encoder...`: flatten to dotted names."""
    out = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


# ------------------------------------------------------------------ torch_dist
def is_megatron_dist_dir(path: Path) -> bool:
    """A DCP directory whose `metadata.json` names Megatron's torch_dist backend."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        # metadata.json is the last file Megatron writes: an iteration dir holding DCP
        # files without it is a torch_dist save that did not finish.
        return re.match(r"^iter_\d+$", path.name) is not None and (
            (path / ".metadata").exists() or any(path.glob("*.distcp"))
        )
    # Without `.metadata` (a save that died before DCP's coordinator wrote it) it is still
    # Megatron's: `megatron_dist_completeness` then says what is missing.
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist"


_NO_DECAY = re.compile(r"bias$|norm|layer_norm")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)")  # stacked: no layer index in the key


def open_megatron_dist(path: Path) -> Checkpoint:
    """Megatron-core torch_dist: tensors by their sharded keys (per-layer parameters
    stacked on a leading num_layers dim, MoE experts on the next: `trainers.megatron.experts`),
    moments under `optimizer.state.<field>.<key>`.

    The distributed optimizer's bucket format (`optimizer.distributed...bucket_idx...`)
    stores moments as flat per-bucket buffers; mapping them back needs Megatron's bucket
    layout, so it is refused with an error that says so rather than guessed.
    """

    md = read_metadata(path)
    store = DcpStore(path, md)
    ckpt = Checkpoint(path=path, format="megatron-dist")
    common = _common(path, store)
    layers = _stacked_layers(md, common)
    experts = expert_count(md, getattr(common.get("args"), "num_experts", None), layers)
    stacked = _StackCache(store)
    state: dict[str, dict[str, Any]] = {}
    buckets: dict[tuple[str, int], dict[str, str]] = {}
    for key, meta in md.state_dict_metadata.items():
        if key.startswith("optimizer.state."):
            field, _, fqn = key[len("optimizer.state.") :].partition(".")
            for name, get, _ in _views(fqn, key, layers, experts, stacked):
                state.setdefault(name, {})[field] = get
        elif (m := _BUCKET.match(key)) is not None:
            buckets.setdefault((m.group("buf"), int(m.group("idx"))), {})[m.group("field")] = key
        elif hasattr(meta, "size") and not key.startswith(("optimizer.", "rng_state")):
            shape = tuple(meta.size)
            for name, get, lead in _views(key, key, layers, experts, stacked):
                ckpt.add_tensor(name, TensorMeta(shape[lead:], meta.properties.dtype), get)
    dist_groups: list[dict[str, Any]] = []
    if buckets:
        state = _unflatten_buckets(path, md, ckpt, buckets, stacked, layers)
        shard = next((store.value(k) for k in md.state_dict_metadata if _DIST_OPT.match(k)), None)
        shard = shard[0] if isinstance(shard, list) and shard else shard
        dist_groups = [g for g in (shard or {}).get("param_groups") or [] if isinstance(g, dict)]
        ckpt.notes.append(
            "distributed optimizer (dp_reshardable buckets): moments unflattened per parameter in the grad buffer's reverse order, starts padded to 64 elements"
        )
    it = common.get("iteration")
    step = int(it) if isinstance(it, (int, float)) else iter_of(path)
    if step is not None:
        ckpt.scalars["global_step"] = step
    _read_args(ckpt, common.get("args"))
    # bf16/fp16: the fp32 main params (`optimizer.state.fp32_param.*`; the distributed
    # optimizer's bucket `param`) are what the optimizer steps.
    masters = {n: st.pop(_MAIN) for n, st in state.items() if _MAIN in st}
    _main_params_as_weights(
        ckpt,
        masters,
        "optimizer.state.fp32_param" if not buckets else "the distributed optimizer's bucket param",
    )
    opt = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    ckpt.scalars.update(scaler_scalars(opt.get("grad_scaler")))
    inner = opt.get("optimizer") if isinstance(opt.get("optimizer"), dict) else opt
    groups = dist_groups or [g for g in inner.get("param_groups") or [] if isinstance(g, dict)]
    common_step = (
        (inner.get("state") or {}).get("common_step")
        if isinstance(inner.get("state"), dict)
        else None
    )
    if common_step is not None:  # megatron-core 0.19's plain optimizer: one step for all
        for g in groups:
            g.setdefault("step", float(common_step))
    if layers:
        ckpt.notes.append(
            f"torch_dist: per-layer tensors are stacked on a leading dim of {layers} layers; read as decoder.layers.<i>.<name>"
        )
    if experts:
        log.debug("%s: %d experts per MoE layer, read one tensor per expert", path, experts)
        ckpt.scalars["moe_experts"] = experts
        ckpt.notes.append(
            f"torch_dist: MoE expert tensors (`<mlp>.experts.experts.<param>`) hold {experts} experts on the dim after the layers' "
            "(their global index); read one per expert as <mlp>.experts.local_experts.<e>.<param>, SequentialMLP's names"
        )
    if state:
        ckpt.optimizer = _dist_optimizer(state, groups, ckpt.names())
    else:
        ckpt.notes.append("no optimizer state: weights only")
    return ckpt


_MAIN = "fp32_param"  # megatron-core's prefix for the main params: optimizer.state.fp32_param.<key>

# The args that say how a Megatron run computes, accumulates and steps (megatron/training/
# arguments.py; validate_args fills the dtypes): kept as plain values in train_config.
_PRECISION_ARGS = (
    "bf16",
    "fp16",
    "fp8",
    "params_dtype",
    "main_params_dtype",
    "main_grads_dtype",
    "accumulate_allreduce_grads_in_fp32",
    "grad_reduce_in_bf16",
    "use_distributed_optimizer",
    "use_precision_aware_optimizer",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "loss_scale",
    "attention_softmax_in_fp32",
    "fp16_lm_cross_entropy",
)


def _read_args(ckpt: Checkpoint, args: Any) -> None:
    """`args` (an argparse.Namespace): plain values into `config`; what the replay and the
    planners read into `train_config`, with the precision policy the run trained in."""
    if args is None or not hasattr(args, "__dict__"):
        return
    a = {k: v for k, v in vars(args).items() if _plain(v)}
    ckpt.config = a
    raw = vars(args)
    policy = {
        k: (str(raw[k]) if isinstance(raw[k], torch.dtype) else raw[k])
        for k in _PRECISION_ARGS
        if k in raw and (_plain(raw[k]) or isinstance(raw[k], torch.dtype))
    }
    ckpt.scalars["train_config"] = {
        "grad_clip": a.get("clip_grad"),
        "learning_rate": a.get("lr"),
        "warmup_iters": a.get("lr_warmup_iters"),
        "megatron": True,
        "bf16": a.get("bf16"),
        "fp16": a.get("fp16"),
        "megatron_precision": policy,
        "micro_batch_size": a.get("micro_batch_size"),
    }


def _main_params_as_weights(
    ckpt: Checkpoint, masters: dict[str, Callable[[], Any]], where: str
) -> None:
    """bf16/fp16 runs (Float16OptimizerWithFloat16Params, DistributedOptimizer): the
    optimizer steps fp32 main params and copies them into the model's bf16/fp16 weights, so
    the model's weights are the main params' rounding and the main params are what the run
    continued from. They are read as the weights (a replay steps them as the run did)."""
    low = [
        n for n in masters if ckpt.has(n) and ckpt.meta(n).dtype in (torch.bfloat16, torch.float16)
    ]
    if not low:
        return
    dtype = ckpt.meta(low[0]).dtype
    for n in low:
        ckpt.add_tensor(n, TensorMeta(ckpt.meta(n).shape, torch.float32), masters[n])
    ckpt.scalars["fp32_masters"] = True
    ckpt.notes.append(
        f"weights are the optimizer's fp32 main params ({where}); the model holds their {str(dtype).removeprefix('torch.')} rounding"
    )


def _legacy_main_params(
    ckpt: Checkpoint, osd: dict[str, Any], groups: list[Any], source: Path
) -> dict[str, Callable[[], Any]]:
    """`fp32_from_fp16_params[g][i]` is the main param of `param_groups[g]["params"][i]`;
    the ids are named by the optimizer mapping (whose per-name state is the saved id's
    state), and each main param's shape is checked against its name's."""
    view = ckpt.optimizer
    if view is None:
        ckpt.notes.append("fp32 main params not read: the optimizer ids are not mapped to names")
        return {}
    name_of_state = {id(st): n for n, st in view.state.items()}
    out: dict[str, Callable[[], Any]] = {}
    for g, mains in zip(osd.get("param_groups") or [], groups, strict=False):
        for pid, t in zip(g.get("params") or [], mains or [], strict=False):
            name = name_of_state.get(id((osd.get("state") or {}).get(pid)))
            if name is None or not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) != tuple(ckpt.meta(name).shape):
                raise OptimizerMappingError(
                    f"{source}: fp32 main param of {name} has shape {tuple(t.shape)}, the weight {tuple(ckpt.meta(name).shape)}"
                )
            out[name] = lambda t=t: t
    return out


def _stacked_layers(md: Any, common: dict[str, Any]) -> int:
    """Layers stacked on the leading dim of `decoder.layers.*` tensors: `args.num_layers`
    when it matches every such tensor, else their common leading dim (0: not stacked)."""
    lead = {
        tuple(m.size)[0]
        for k, m in md.state_dict_metadata.items()
        if _STACKED.match(k) and hasattr(m, "size") and len(m.size) >= 1
    }
    n = getattr(common.get("args"), "num_layers", None)
    if isinstance(n, int) and lead == {n}:
        return n
    return next(iter(lead)) if len(lead) == 1 else 0


class _StackCache:
    """The last few stacked tensors read: per-layer views are read in order, so each
    stacked tensor is read once (memory: what reading it whole already took)."""

    def __init__(self, store: Any, keep: int = 4) -> None:
        self.store, self.keep = store, keep
        self.cache: dict[str, Any] = {}

    def layer(self, key: str, i: int) -> Any:
        return self.whole(key)[i]

    def whole(self, key: str) -> Any:
        """The whole stored tensor (a stacked one, or a distributed-optimizer bucket)."""
        if key not in self.cache:
            if len(self.cache) >= self.keep:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = self.store.tensor(key)
        return self.cache[key]


def _views(
    name: str, key: str, layers: int, experts: int, stacked: _StackCache
) -> list[tuple[str, Any, int]]:
    """(name, getter, leading dims taken) triples: one per layer for a stacked
    `decoder.layers.*` tensor, one per expert (its layer's slice at the expert's index) for
    a MoE expert tensor `<mlp>.experts.experts.<param>`."""

    if layers and _STACKED.match(name):
        rest = name[len("decoder.layers.") :]
        out = [
            (f"decoder.layers.{i}.{rest}", (lambda i=i: stacked.layer(key, i)), 1)
            for i in range(layers)
        ]
    elif experts and EXPERTS.match(name):
        out = [(name, (lambda: stacked.whole(key)), 0)]  # read once for all its experts
    else:
        out = [(name, getter(stacked.store, key), 0)]
    return split_experts(out, experts) if experts else out


def _common(path: Path, store: Any) -> dict[str, Any]:
    """The common state: `common.pt` (megatron-core <= 0.18) or, from 0.19, the bytes entry
    `common_state/shard_0_1` (a one-element list), through the restricted unpickler."""
    f = path / "common.pt"
    if f.is_file():
        obj, _ = load_torch_file(f)
        return obj if isinstance(obj, dict) else {}
    key = next((k for k in store.md.state_dict_metadata if k.startswith("common_state/")), None)
    obj = store.value(key) if key is not None else None
    obj = obj[0] if isinstance(obj, list) and len(obj) == 1 else obj
    return obj if isinstance(obj, dict) else {}


_BUCKET = re.compile(
    r"^optimizer\.distributed\.(?P<buf>dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.*)\.bucket_idx_(?P<idx>\d+)\.(?P<field>param|exp_avg|exp_avg_sq)$"
)
_DIST_OPT = re.compile(r"^optimizer\.distributed\.dp_group_idx_0\.optimizer/")
_PARAM_ALIGN = (
    64  # megatron-core optimizer/param_layout.py pad_param_start: starts at multiples of 64
)


def _model_order(ckpt: Checkpoint, layers: int) -> list[str]:
    """named_parameters() order of megatron-core's GPTModel: embedding, each layer's
    parameters in module order (as the stacked keys list them), final norm, output layer."""
    names = ckpt.names()
    per_layer = [n for n in names if n.startswith("decoder.layers.0.")]
    rest = experts_in_order([n[len("decoder.layers.0.") :] for n in per_layer])
    head = [n for n in names if n.startswith("embedding.")]
    tail = [
        n for n in names if n.startswith("decoder.") and not n.startswith("decoder.layers.")
    ] + [n for n in names if n.startswith("output_layer.")]
    body = [f"decoder.layers.{i}.{r}" for i in range(max(layers, 1)) for r in rest]
    order = head + body + tail
    missing = [n for n in names if n not in order]
    return order + missing


def _unflatten_buckets(
    path: Path, md: Any, ckpt: Checkpoint, buckets: dict, stacked: _StackCache, layers: int
) -> dict[str, dict[str, Any]]:
    """Per-parameter moments from the distributed optimizer's flat buckets.

    megatron-core lays each grad buffer out over the parameters in reverse
    named_parameters() order, each start rounded up to a multiple of 64 elements
    (distrib_optimizer `_compute_per_buffer_param_layout`); the saved bucket is that
    buffer up to its last parameter. The layout is checked against the bucket's size and,
    where the save kept one chunk per parameter, every chunk boundary.
    """
    order = _model_order(ckpt, layers)
    todo = list(reversed(order))
    out: dict[str, dict[str, Any]] = {}
    for buf, idx in sorted(buckets, key=lambda b: (b[0], b[1])):
        fields = buckets[(buf, idx)]
        key = fields.get("exp_avg")
        if key is None or "exp_avg_sq" not in fields:
            raise CorruptCheckpoint(f"{path}: bucket {idx} of {buf} lacks exp_avg/exp_avg_sq")
        meta = md.state_dict_metadata[key]
        total = int(meta.size[0])
        off, placed = 0, []
        while todo and off < total:
            name = todo.pop(0)
            n = ckpt.meta(name).numel
            off = -(-off // _PARAM_ALIGN) * _PARAM_ALIGN
            placed.append((name, off, n))
            off += n
        if off != total:
            raise OptimizerMappingError(
                f"{path}: distributed-optimizer bucket {idx} holds {total} elements but the parameters in reverse order "
                f"with 64-element aligned starts end at {off}; the layout does not match this model"
            )
        starts = {tuple(c.offsets)[0] for c in getattr(meta, "chunks", [])}
        if len(starts) > 1 and not all(o in starts for _, o, _ in placed):
            bad = next(nm for nm, o, _ in placed if o not in starts)
            raise OptimizerMappingError(
                f"{path}: distributed-optimizer bucket {idx}: no saved chunk starts where {bad} would"
            )
        for name, o, n in placed:
            shape = ckpt.meta(name).shape
            out[name] = {
                f: (
                    lambda k=fields[f], o=o, n=n, shape=shape: stacked.whole(k)[o : o + n].view(
                        shape
                    )
                )
                for f in ("exp_avg", "exp_avg_sq")
            }
            if "param" in fields:  # the main param the optimizer steps (fp32 also under --bf16)
                out[name][_MAIN] = lambda k=fields["param"], o=o, n=n, shape=shape: stacked.whole(
                    k
                )[o : o + n].view(shape)
    if todo:
        raise OptimizerMappingError(
            f"{path}: {len(todo)} parameters (first {todo[0]}) are in no distributed-optimizer bucket"
        )
    return out


def iter_of(path: Path) -> int | None:
    m = re.match(r"iter_(\d+)$", path.name)
    return int(m.group(1)) if m else None


def _dist_optimizer(
    state: dict[str, dict[str, Any]], groups: list[dict[str, Any]], names: list[str]
) -> OptimizerView:
    """Moments by key. Megatron keeps param groups' members out of the checkpoint, so
    groups are matched by Megatron's own rule: biases and norms take the group without
    weight decay, everything else the one with it."""
    hypers = [
        group_hyper({k: v for k, v in g.items() if k != "params"}, i) for i, g in enumerate(groups)
    ] or [group_hyper({"lr": 0.0}, 0)]
    decay = next((h for h in hypers if h.weight_decay > 0), hypers[0])
    no_decay = next((h for h in hypers if h.weight_decay == 0), hypers[0])
    hyper_of = {n: (no_decay if _NO_DECAY.search(n) else decay) for n in state}
    for n in names:
        hyper_of.setdefault(n, decay)
    kind = optimizer_kind({k: dict.fromkeys(v) for k, v in state.items()})
    # Fused Adams (TransformerEngine, apex) count steps per group, not per parameter.
    steps = {h.index: g.get("step") for h, g in zip(hypers, groups, strict=False)}
    built = {}
    for n, fields in state.items():
        st = steps.get(hyper_of[n].index)
        built[n] = LazyState(
            {**fields, "step": int(st)}
            if isinstance(st, (int, float)) and "step" not in fields
            else fields
        )
    return OptimizerView(
        kind=kind,
        state=built,
        hyper=hyper_of,
        groups=hypers,
        mapping="sharded key (Megatron torch_dist)",
    )
