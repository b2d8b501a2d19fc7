"""Lightning: `Trainer(gradient_clip_val=, precision=)`, `configure_optimizers`, `fit(ckpt_path=)`.

A Lightning checkpoint holds the module's `hyper_parameters`, not the Trainer's arguments;
LightningCLI saves those in `config.yaml` in the logger's version folder, which is read when
it is there (its `trainer.*` keys). `trainer.fit(model, ckpt_path=...)` restores the optimizer
(param groups with their LR) and the LR schedulers' state, so an LR changed in
`configure_optimizers` does not reach a resumed run: the plan scales it in `on_train_start`.

For a replay: the model is the `LightningModule` subclass LightningCLI names in
`hyper_parameters` (`_class_path`, subclass mode; `_module_from_class_path` says what it
imports and why); the batches come from a batch log or the flight recorder
(the DataModule is the user's code).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptforensics.core.callables import ModelSpecError, call_factory
from ckptforensics.formats.base import Checkpoint
from ckptforensics.trainers.base import (
    LR_FIX_PREFIX,
    Edit,
    Settings,
    Skip,
    key_diff,
    lr_fix_edit,
    skip_json,
    value_text,
)

if TYPE_CHECKING:
    from torch import nn

NAME = "lightning"
TITLE = "Lightning"
# The names it gives its checkpoints (the step as the one group) and their place in
# `formats.locate`'s listing.
STEP_NAMES = (("Lightning", r"^.*step=(\d+).*\.ckpt$", 5),)
# Where its default layout keeps them: the logger's version folder.
CHECKPOINT_DIRS = ("lightning_logs/version_*/checkpoints",)

_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
_LR_KEYS = ("lr", "learning_rate")


def owns(ck: Checkpoint) -> bool:
    return ck.format == "lightning"


def _cli_config(path: Path) -> Path | None:
    """LightningCLI's `config.yaml` (SaveConfigCallback) in the version folder above the checkpoint."""
    for d in (path.parent, path.parent.parent):
        f = d / "config.yaml"
        if f.is_file():
            return f
    return None


def settings(ck: Checkpoint) -> Settings:
    path = Path(ck.path)
    values: dict[str, Any] = {
        f"model.{k}": v
        for k, v in (ck.config or {}).items()
        if isinstance(v, (int, float, str, bool))
    }
    src = None
    cfg = _cli_config(path)
    if cfg is not None:
        try:
            import yaml  # PyYAML comes with Lightning
        except ImportError:
            cfg = None
    if cfg is not None:
        try:
            doc = yaml.safe_load(cfg.read_text()) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            doc = {}
        for section in ("trainer", "model"):
            for k, v in (
                (doc.get(section) or {}).items() if isinstance(doc.get(section), dict) else ()
            ):
                if isinstance(v, (int, float, str, bool)) or v is None:
                    values[f"{section}.{k}"] = v
        src = str(cfg)
    save = path.parent
    return Settings(
        src, values, str(save), {"cli": cfg is not None, "hparams": sorted(ck.config or {})}
    )


def edits(knob: str, value: Any, s: Settings) -> list[Edit]:
    v = s.values
    if knob == "clip":
        return [Edit("trainer.gradient_clip_val", v.get("trainer.gradient_clip_val"), float(value))]
    if knob == "precision":
        return [Edit("trainer.precision", v.get("trainer.precision"), _PRECISION[str(value)])]
    if knob == "eps":
        return [
            Edit(
                "configure_optimizers: eps",
                None,
                float(value),
                "the optimizer is built in configure_optimizers: pass eps there",
            )
        ]
    if knob == "lr_scale":
        key = next(
            (f"model.{k}" for k in _LR_KEYS if f"model.{k}" in v), "configure_optimizers: lr"
        )
        lr = v.get(key)
        return [
            Edit(
                key,
                lr,
                lr * float(value) if isinstance(lr, (int, float)) else f"x{float(value):g}",
                f"ckpt_path restores the optimizer's param groups and the LR schedulers: scale them in on_train_start (x{float(value):g})",
            )
        ]
    if knob == "lr_fix":
        return [
            lr_fix_edit(
                value,
                f"configure_optimizers (or its scheduler) gives these groups x{1 / value['scale']:.3g} from step {value['from_step']}: fix that factor",
            )
        ]
    return []


