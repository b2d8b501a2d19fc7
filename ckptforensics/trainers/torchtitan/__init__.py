"""torchtitan: job-config keys (`[training] max_norm`, `[optimizer] lr`, `[checkpoint] load_step`),
from the run's TOML where it sits near the checkpoints; the same keys as `--section.key` flags.

torchtitan loads `checkpoint.load_step` (-1: the latest) from `checkpoint.folder` under the
dump folder; `checkpoint.exclude_from_loading` (e.g. `optimizer`) loads the model without
that state, which loses it. Its DCP checkpoints carry no config of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.locate import STEP_N
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Settings,
    Skip,
    flatten,
    key_diff,
    lr_fix_edit,
    skip_json,
)

NAME = "torchtitan"
TITLE = "torchtitan"
# The names it gives its checkpoints (`step-N`: the plain name, the step as its one group) and
# their place in `formats.locate`'s listing.
STEP_NAMES = (("torchtitan", STEP_N, 4),)


def owns(ck: Checkpoint) -> bool:
    return ck.format == "dcp"


def _toml(path: Path) -> Path | None:
    """A job config (a TOML with a [training] table) in the dump folder above `step-N/`."""
    import tomllib

    for d in (path.parent, path.parent.parent, path.parent.parent.parent):
        for f in sorted(d.glob("*.toml")) if d.is_dir() else ():
            try:
                if "training" in tomllib.loads(f.read_text()):
                    return f
            except (OSError, ValueError):
                continue
    return None


def settings(ck: Checkpoint) -> Settings:
    import tomllib

    f = _toml(Path(ck.path))
    values = flatten(tomllib.loads(f.read_text())) if f is not None else {}
    return Settings(str(f) if f else None, values, str(Path(ck.path).parent))


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("training.max_norm", v.get("training.max_norm"), float(value))]
    if knob == "eps":
        return [Edit("optimizer.eps", v.get("optimizer.eps"), float(value))]
    if knob == "precision":
        return [
            Edit(
                "training.mixed_precision_param",
                v.get("training.mixed_precision_param"),
                {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}[str(value)],
            )
        ]
    if knob == "lr_scale":
        lr = v.get("optimizer.lr")
        return [
            Edit(
                "optimizer.lr",
                lr,
                lr * float(value) if isinstance(lr, (int, float)) else f"x{float(value):g}",
                "the LR scheduler's state is restored from the checkpoint: check the logged LR",
            )
        ]
    if knob == "lr_fix":
        return [lr_fix_edit(value, "fix the per-group LR factor your optimizer builder sets")]
    return []


def _toml_line(k: str, v: Any) -> str:
    section, _, key = k.rpartition(".")
    return (
        f"[{section}] {key} = {v!r}"
        if not isinstance(v, bool)
        else f"[{section}] {key} = {str(v).lower()}"
    )


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [e for e in edits if not e.key.startswith(LR_FIX_PREFIX)]
    flags = " ".join(f"--{e.key} {e.after}" for e in keys if e.after is not None)
    return key_diff(s.source, keys, _toml_line) + f"\n\n# or as flags: {flags}"


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    return Skip(
        "skip.json",
        skip_json(steps, sample_ids, rows),
        "torchtitan has no skip list: filter the sample ids of skip.json in your dataset",
    )


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    out = [Edit("checkpoint.load_step", s.values.get("checkpoint.load_step"), int(step))]
    excl = s.values.get("checkpoint.exclude_from_loading")
    if excl:
        out.append(
            Edit(
                "checkpoint.exclude_from_loading",
                excl,
                [],
                "excluding the optimizer loses its state",
            )
        )
    return out


# ----------------------------------------------------------------------------- the replay's hooks
# MetricsProcessor's names ("grad_norm" and "lr" are ours already). Its FSDP2 policy
# (`[training] mixed_precision_param`) is read by its checkpoint.py as the `mixed_precision` scalar,
# which replay/precision follows for any run that records one.
LOG_NAMES = {"loss": ("loss_metrics/global_avg_loss",)}
