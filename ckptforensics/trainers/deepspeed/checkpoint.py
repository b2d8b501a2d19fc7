"""DeepSpeed ZeRO checkpoints (`global_stepN/`, `latest`): weights from the model states,
Adam moments unflattened per parameter from the per-rank flat partitions, read lazily.

Over 400 lines: one format's reader (model states, flat partitions unflattened per
parameter); formats/ keeps one module per format.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptforensics.core.errors import CorruptCheckpoint, ForensicsError
from ckptforensics.formats import register
from ckptforensics.formats.base import (
    Checkpoint,
    Completeness,
    GroupHyper,
    LazyState,
    OptimizerView,
    TensorMeta,
)
from ckptforensics.formats.inert import InertRecord, register_safe_globals
from ckptforensics.formats.optstate import group_hyper, map_optimizer
from ckptforensics.formats.statedict import add_state_dict, attach_optimizer, to_plain
from ckptforensics.formats.torchfile import load_torch_file, torch_file_problem
from ckptforensics.trainers.deepspeed.moe import (
    EXPERT_FILE,
    EXPP_FILE,
    add_experts,
    attach_stage0,
    expert_problems,
)

__all__ = ["is_deepspeed_dir", "open_deepspeed", "deepspeed_completeness"]

_RANK = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def _tag_dir(path: Path) -> Path | None:
    """The `global_stepN` directory: the path itself, or the one `latest` names."""
    if any(path.glob("*mp_rank_00_model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        d = path / Path(tag).name  # a tag is a name, never a path out of the save dir
        if d.is_dir() and any(d.glob("*mp_rank_00_model_states.pt")):
            return d
    return None


def is_deepspeed_dir(path: Path) -> bool:
    """A DeepSpeed tag dir, or a save dir whose `latest` names one (even one that is not
    there: `deepspeed_completeness` then says so)."""
    if not path.is_dir():
        return False
    if _tag_dir(path) is not None:
        return True
    latest = path / "latest"
    try:
        return latest.is_file() and _STEP_TAG.match(latest.read_text().strip()) is not None
    except (OSError, UnicodeDecodeError):
        return False


def open_deepspeed(path: Path) -> Checkpoint:
    """Open a DeepSpeed checkpoint (ZeRO stage 0, 1, 2 or 3) without DeepSpeed installed.

    Its files pickle a few DeepSpeed classes; they load as inert records (formats/inert.py).
    """
    tag = _tag_dir(path)
    if tag is None:
        raise CorruptCheckpoint(f"{path}: no DeepSpeed model states (mp_rank_00_model_states.pt)")
    # Not the experts' `layer_{L}_expert_{E}_mp_rank_00_model_states.pt` (DeepSpeed-MoE).
    model_files = sorted(
        f for f in tag.glob("*mp_rank_00_model_states.pt") if _MODEL_FILE.match(f.name)
    )
    if not model_files:
        raise CorruptCheckpoint(f"{tag}: no DeepSpeed model states (mp_rank_00_model_states.pt)")
    ms, mapped = load_torch_file(model_files[0])
    if not isinstance(ms, dict) or "module" not in ms:
        raise CorruptCheckpoint(f"{model_files[0]}: not DeepSpeed model states (no module)")
    ckpt = Checkpoint(path=path, format="deepspeed", file_backed=mapped)
    # ZeRO-0 saves no param_shapes: its optimizer is a plain torch state_dict.
    shapes: list[list[tuple[str, tuple[int, ...]]]] = [
        [(n, tuple(s)) for n, s in g.items()] for g in (ms.get("param_shapes") or [])
    ]
    ranks = sorted(
        ((int(m.group(1)), f) for f in tag.iterdir() if (m := _RANK.match(f.name))),
        key=lambda x: x[0],
    )
    optim = [load_torch_file(f)[0] for _, f in ranks]
    stage = _stage(optim)
    moe = False
    if stage == 3:
        _stage3_weights(ckpt, shapes, optim, ms)
    else:
        add_state_dict(ckpt, ms.get("module") or {})
        moe = add_experts(ckpt, tag)  # DeepSpeed-MoE: the experts' files (moe.py)
        if stage in (1, 2):
            _stage12_masters(ckpt, shapes, optim, str(tag))
    ckpt.scalars["global_step"] = int(ms.get("global_steps", 0))
    ckpt.scalars["skipped_steps"] = int(ms.get("skipped_steps", 0))
    ckpt.scalars["zero_stage"] = stage
    ckpt.scalars["dp_world_size"] = int(ms.get("dp_world_size", len(ranks) or 1))
    cfg = ms.get("ds_config")
    if isinstance(cfg, dict):
        plain = to_plain(cfg)
        ckpt.scalars["ds_config"] = plain  # the whole config: a resume plan edits its keys
        ckpt.scalars["train_config"] = {
            "grad_clip": cfg.get("gradient_clipping"),
            **{k: v for k, v in plain.items() if not isinstance(v, dict)},
            **{
                k: True for k in ("fp16", "bf16") if _enabled(plain, k)
            },  # what the replay's precision reads
            "ds_config": plain,
        }
    if optim:
        scale = _loss_scale(optim[0]["optimizer_state_dict"].get("loss_scaler"), cfg)
        if scale is not None:
            ckpt.scalars["loss_scale"] = scale
        ckpt.optimizer = _partitioned(optim, shapes, stage, str(tag))
    elif isinstance(ms.get("optimizer"), dict):
        if shapes:
            ckpt.optimizer = _stage0(ms["optimizer"], shapes, str(model_files[0]))
        elif moe:
            attach_stage0(ckpt, ms["optimizer"], f"{model_files[0]}:optimizer")
        else:
            attach_optimizer(ckpt, ms["optimizer"], f"{model_files[0]}:optimizer")
    else:
        ckpt.notes.append("no DeepSpeed optimizer state: weights only")
    return ckpt


def _enabled(cfg: Any, section: str) -> bool:
    sec = cfg.get(section) if isinstance(cfg, dict) else None
    return isinstance(sec, dict) and bool(sec.get("enabled"))


def _loss_scale(ls: Any, cfg: Any) -> float | None:
    """The fp16 loss scale, where the run had one. ZeRO's optimizer always pickles a
    `loss_scaler`: an fp32 or bf16 run's is static at 1.0 (deepspeed 0.19.8, ZeRO 1-3 on
    fp32), so the scaler counts only where `ds_config` enables fp16 or, lacking a
    ds_config, where it is dynamic or its scale is not 1."""
    scale = ls.get("cur_scale") if hasattr(ls, "get") else None
    if scale is None:
        return None
    if isinstance(cfg, dict):
        return float(scale) if _enabled(cfg, "fp16") else None
    return float(scale) if ls.get("dynamic") or float(scale) != 1.0 else None


def _stage(optim: list[dict[str, Any]]) -> int:
    if not optim:
        return 0
    z = optim[0]["optimizer_state_dict"].get("zero_stage")
    args = getattr(z, "_args", None) or (z,)
    try:
        return int(args[0])
    except (TypeError, ValueError):
        return 3 if "fp32_flat_groups" in optim[0]["optimizer_state_dict"] else 2


def _stage0(
    osd: dict[str, Any], shapes: list[list[tuple[str, tuple[int, ...]]]], source: str
) -> OptimizerView:
    """ZeRO-0: a plain torch state_dict whose groups follow param_shapes exactly."""

    for g, members in zip(osd["param_groups"], shapes, strict=False):
        g["param_names"] = [n for n, _ in members]
    return map_optimizer(osd, [], source)


def _inner(o: dict[str, Any]) -> dict[str, Any]:
    """The torch optimizer state over the flat partitions (stage 1/2 and stage 3 name it differently)."""
    osd = o["optimizer_state_dict"]
    inner = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict")
    if not isinstance(inner, dict) or "state" not in inner:
        raise CorruptCheckpoint("DeepSpeed optimizer states without a base optimizer state")
    return inner


def _fragments(optim: list[dict[str, Any]], g: int, name: str, field: str) -> list[torch.Tensor]:
    """Stage 1/2: the pieces of `name` in each rank's flat partition of group g, in rank order."""
    pieces = []
    for o in optim:
        osd = o["optimizer_state_dict"]
        frag = osd["param_slice_mappings"][g].get(name)
        if frag is None:
            continue
        flat = _inner(o)["state"][g][field]
        start, numel = int(frag.get("start")), int(frag.get("numel"))
        pieces.append(flat.narrow(0, start, numel))
    return pieces