def render(edits: Sequence[Edit], s: Settings) -> str:
    keys = [
        e
        for e in edits
        if "." in e.key and ":" not in e.key and not e.key.startswith(LR_FIX_PREFIX)
    ]
    out: list[str] = []
    if s.extra.get("cli"):
        out.append(key_diff(s.source, keys, lambda k, val: f"{k}: {value_text(val)}"))
    else:
        kw = ", ".join(
            f"{e.key.split('.', 1)[1]}={e.after!r}" for e in keys if e.key.startswith("trainer.")
        )
        if kw:
            out.append(
                f"trainer = L.Trainer(..., {kw})  # the run's Trainer arguments are not in its checkpoint"
            )
        out += [
            f"# {e.key}: {value_text(e.before)} -> {value_text(e.after)}"
            for e in keys
            if e.key.startswith("model.")
        ]
    scale = next(
        (
            e
            for e in edits
            if "lr" in e.key
            and isinstance(e.after, (int, float))
            and isinstance(e.before, (int, float))
            and e.before
        ),
        None,
    )
    factor = (
        scale.after / scale.before
        if scale is not None
        else next(
            (
                float(str(e.after)[1:])
                for e in edits
                if isinstance(e.after, str) and e.after.startswith("x")
            ),
            None,
        )
    )
    if factor is not None:
        out += [
            "",
            "def on_train_start(self):  # in the LightningModule: ckpt_path restored the old LR",
            "    for opt in self.trainer.optimizers:",
            "        for g in opt.param_groups:",
            f"            g['lr'] *= {factor:g}",
            "    for cfg in self.trainer.lr_scheduler_configs:",
            f"        cfg.scheduler.base_lrs = [lr * {factor:g} for lr in cfg.scheduler.base_lrs]",
        ]
    return "\n".join(out)


def skip(
    steps: Sequence[int], sample_ids: Sequence[int], rows: dict[int, list[int]], s: Settings
) -> Skip:
    doc = skip_json(steps, sample_ids, rows)
    text = (
        "skip = json.load(open('skip.json'))['sample_ids']  # filter them in your Dataset / DataModule "
        "(Lightning has no skip list of its own)"
    )
    return Skip("skip.json", doc, text)


def resume(rollback: Path, step: int, s: Settings) -> list[Edit]:
    return [Edit("ckpt_path", None, str(rollback), "trainer.fit(model, datamodule, ckpt_path=...)")]


# ----------------------------------------------------------------------------- the replay's hooks
# `train_loss` as its docs' self.log examples name it (`_step`: on_step=True with on_epoch);
# the total of lightning.pytorch.utilities.grad_norm. Per-group LR: LearningRateMonitor's
# "lr-AdamW/pg1" (logs.columns).
LOG_NAMES = {
    "loss": ("train_loss", "train/loss_step", "train_loss_step"),
    "grad_norm": ("grad_2.0_norm_total",),
}


def model(ck: Checkpoint) -> tuple[nn.Module, str] | None:
    """The LightningModule a LightningCLI checkpoint names (subclass mode)."""

    cfg = ck.config
    if not cfg:
        return None
    if "_class_path" in cfg:
        return _module_from_class_path(ck)
    if "_instantiator" in cfg and "model_type" not in cfg:
        # LightningCLI(MyModule) records no class path: only subclass mode (`--model a.B`) does.
        raise ModelSpecError(
            f"{ck.path}: LightningCLI wrote these hyper_parameters with a fixed model class, so they name no "
            "class (`_class_path` is recorded in subclass mode only); pass --model module:MyModule"
        )
    return None


