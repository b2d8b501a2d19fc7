"""Megatron-LM's training log: its printed iteration lines (a format of their own, found in a
run's `*.log`, `*.out`, `*.txt`) and its LR column, logged a step early in whatever format
carries it; both registered with `logs` as this module loads."""

from __future__ import annotations

import re
from pathlib import Path

from ckptforensics.logs.readers import file_legs, split_legs
from ckptforensics.logs.registry import (
    Rows,
    RunFiles,
    register_finder,
    register_format,
    register_rows,
)

__all__ = ["LINE", "iteration_line", "is_printed_log", "LR_COLUMNS", "lr_from_next_line"]

# megatron/training/training.py training_log(): " [date] iteration {:8d}/{:8d} | consumed
# samples: {:12d} | ... | learning rate: {:.6E} | global batch size: {:5d} | lm loss: {:.6E}
# | loss scale: {:.1f} | grad norm: {:.3f} | ... | number of skipped iterations: {:3d} |
# number of nan iterations: {:3d} |" (older Megatron-LM and Megatron-DeepSpeed: no date,
# "learning rate: {:.3E}", plus "consumed tokens", "actual seqlen", "samples per second",
# "TFLOPs"). Each line is printed every --log-interval iterations; its losses average the
# interval's advanced (not skipped) iterations; "iteration N" counts iterations done.
LINE = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_FIELD = re.compile(r"\s*([^|:]+?)\s*:\s*([-+0-9.eEinfa]+)\s*$")


def iteration_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(iteration, {field: value}) of one printed iteration line, or None."""
    m = LINE.search(line)
    if not m:
        return None
    vals: dict[str, float] = {}
    for part in m.group(3).split("|"):
        f = _FIELD.match(part)
        if f:
            try:
                vals[f.group(1)] = float(f.group(2))
            except ValueError:
                continue
    return int(m.group(1)), vals


def _printed(path: Path) -> list[Rows]:
    seq = []
    with path.open(errors="replace") as f:
        for line in f:
            got = iteration_line(line)
            if got is not None:
                # An interval whose iterations were all skipped averages no loss: Megatron-LM
                # prints its 0.0 (`if avg >= 0.0`), which is no loss.
                if got[1].get("lm loss") == 0.0:
                    del got[1]["lm loss"]
                seq.append(got)
    return split_legs(seq)


def is_printed_log(path: Path) -> bool:
    """A text file with at least one Megatron iteration line in its first 256 KiB."""
    try:
        with path.open(errors="replace") as f:
            head = f.read(1 << 18)
    except OSError:
        return False
    return any(LINE.search(line) and "|" in line for line in head.splitlines())


# Megatron-LM logs, at iteration N, the LR its scheduler has just set: the one iteration N + 1
# uses (train(): training_log(..., get_canonical_lr_for_logging(optimizer.param_groups)) after
# train_step's opt_param_scheduler.step). Measured on fixtures/megatron_log_run.py: a fault
# from iteration 30 on shows in the line of iteration 29.
LR_COLUMNS = ("learning rate", "learning-rate")


def lr_from_next_line(rows: Rows) -> Rows:
    """`lr` of each step from Megatron's LR column one step earlier (its first step has none)."""
    col = next((c for c in LR_COLUMNS if any(c in r for r in rows.values())), None)
    if col is None:
        return rows
    last = max(rows)
    for s, v in [(s, r[col]) for s, r in rows.items() if col in r and s < last]:
        rows.setdefault(s + 1, {})["lr"] = v
    return dict(sorted(rows.items()))


def _printed_logs(run: RunFiles) -> list[Path]:
    return [f for f in run.files if f.suffix in (".log", ".out", ".txt") and is_printed_log(f)]


register_format("megatron", is_printed_log, lambda p: file_legs(p, _printed, "megatron"), order=70)
register_rows("megatron-lr", lr_from_next_line)
register_finder(
    "megatron", _printed_logs, order=70, what="Megatron's printed log (*.log, *.out, *.txt)"
)
