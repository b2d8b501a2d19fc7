"""OLMo-core's `stepN/` around its DCP files: `.metadata.json` (written last), `train/rank*.pt`
and `model_and_optim/`; its completeness rule and its records (the experiment config.json, the
train state's step), registered with the DCP reader."""

from __future__ import annotations

import json
from pathlib import Path

from ckptforensics.formats.base import Checkpoint, json_problem
from ckptforensics.formats.dcp import DCP_RULE, register_dcp_layout, register_dcp_records
from ckptforensics.formats.inert import InertRecord, register_dcp_globals
from ckptforensics.formats.torchfile import load_torch_file, torch_file_problem


def olmo_layout(path: Path, roots: list[Path]) -> tuple[str, list[str]] | None:
    """OLMo-core's rule and what it finds missing, or None for another layout."""
    if not (
        (path / "model_and_optim").is_dir()
        or (path / "train").is_dir()
        or (path / ".metadata.json").exists()
    ):
        return None
    rule = (
        "an OLMo-core checkpoint: .metadata.json (written last), train/rank0.pt, and model_and_optim/ with "
        + DCP_RULE
    )
    problems: list[str] = []
    bad = json_problem(path / ".metadata.json", path)
    if bad is not None:
        problems.append(
            f"{bad} (OLMo-core writes it last: the save did not finish)"
            if bad.endswith("missing")
            else bad
        )
    for f in sorted({path / "train" / "rank0.pt", *(path / "train").glob("rank*.pt")}):
        bad = torch_file_problem(f, path)
        if bad is not None:
            problems.append(bad)
    return rule, problems


register_dcp_layout(olmo_layout)


def _config(ckpt: Checkpoint, path: Path) -> None:
    """OLMo-core's experiment config.json beside `model_and_optim/`: the model section builds
    the model (`replay.reference`), the train module states the clip and the optimizer."""
    for d in (path, path.parent):
        f = d / "config.json"
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text())
        except (OSError, ValueError):
            return
        model = cfg.get("model") if isinstance(cfg, dict) else None
        if not (isinstance(model, dict) and str(model.get("_CLASS_", "")).startswith("olmo_core.")):
            return
        ckpt.config = model
        tm = cfg.get("train_module") or {}
        optim = tm.get("optim") or {}
        ckpt.scalars["train_config"] = {
            "grad_clip": tm.get("max_grad_norm"),
            "learning_rate": optim.get("lr"),
        }
        ckpt.scalars["olmo_optim"] = (
            optim  # the replay follows a SkipStep optimizer's skips (replay/skipstep)
        )
        if "skip_step" in str(optim.get("type", "")) or "SkipStep" in str(optim.get("_CLASS_", "")):
            ckpt.notes.append(
                f"the optimizer is OLMo-core's {optim.get('_CLASS_', 'SkipStepAdamW').rsplit('.', 1)[-1]}: it skips a step whose loss or "
                f"grad norm exceeds the mean of the last {optim.get('rolling_interval_length', 128)} by "
                f"{optim.get('sigma_factor', 6)} standard deviations (a replay skips the steps the run's log or that rule says)"
            )
        return


def _train_state(path: Path) -> int | None:
    """OLMo-core's `train/rank0.pt` global_step (its RNG state holds numpy arrays: data)."""
    f = path / "train" / "rank0.pt"
    if not f.is_file():
        return None

    obj, _ = load_torch_file(f)
    step = obj.get("global_step") if isinstance(obj, dict) else None
    return int(step) if isinstance(step, int) else None


def olmo_records(ckpt: Checkpoint, path: Path) -> int | None:
    """The experiment config.json into `ckpt` (model config, clip, optimizer); the step of
    `train/rank0.pt`."""
    step = _train_state(path)
    _config(ckpt, path)
    return step


register_dcp_records(olmo_records)


# OLMo-core 3.0's own `_StorageInfo` (relative_path, offset, length, ...) in its DCP
# `.metadata`, admitted as an inert record by the DCP metadata unpickler.
register_dcp_globals([("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo", InertRecord)])