def _stage3_piece(
    optim: list[dict[str, Any]], g: int, offset: int, numel: int, field: str | None
) -> torch.Tensor:
    """Stage 3: every rank holds ceil(numel / ws) elements of each parameter, in order."""
    ws = len(optim)
    part = math.ceil(numel / ws)
    pieces = []
    for o in optim:
        osd = o["optimizer_state_dict"]
        flat = _inner(o)["state"][g][field] if field else osd["fp32_flat_groups"][g]
        pieces.append(flat.narrow(0, offset, part))
    return torch.cat(pieces)[:numel]


def _stage3_offsets(members: list[tuple[str, tuple[int, ...]]], ws: int) -> dict[str, int]:
    out, off = {}, 0
    for name, shape in members:
        out[name] = off
        off += math.ceil(math.prod(shape) / ws)
    return out


def _stage3_weights(
    ckpt: Checkpoint,
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    optim: list[dict[str, Any]],
    ms: dict[str, Any],
) -> None:
    ws = len(optim)
    for g, members in enumerate(shapes):
        offs = _stage3_offsets(members, ws)
        for name, shape in members:
            ckpt.add_tensor(
                name, TensorMeta(shape, torch.float32), _lazy3(optim, g, offs[name], shape, None)
            )
    ckpt.notes.append("ZeRO-3: weights are the fp32 master partitions, gathered")


