"""Megatron-LM legacy checkpoints: `iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt`."""

from __future__ import annotations

from pathlib import Path

from ..errors import CorruptCheckpoint
from .base import Checkpoint
from .statedict import add_state_dict, attach_optimizer, scaler_scalars, to_plain
from .torchfile import load_torch_file

__all__ = ["is_megatron_dir", "open_megatron"]


def _rank_files(path: Path) -> list[Path]:
    return sorted(path.glob("mp_rank_*/model_optim_rng.pt"))


def is_megatron_dir(path: Path) -> bool:
    return path.is_dir() and bool(_rank_files(path))


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
    if isinstance(model, dict) and "language_model" in model and not any(hasattr(v, "shape") for v in model.values()):
        model = _flatten(model)
    add_state_dict(ckpt, model)
    if "iteration" in obj:
        ckpt.scalars["global_step"] = int(obj["iteration"])
    args = obj.get("args")
    if args is not None and hasattr(args, "__dict__"):
        a = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool)) or v is None}
        ckpt.config = a
        ckpt.scalars["train_config"] = {"grad_clip": a.get("clip_grad"), "learning_rate": a.get("lr")}
    if len(files) > 1:
        ckpt.notes.append(f"{len(files)} model-parallel ranks: only {files[0].parent.name} is read (a shard of each split tensor)")
    opt = obj.get("optimizer")
    inner = opt.get("optimizer") if isinstance(opt, dict) else None
    if isinstance(opt, dict):
        ckpt.scalars.update(scaler_scalars(opt.get("grad_scaler")))
    if list(files[0].parent.glob("distrib_optim.pt")):
        ckpt.notes.append("distributed optimizer (distrib_optim.pt): moments are flat buckets and are not mapped to parameters")
    elif isinstance(inner, dict) and inner.get("state"):
        attach_optimizer(ckpt, inner, f"{files[0]}:optimizer")
    else:
        ckpt.notes.append("no optimizer state: weights only")
    sched = obj.get("opt_param_scheduler")
    if isinstance(sched, dict):
        ckpt.scalars["scheduler"] = to_plain({k: v for k, v in sched.items() if isinstance(v, (int, float))})
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
