"""A plain training loop (torch.save / safetensors files, LitGPT, a user's own loop): no config
to diff, so each change is the line of PyTorch the loop needs, and a skip is `skip.json`.

For a replay: a LitGPT run's model is `litgpt.GPT` from its `model_config.yaml` (litgpt
installed); any other loop's is `--model`, or transformers' from a `config.json`. Its batches
come from a batch log or the flight recorder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptforensics.core.callables import ModelSpecError
from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Recorded,
    Settings,
    Skip,
    first_count,
    first_number,
    lr_fix_edit,
    skip_json,
    value_at,
)
from ckptforensics.trainers.loop.checkpoint import hyperparameters

if TYPE_CHECKING:
    from torch import nn

NAME = "loop"
TITLE = "training loop"
# The names own loops give their checkpoints, whatever the padding: a word that says what
# the file or folder holds, then the step (`ckpt_60.pt`, `model_60.pt`, `checkpoint_step_60/`);
# or a file named by any prefix before `step` (modded-nanogpt's `state_step000060.pt`,
# `run3_step60.pt`; a file only: the flight recorder's `blackbox-step40/` is no checkpoint).
# Neither reads another trainer's name another way: HF's `checkpoint-60` and DeepSpeed's
# `global_step60` read as the same step; `iter_N`, `step_N` and Lightning's
# `epoch=0-step=60.ckpt` do not match.
_EXT = r"\.(?:pt|pth|bin|safetensors|ckpt)"
STEP_NAMES = (
    (
        "own loop",
        r"^(?:(?:ckpt|checkpoint|model|state|weights|snapshot)[-_]?(?:step|iter)?"
        rf"|(?=.*{_EXT}$)[A-Za-z][A-Za-z0-9]*(?:[-_][A-Za-z][A-Za-z0-9]*)*[-_]step)"
        rf"[-_]?(\d+)(?:{_EXT})?$",
        6,
    ),
)

_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def owns(ck: Checkpoint) -> bool:
    return True


def settings(ck: Checkpoint) -> Settings:
    tc = ck.scalars.get("train_config")
    return Settings(
        f"{ck.path} (train config)" if isinstance(tc, dict) else None,
        dict(tc or {}),
        str(Path(ck.path).parent),
    )


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("clip_grad_norm_ max_norm", v.get("grad_clip"), float(value))]
    if knob == "lr_scale":
        return [Edit("LR scale (every param group, every step)", None, float(value))]
    if knob == "lr_fix":
        return [lr_fix_edit(value, f"x{value['scale']:.3g}: fix the factor your loop gives them")]
    if knob == "precision":
        return [Edit("autocast dtype", None, str(value))]
    if knob == "eps":
        return [Edit("AdamW eps", None, float(value))]
    return []


def render(edits: Sequence[Edit], s: Settings) -> str:
    lines = []
    for e in edits:
        if e.key.startswith("clip_grad_norm_"):
            lines.append(
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), {e.after:g})  # was {e.before if e.before is not None else 'not recorded'}"
            )
        elif e.key.startswith("LR scale"):
            lines.append(
                f"for g in optimizer.param_groups: g['lr'] *= {e.after:g}  # after the schedule sets it, every step"
            )
        elif e.key.startswith(LR_FIX_PREFIX):
            groups = e.key.split("[", 1)[1].split("]", 1)[0]
            lines.append(
                f"# {e.key}: {e.before:.4g} -> {e.after:.4g} (the schedule's); the factor your loop gives groups [{groups}] is the bug"
            )
        elif e.key == "autocast dtype":
            lines.append(
                "# fp32: run the forward pass without torch.autocast (and without a GradScaler)"
                if e.after == "fp32"
                else f"with torch.autocast(device_type, dtype={_DTYPE[str(e.after)]}):  # bf16 needs no GradScaler"
            )
        elif e.key == "AdamW eps":
            lines.append(f"for g in optimizer.param_groups: g['eps'] = {e.after:g}")
    return "\n".join(lines)


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    doc = skip_json(steps, sample_ids, rows)
    text = (
        "skip = json.load(open('skip.json'))  # in the loop, before the forward pass:\n"
        "keep = [i for i, sid in enumerate(sample_ids) if sid not in set(skip['sample_ids'])]  # or rows[str(step)]\n"
        "batch = {k: v[keep] for k, v in batch.items()}"
    )
    return Skip("skip.json", doc, text)


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    return [
        Edit(
            "load",
            None,
            f"ck = torch.load({str(rollback)!r}, weights_only=True); model.load_state_dict(ck['model']); "
            f"optimizer.load_state_dict(ck['optimizer']); start = {int(step)} + 1",
            "load the optimizer state too: a fresh AdamW restarts its moments and bias correction",
        )
    ]


# ----------------------------------------------------------------------------- the replay's hooks
def model(ck: Checkpoint) -> tuple[nn.Module, str] | None:
    """LitGPT: `litgpt.GPT` from `model_config.yaml` (the Config's fields it knows)."""
    if ck.format != "litgpt" or not ck.config:
        return None

    try:
        from litgpt import GPT, Config  # type: ignore[import-not-found]
    except ImportError:
        raise ModelSpecError(
            f"{ck.path}: building a LitGPT model needs litgpt (pip install litgpt), or pass --model module:factory"
        ) from None
    import dataclasses

    known = {f.name for f in dataclasses.fields(Config)}
    return GPT(
        Config(**{k: v for k, v in ck.config.items() if k in known})
    ), "litgpt.GPT from model_config.yaml"


def _precision(doc: dict[str, Any]) -> tuple[str, str] | None:
    """`precision: bf16-mixed` / `16-mixed` / `bf16-true` as a precision mode."""
    lit = str(value_at(doc, ("precision",)) or "")
    if not lit.startswith(("bf16", "16")):
        return None
    return ("bf16" if lit.startswith("bf16") else "fp16"), f"hyperparameters.yaml precision {lit}"


def recorded(ck: Checkpoint) -> Recorded | None:
    """LitGPT's hyperparameters.yaml: `train.max_norm`, `train.lr_warmup_steps`,
    `train.max_steps`, `precision`."""

    doc = hyperparameters(Path(ck.path))
    if doc is None:
        return None
    warm = first_number("litgpt", doc, (("train", "lr_warmup_steps"),))
    return Recorded(
        "litgpt",
        doc,
        clip=first_number("litgpt", doc, (("train", "max_norm"),)),
        warmup=(int(warm[0]), warm[1]) if warm else None,
        total_steps=first_count(doc, (("train", "max_steps"),)),
        precision=_precision(doc),
    )