def _stage12_masters(
    ckpt: Checkpoint,
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    optim: list[dict[str, Any]],
    source: str,
) -> None:
    """ZeRO-1/2 with bf16 or fp16 weights: the optimizer files hold the fp32 master weights
    (`single_partition_of_fp32_groups`, cut like the moments by `param_slice_mappings`),
    which the optimizer steps; the module holds their rounding. The masters are the weights
    (a replay updates them, as the run did)."""
    osd = optim[0]["optimizer_state_dict"] if optim else {}
    if "single_partition_of_fp32_groups" not in osd or not shapes:
        return
    low = [
        n
        for g in shapes
        for n, _ in g
        if ckpt.has(n) and ckpt.meta(n).dtype in (torch.bfloat16, torch.float16)
    ]
    if not low:
        return
    for g, members in enumerate(shapes):
        for name, shape in members:
            if name in low:
                ckpt.add_tensor(
                    name,
                    TensorMeta(shape, torch.float32),
                    _lazy_master(optim, g, name, shape, source),
                )
    ckpt.scalars["fp32_masters"] = True
    ckpt.notes.append(
        f"ZeRO-{_stage(optim)}: weights are the fp32 master partitions (the module holds their bf16/fp16 rounding)"
    )


def _lazy_master(
    optim: list[dict[str, Any]], g: int, name: str, shape: tuple[int, ...], source: str
) -> Callable[[], torch.Tensor]:
    def build() -> torch.Tensor:
        pieces = []
        for o in optim:
            osd = o["optimizer_state_dict"]
            frag = osd["param_slice_mappings"][g].get(name)
            if frag is not None:
                pieces.append(
                    osd["single_partition_of_fp32_groups"][g].narrow(
                        0, int(frag.get("start")), int(frag.get("numel"))
                    )
                )
        flat = torch.cat(pieces) if pieces else torch.empty(0)
        if flat.numel() != math.prod(shape):
            raise CorruptCheckpoint(
                f"{source}: {name} has {flat.numel()} fp32 master elements across ranks, expected {math.prod(shape)}"
            )
        return flat.view(shape)

    return build


