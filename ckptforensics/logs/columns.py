"""What each trainer calls a metric: one table of names (each trainer's, registered as
`trainers` loads), and the columns a row's LRs and per-parameter grad norms sit in."""

from __future__ import annotations

import re

__all__ = [
    "ALIASES",
    "OURS",
    "register_log_names",
    "canonical",
    "lr_columns",
    "group_lrs",
    "param_grad_columns",
    "IGNORED_TAG_SUFFIXES",
]

# Our name -> the names trainers log it under, first match wins: each trainer's `LOG_NAMES`
# (trainers/<t>/: OLMo-core's, Megatron-LM's TensorBoard tags and printed line, the HF
# Trainer's callbacks and trainer_state.json, torchtitan's MetricsProcessor, Lightning's
# self.log names), registered by `trainers` in its `LOG_ORDER` (`register_log_names`).
# nanoGPT-style loops and the flight recorder log our names ("loss", "grad_norm", "lr") as
# they are. Megatron's LR: trainers/megatron/logs.py (one step later).
OURS = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "nan_iterations")
ALIASES: dict[str, tuple[str, ...]] = {k: () for k in OURS}
# Megatron-LM writes each of its curves a second time against consumed samples (and
# Megatron-DeepSpeed against tokens): another x axis, not steps.
IGNORED_TAG_SUFFIXES = (" vs samples", " vs tokens", " vs steps")

# Per-group LR: OLMo-core's "optim/LR (group 0)", Lightning's LearningRateMonitor
# "lr-AdamW/pg1" (1-based); per-parameter grad norms: OLMo's "optim/grad/<param>.norm",
# or "grad_norm/<param>".
_GROUP_LR = (re.compile(r"^optim/LR \(group (\d+)\)$"), re.compile(r"^lr-[^/]+/pg(\d+)$"))
_PARAM_GRAD = re.compile(r"^(?:optim/grad/|grad_norm/|grad/|grad_[\d.]+_norm/)(.+?)(?:\.norm)?$")


def register_log_names(names: dict[str, tuple[str, ...]]) -> None:
    """Add one trainer's names for our metrics (our name -> theirs) after those registered
    before (the first match wins where a log holds several).

    Raises:
        ValueError: a name of ours that is not one (`OURS`).
    """
    unknown = set(names) - set(OURS)
    if unknown:
        raise ValueError(
            f"not metrics of ours: {', '.join(sorted(unknown))} (ours: {', '.join(OURS)})"
        )
    for ours, theirs in names.items():
        ALIASES[ours] += tuple(theirs)


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
