"""HF Trainer `checkpoint-N/` directories and `save_pretrained` model directories."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from ckptforensics.core.errors import CorruptCheckpoint
from ckptforensics.formats import register
from ckptforensics.formats.base import Checkpoint, Completeness, file_problem, json_problem
from ckptforensics.formats.optstate import AmbiguousMapping, map_optimizer, register_group_rule
from ckptforensics.formats.safetensors_file import SafetensorsFile, add_file, safetensors_problem
from ckptforensics.formats.statedict import add_state_dict, scaler_scalars, scheduler_scalars
from ckptforensics.formats.torchfile import load_torch_file, torch_file_problem
from ckptforensics.trainers.hf.layout import apply_memory_layout, model_params
from ckptforensics.trainers.hf.order import param_order
from ckptforensics.trainers.hf.training_args import read_training_args

__all__ = [
    "open_hf_dir",
    "is_hf_dir",
    "hf_completeness",
    "is_trainer_checkpoint",
    "save_only_model",
]

log = logging.getLogger(__name__)


def is_hf_dir(path: Path) -> bool:
    """A directory with HF weights (`model*.safetensors`, `pytorch_model*.bin`) or config."""
    if not path.is_dir():
        return False
    if any(path.glob("model*.safetensors")) or any(path.glob("pytorch_model*.bin")):
        return True
    # A save that died before (or while) writing its weights: its index, or the config
    # beside the Trainer's own files, still says what it was meant to be.
    if (path / "model.safetensors.index.json").is_file() or (
        path / "pytorch_model.bin.index.json"
    ).is_file():
        return True
    return (path / "config.json").is_file() and is_trainer_checkpoint(path)


def open_hf_dir(path: Path) -> Checkpoint:
    """Open an HF Trainer checkpoint directory lazily.

    Weights come from the (sharded) safetensors files; `optimizer.pt` is mapped to
    names with the parameter order of the model that `config.json` describes (built
    on the meta device with transformers, the `hf` extra), verified by shape.
    """
    ckpt = Checkpoint(path=path, format="hf-trainer", file_backed=True)
    _weights(ckpt, path)
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        ckpt.config = _json(cfg_file)
        apply_memory_layout(ckpt)
    state_file = path / "trainer_state.json"
    if state_file.is_file():
        ts = _json(state_file)
        if "global_step" in ts:
            ckpt.scalars["global_step"] = int(ts["global_step"])
        ckpt.scalars["log_history_tail"] = (ts.get("log_history") or [])[-5:]
    for fname, parse in (("scheduler.pt", scheduler_scalars), ("scaler.pt", scaler_scalars)):
        f = path / fname
        if f.is_file():
            obj, _ = load_torch_file(f)
            ckpt.scalars.update(parse(obj))
    opt = path / "optimizer.pt"
    if opt.is_file():
        _optimizer(ckpt, opt)
    else:
        ckpt.notes.append("no optimizer.pt: weights only")
    if (path / "training_args.bin").is_file():
        read_training_args(ckpt, path / "training_args.bin")
    return ckpt


def _json(f: Path) -> dict[str, Any]:
    try:
        out = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{f}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise CorruptCheckpoint(f"{f}: expected a JSON object")
    return out


def _weights(ckpt: Checkpoint, path: Path) -> None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = _json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CorruptCheckpoint(f"{index}: no weight_map")
        by_file: dict[str, set[str]] = {}
        for name, fname in wm.items():
            by_file.setdefault(str(fname), set()).add(name)
        for fname in sorted(by_file):
            shard = path / Path(fname).name  # never follow a path out of the checkpoint dir
            if not shard.is_file():
                raise CorruptCheckpoint(f"{index}: shard {fname} listed in weight_map is missing")
            st = SafetensorsFile(shard)
            missing = by_file[fname] - set(st.entries)
            if missing:
                raise CorruptCheckpoint(
                    f"{shard}: lacks {sorted(missing)[0]} that the index places there"
                )
            add_file(ckpt, st, only=by_file[fname])
        return
    files = sorted(path.glob("model*.safetensors"))
    if files:
        for f in files:
            add_file(ckpt, SafetensorsFile(f))
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise CorruptCheckpoint(
            f"{path}: HF directory without model*.safetensors or pytorch_model*.bin"
        )
    for b in bins:
        obj, mapped = load_torch_file(b)
        ckpt.file_backed = ckpt.file_backed and mapped
        add_state_dict(ckpt, obj)


def _model_params(ckpt: Checkpoint) -> tuple[list[tuple[str, tuple[int, ...]]] | None, str]:
    """named_parameters() order of the configured model: the family's template where it
    matches the checkpoint's own weights name for name and shape (`hf_order`, no
    transformers import), else the model built on the meta device."""
    if not ckpt.config:
        return None, "no config.json"
    order = param_order(ckpt.config)
    if order is not None:
        stored = {n: ckpt.meta(n).shape for n in ckpt.names()}
        stored.update({alias: stored[n] for alias, n in ckpt.aliases.items() if n in stored})
        if len(order) == len(stored) and all(stored.get(n) == shape for n, shape in order):
            return order, ""
        log.debug(
            "%s: the %s template does not match the stored weights; building the model",
            ckpt.path,
            ckpt.config.get("model_type"),
        )
    return model_params(ckpt.config)


# transformers' Trainer puts these names in the no-decay group (FORMATS.md).
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)", re.IGNORECASE)


def no_decay(name: str, shape: tuple[int, ...]) -> bool:
    """The Trainer's decay rule by name (LayerNorm/RMSNorm params and biases skip decay): its
    two param groups, as the optimizer-id mapping tries them before the dim rule."""
    return bool(_NO_DECAY.search(name))


register_group_rule("HF decay/no-decay groups", no_decay, order=1.0)


def _optimizer(ckpt: Checkpoint, opt: Path) -> None:
    osd, mapped = load_torch_file(opt)
    ckpt.file_backed = ckpt.file_backed and mapped
    groups = osd.get("param_groups", []) if isinstance(osd, dict) else []
    if groups and all(g.get("param_names") for g in groups):
        ckpt.optimizer = map_optimizer(osd, [], str(opt))
        return
    params, why = _model_params(ckpt)
    if params is None:
        ckpt.notes.append(f"optimizer.pt not mapped to parameter names: {why}; weights-only diff")
        log.warning("%s: optimizer state not mapped: %s", opt, why)
        return
    try:
        ckpt.optimizer = map_optimizer(osd, params, str(opt))
    except AmbiguousMapping as e:
        ckpt.pending_optimizer = e.pending
        ckpt.notes.append(f"{e}")


# The files HF's Trainer writes into `checkpoint-N/` besides the model's (transformers
# Trainer._save_checkpoint): model, then optimizer/scheduler/scaler, RNG states, and
# trainer_state.json last.
_TRAINER_FILES = (
    "trainer_state.json",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
    "training_args.bin",
    "rng_state.pth",
)
_TRAINER_DIR = re.compile(r"^checkpoint-\d+$")
_SHARD = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


def is_trainer_checkpoint(path: Path) -> bool:
    """A Trainer's `checkpoint-N/` (by its name or its Trainer files), not a bare
    `save_pretrained` model directory."""
    return (
        bool(_TRAINER_DIR.match(path.name))
        or any((path / f).exists() or (path / f).is_symlink() for f in _TRAINER_FILES)
        or any(path.glob("rng_state_*.pth"))
    )


def save_only_model(path: Path) -> bool:
    """TrainingArguments.save_only_model, from training_args.bin (inert unpickler): such
    checkpoints have no optimizer.pt by design."""
    f = path / "training_args.bin"
    if file_problem(f) is not None:
        return False
    try:
        obj, _ = load_torch_file(f)
    except Exception:  # unreadable or refused: the optimizer is then required
        return False
    fields = obj.as_dict() if hasattr(obj, "as_dict") else (obj if isinstance(obj, dict) else {})
    return fields.get("save_only_model") is True


_RULE = (
    "an HF Trainer checkpoint: every weight shard its index names (or its model*.safetensors / pytorch_model*.bin), "
    "whole; optimizer.pt (unless save_only_model); trainer_state.json, which the Trainer writes last"
)


def hf_completeness(path: Path) -> Completeness:
    """HF Trainer `checkpoint-N/` or `save_pretrained` directory: shards per the index,
    headers and end records only; a Trainer checkpoint also needs optimizer.pt and
    trainer_state.json (written last, so its absence means the save did not finish)."""
    problems = _weights_problems(path)
    if not is_trainer_checkpoint(path):
        return Completeness(
            "hf-trainer",
            "a save_pretrained model directory: every weight shard its index names, whole",
            tuple(problems),
        )
    bad = json_problem(path / "trainer_state.json", path)
    if bad is not None:
        problems.append(
            f"{bad} (the Trainer writes it last: the save did not finish)"
            if bad.endswith("missing")
            else bad
        )
    opt = path / "optimizer.pt"
    if opt.exists() or opt.is_symlink() or not save_only_model(path):
        bad = torch_file_problem(opt, path)
        if bad is not None:
            problems.append(bad)
    for extra in (
        "scheduler.pt",
        "scaler.pt",
        "training_args.bin",
    ):  # the reader loads these when present
        f = path / extra
        if f.exists() or f.is_symlink():
            bad = torch_file_problem(f, path)
            if bad is not None:
                problems.append(bad)
    return Completeness("hf-trainer", _RULE, tuple(problems))


def _weights_problems(path: Path) -> list[str]:
    for index_name, check in (
        ("model.safetensors.index.json", safetensors_problem),
        ("pytorch_model.bin.index.json", None),
    ):
        index = path / index_name
        if not (index.exists() or index.is_symlink()):
            continue
        bad = json_problem(index, path)
        if bad is not None:
            return [bad]
        doc = json.loads(index.read_bytes())
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict) or not wm:
            return [f"{index_name}: no weight_map"]
        by_file: dict[str, set[str]] = {}
        for name, fname in wm.items():
            by_file.setdefault(Path(str(fname)).name, set()).add(str(name))
        out = []
        for fname in sorted(by_file):
            shard = path / fname
            bad = (
                check(shard, path, by_file[fname])
                if check is not None
                else torch_file_problem(shard, path)
            )
            if bad is not None:
                out.append(f"{bad} (listed in {index_name})" if bad.endswith("missing") else bad)
        return out
    files = sorted(
        f for f in path.glob("model*.safetensors") if f.is_file() or not f.is_symlink()
    )  # links to nothing: `broken_links`
    shards = {int(m.group(2)) for f in files if (m := _SHARD.match(f.name))}
    if shards:  # save_pretrained writes the index after its shards
        return [
            f"model.safetensors.index.json missing ({len(files)} of {max(shards)} shards there: save_pretrained writes the index after them)"
        ]
    if files:
        return [b for b in (safetensors_problem(f, path) for f in files) if b]
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        return [b for b in (torch_file_problem(f, path) for f in bins) if b]
    return ["no weights (model*.safetensors or pytorch_model*.bin)"]


register(
    "hf-trainer",
    open_hf_dir,
    lambda p: p.is_dir() and is_hf_dir(p),
    order=50,
    complete=hf_completeness,
)