def _lazy3(
    optim: list[dict[str, Any]], g: int, off: int, shape: tuple[int, ...], field: str | None
) -> Callable[[], torch.Tensor]:
    return lambda: _stage3_piece(optim, g, off, math.prod(shape), field).view(shape)


def _partitioned(
    optim: list[dict[str, Any]],
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    stage: int,
    source: str,
) -> OptimizerView:
    base = _inner(optim[0])
    hypers: list[GroupHyper] = [
        group_hyper({k: v for k, v in g.items() if k != "params"}, i)
        for i, g in enumerate(base["param_groups"])
    ]
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, GroupHyper] = {}
    for g, members in enumerate(shapes):
        if g >= len(hypers):
            raise CorruptCheckpoint(
                f"{source}: {len(shapes)} parameter groups but {len(hypers)} optimizer groups"
            )
        step = base["state"][g].get("step")
        offs = _stage3_offsets(members, len(optim)) if stage == 3 else {}
        for name, shape in members:
            hyper[name] = hypers[g]
            build: dict[str, Any] = {"step": step}
            for field in ("exp_avg", "exp_avg_sq"):
                if stage == 3:
                    build[field] = _lazy3(optim, g, offs[name], shape, field)
                else:
                    build[field] = _lazy12(optim, g, name, field, shape, source)
            state[name] = LazyState(build)
    return OptimizerView(
        kind="adam",
        state=state,
        hyper=hyper,
        groups=hypers,
        mapping=f"ZeRO-{stage} partitions by param_shapes",
    )


def _lazy12(
    optim: list[dict[str, Any]], g: int, name: str, field: str, shape: tuple[int, ...], source: str
) -> Callable[[], torch.Tensor]:
    def build() -> torch.Tensor:
        pieces = _fragments(optim, g, name, field)
        flat = torch.cat(pieces) if len(pieces) > 1 else (pieces[0] if pieces else torch.empty(0))
        if flat.numel() != math.prod(shape):
            raise CorruptCheckpoint(
                f"{source}: {name} has {flat.numel()} {field} elements across ranks, expected {math.prod(shape)}"
            )
        return flat.view(shape)

    return build


_STEP_TAG = re.compile(r"^global_step(\d+)$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_DS_RULE = (
    "a DeepSpeed checkpoint: the model states of every model-parallel rank (of every data-parallel rank "
    "under ZeRO-3) and the ZeRO optimizer states of every data-parallel rank for the dp_world_size its model "
    "states record, under DeepSpeed-MoE the file of every expert of every MoE layer its num_experts records, "
    "each a whole torch.save file; `latest`, written once every rank has saved, naming this tag or a later one"
)


def deepspeed_completeness(path: Path) -> Completeness:
    """A save dir (through its `latest`) or a `global_stepN` tag dir: every rank's files for
    the world size the model states record, each whole (zip end records), and a `latest`
    that does not lag behind the tag (DeepSpeed writes it after every rank saved)."""
    problems: list[str] = []
    latest = path / "latest"
    if _tag_dir(path) is path or not latest.is_file():
        tag = path
        problems += _lagging_latest(path)
    else:
        name = latest.read_text().strip()
        tag = path / Path(name).name
        if not tag.is_dir():
            return Completeness(
                "deepspeed", _DS_RULE, (f"`latest` names {name}, which is not there",)
            )
    problems += _tag_problems(tag, path)
    return Completeness("deepspeed", _DS_RULE, tuple(problems))


