"""What each trainer calls a metric: one table of names, and the columns a row's LRs and
per-parameter grad norms sit in."""

from __future__ import annotations

import re

__all__ = [
    "ALIASES",
    "canonical",
    "lr_columns",
    "group_lrs",
    "param_grad_columns",
    "IGNORED_TAG_SUFFIXES",
]

# Our name -> the names trainers log it under, first match wins. Where each comes from:
# - OLMo-core: MetricSaverCallback / its trainer's metric names ("train/CE loss",
#   "optim/total grad norm", "optim/LR (group N)").
# - Megatron-LM: training_log()'s TensorBoard / W&B tags ("lm loss", "grad-norm",
#   "learning-rate", "loss-scale", "num-zeros"; megatron/training/training.py) and the same
#   names in its printed line ("lm loss", "grad norm", "learning rate", "loss scale",
#   "number of skipped iterations", "number of nan iterations").
# - HF Trainer: its TensorBoard/W&B/MLflow callbacks prefix "train/" ("train/loss",
#   "train/grad_norm", "train/learning_rate"); trainer_state.json has "loss",
#   "grad_norm", "learning_rate".
# - torchtitan: MetricsProcessor's "loss_metrics/global_avg_loss", "grad_norm", "lr".
# - Lightning: `train_loss` as its docs' self.log examples name it; the total of
#   lightning.pytorch.utilities.grad_norm ("grad_2.0_norm_total").
# - nanoGPT-style loops and the flight recorder: "loss", "grad_norm", "lr".
ALIASES: dict[str, tuple[str, ...]] = {
    "loss": (
        "train/CE loss",
        "lm loss",
        "train/loss",
        "loss_metrics/global_avg_loss",
        "train_loss",
        "train/loss_step",
        "train_loss_step",
    ),
    "grad_norm": (
        "optim/total grad norm",
        "grad-norm",
        "grad norm",
        "train/grad_norm",
        "grad_2.0_norm_total",
    ),
    "lr": (
        "train/learning_rate",
        "learning_rate",
    ),  # Megatron's: readers.megatron_lr (one step later)
    "loss_scale": ("loss-scale", "loss scale", "train/loss_scale"),
    "skipped": ("number of skipped iterations", "skipped-iterations"),
    "nan_iterations": ("number of nan iterations",),
}
# Megatron-LM writes each of its curves a second time against consumed samples (and
# Megatron-DeepSpeed against tokens): another x axis, not steps.
IGNORED_TAG_SUFFIXES = (" vs samples", " vs tokens", " vs steps")

# Per-group LR: OLMo-core's "optim/LR (group 0)", Lightning's LearningRateMonitor
# "lr-AdamW/pg1" (1-based); per-parameter grad norms: OLMo's "optim/grad/<param>.norm",
# or "grad_norm/<param>".
_GROUP_LR = (re.compile(r"^optim/LR \(group (\d+)\)$"), re.compile(r"^lr-[^/]+/pg(\d+)$"))
_PARAM_GRAD = re.compile(r"^(?:optim/grad/|grad_norm/|grad/|grad_[\d.]+_norm/)(.+?)(?:\.norm)?$")


def canonical(rows: dict[int, dict[str, float]], keys: dict[str, str] | None = None) -> None:
    """Add our names (loss, grad_norm, lr, loss_scale, ...) to each row, in place: from
    `keys` (our name -> the log's column) where given, else the first alias present."""
    keys = keys or {}
    for ours in {**dict.fromkeys(ALIASES, ""), **keys}:
        theirs = keys.get(ours, "")
        for d in rows.values():
            if theirs in d:
                d[ours] = d[theirs]
            elif ours not in d:
                alias = next((a for a in ALIASES.get(ours, ()) if a in d), None)
                if alias is not None:
                    d[ours] = d[alias]


def lr_columns(row: dict[str, float]) -> list[str]:
    """The row's LR columns: `lr` and every per-group LR the trainer logged."""
    return [k for k in row if k == "lr" or any(p.match(k) for p in _GROUP_LR)]


def group_lrs(row: dict[str, float], n: int) -> list[float] | None:
    """LR of each of `n` param groups when the log has them all, else None."""
    found: dict[int, float] = {}
    for k, v in row.items():
        for i, p in enumerate(_GROUP_LR):
            m = p.match(k)
            if m:
                found[int(m.group(1)) - (1 if i == 1 else 0)] = v
    return [found[i] for i in range(n)] if n > 0 and all(i in found for i in range(n)) else None


def param_grad_columns(row: dict[str, float]) -> dict[str, str]:
    """Column -> parameter name for per-parameter gradient norms."""
    out = {}
    for k in row:
        m = _PARAM_GRAD.match(k)
        if m and "total" not in m.group(1):
            out[k] = m.group(1)
    return out