# A class path as LightningCLI records it: jsonargparse's import path, `package.module.Class`.
_CLASS_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# What LightningCLI's `_InstantiatorFn` adds beside the module's own `__init__` arguments.
_LIGHTNING_CLI_KEYS = ("_class_path", "_instantiator")


def _module_from_class_path(ckpt: Checkpoint) -> tuple[nn.Module, str]:
    """The LightningModule a LightningCLI checkpoint names in `hyper_parameters["_class_path"]`,
    called with the hyper-parameters its `__init__` accepts.

    A checkpoint is untrusted input, and the class path only selects code already installed
    here: a dotted name whose top-level module `find_spec` finds (never the standard library,
    where no LightningModule lives) is imported, and the attribute is called only if it is a
    class deriving from lightning's `LightningModule` (`lightning.pytorch` or
    `pytorch_lightning`). Nothing is unpickled; `_instantiator` is never called.
    (Lightning's own `load_from_checkpoint` goes further and imports nothing; a command
    line tool has nothing imported, so it must import the module the path names.)

    Returns:
        (module, its description for `replay.config`).

    Raises:
        ModelSpecError: one line naming the class path, why it is refused, and `--model`.
    """

    cfg = ckpt.config or {}
    path = cfg.get("_class_path")
    where = f"{ckpt.path}: hyper_parameters class path {path!r}"
    if not isinstance(path, str) or not _CLASS_PATH.fullmatch(path):
        raise ModelSpecError(f"{where} is not a dotted Python name; pass --model module:factory")
    mod_name, _, cls_name = path.rpartition(".")
    top = mod_name.split(".")[0]
    if top == "__main__":
        raise ModelSpecError(
            f"{where} is a class of the training script itself (__main__); pass --model path/to/script.py:{cls_name}"
        )
    bases = _lightning_module_classes()
    if not bases:
        raise ModelSpecError(
            f"{where}: building a LightningModule needs lightning installed (pip install lightning), or pass --model module:factory"
        )
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise ModelSpecError(
            f"{where} is not a LightningModule (standard library); refused, pass --model module:factory"
        )
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ModelSpecError(
            f"{where}: module {top!r} is not importable here (install it or put it on PYTHONPATH), or pass --model module:factory"
        )
    try:
        module = importlib.import_module(mod_name)
    except (
        Exception
    ) as e:  # the named module exists but fails to import: bad input, said in one line
        raise ModelSpecError(
            f"{where}: import failed ({type(e).__name__}: {e}); pass --model module:factory"
        ) from None
    cls = getattr(module, cls_name, None)
    # Checked before anything is called: only a LightningModule subclass is ever instantiated.
    if not (isinstance(cls, type) and issubclass(cls, bases)):
        kind = (
            "a class" if isinstance(cls, type) else "missing" if cls is None else type(cls).__name__
        )
        raise ModelSpecError(
            f"{where} is not a LightningModule subclass ({kind}); refused, pass --model module:factory"
        )
    args = {k: v for k, v in cfg.items() if k not in _LIGHTNING_CLI_KEYS}
    return call_factory(
        cls,
        path,
        args,
        what=where,
        source="(class and arguments from the checkpoint's hyper_parameters class path, LightningCLI)",
    )


def _lightning_module_classes() -> tuple[type, ...]:
    """`LightningModule` of each lightning flavour installed (lightning 2.x, pytorch_lightning)."""
    found = []
    for top, mod in (
        ("lightning", "lightning.pytorch"),
        ("pytorch_lightning", "pytorch_lightning"),
    ):
        try:
            if importlib.util.find_spec(top) is None:
                continue
            found.append(importlib.import_module(mod).LightningModule)
        except Exception:  # a broken install is as good as none: the message says to install it
            continue
    return tuple(found)