def _lagging_latest(tag: Path) -> list[str]:
    latest = tag.parent / "latest"
    try:
        named = latest.read_text().strip() if latest.is_file() else None
    except (OSError, UnicodeDecodeError):
        return []
    mine, theirs = _STEP_TAG.match(tag.name), _STEP_TAG.match(named or "")
    if mine and theirs and int(mine.group(1)) > int(theirs.group(1)):
        return [
            f"newer than ../latest ({named}): DeepSpeed writes `latest` once every rank has saved, so this save did not finish"
        ]
    return []


def _tag_problems(tag: Path, top: Path) -> list[str]:
    def rel(name: str) -> str:
        return (tag / name).relative_to(top).as_posix() if tag != top else name

    names = [f.name for f in tag.iterdir()] if tag.is_dir() else []
    models = {
        (int(m.group(1) or 0), int(m.group(2))): n for n in names if (m := _MODEL_FILE.match(n))
    }
    optims = {(int(m.group(1)), int(m.group(2))): n for n in names if (m := _OPTIM_FILE.match(n))}
    if not models:
        return [f"{rel('mp_rank_00_model_states.pt')} missing"]
    experts = {n for n in names if EXPERT_FILE.match(n) or EXPP_FILE.match(n)}
    problems = [
        b
        for n in sorted(set(models.values()) | set(optims.values()) | experts)
        if (b := torch_file_problem(tag / n, top))
    ]
    if problems:
        return problems
    zero3 = any(n.startswith("zero_pp_rank_") for n in models.values())
    first = tag / models[min(models)]
    try:
        ms, _ = load_torch_file(first)  # memory-mapped: the pickle is read, no tensor data
    except ForensicsError as e:
        return [f"{rel(first.name)}: {str(e).removeprefix(f'{first}: ')}"]
    ms = ms if isinstance(ms, dict) else {}
    dp = _int(ms.get("dp_world_size"), 1)
    mp = _int(ms.get("mp_world_size"), 1 + max(m for _, m in models))
    cfg = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
    stage = _int(
        (cfg.get("zero_optimization") or {}).get("stage"), 3 if zero3 else (1 if optims else 0)
    )
    for m in range(mp):
        for r in range(dp if zero3 else 1):
            if (r, m) not in models:
                want = (
                    f"zero_pp_rank_{r}_mp_rank_{m:02d}_model_states.pt"
                    if zero3
                    else f"mp_rank_{m:02d}_model_states.pt"
                )
                problems.append(
                    f"{rel(want)} missing (dp_world_size {dp}, mp_world_size {mp} in the model states)"
                )
        if stage >= 1:
            for r in range(dp):
                if (r, m) not in optims:
                    want = f"zero_pp_rank_{r}_mp_rank_{m:02d}_optim_states.pt"
                    problems.append(f"{rel(want)} missing (dp_world_size {dp} in the model states)")
    if not zero3:
        problems += expert_problems(tag, ms, mp, rel)
    extra = sorted(r for r, _ in optims if r >= dp) + sorted(
        r for r, _ in models if zero3 and r >= dp
    )
    if extra:
        problems.append(
            f"files of rank {extra[0]} but dp_world_size {dp} in the model states: mismatched world sizes (two saves mixed?)"
        )
    return problems


def _int(x: Any, default: int) -> int:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else default


register(
    "deepspeed",
    open_deepspeed,
    lambda p: p.is_dir() and is_deepspeed_dir(p),
    order=30,
    complete=deepspeed_completeness,
)


# The DeepSpeed classes its files pickle, admitted as inert records by the restricted unpickler.
register_safe_globals(
    [
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler", InertRecord),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", InertRecord),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum", InertRecord),
        ("deepspeed.utils.tensor_fragment", "fragment_address", InertRecord),
        ("deepspeed.checkpoint.utils", "fragment_address", InertRecord),
    ]
)
