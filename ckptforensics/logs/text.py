"""The text logs, read line by line: JSONL and CSV (a CSVLogger's; W&B's CSV exports). Every
line that parses is read; a line that does not (cut short by a torn write, bytes that are not
UTF-8, a row with fields missing) is skipped and said (`Leg.skipped`: "line 31: truncated
JSON"), never the whole log refused for it. Registered here as formats (`registry`), JSONL
last: the catch-all."""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs.readers import mtime, numbers, split_legs
from ckptforensics.logs.registry import Leg, Rows, register_format, step_key, step_rule

__all__ = ["Skipped", "text_lines", "text_legs"]

# Skipped lines, each "line N: why" (`Leg.skipped`).
Skipped = list[str]


def text_lines(path: Path) -> tuple[list[tuple[int, str]], Skipped]:
    """A text log's lines, (line number from 1, text) each, decoded one by one: a line whose
    bytes are not UTF-8 (a torn write, a binary blob) is skipped and said, never the whole
    log refused for it. Blank lines are dropped."""
    lines: list[tuple[int, str]] = []
    skipped: Skipped = []
    data = path.read_bytes()
    sep = b"\n" if b"\n" in data or b"\r" not in data else b"\r"  # old Mac line ends: \r alone
    for n, raw in enumerate(data.split(sep), 1):
        try:  # a byte-order mark opens some exported CSVs: not part of the first column's name
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8").rstrip("\r")
        except UnicodeDecodeError:
            skipped.append(f"line {n}: not UTF-8 text (binary bytes)")
            continue
        if text.strip():
            lines.append((n, text))
    return lines, skipped


def text_legs(
    path: Path, read: Callable[[Path], tuple[list[Rows], Skipped]], kind: str
) -> list[Leg]:
    """`file_legs` for a reader that skips lines it cannot read: the lines skipped ride on
    the file's first leg (a leg with no rows where no line was read)."""
    t = mtime(path)
    legs, skipped = read(path)
    out = [Leg(str(path), rows, t, i, kind) for i, rows in enumerate(legs)]
    if skipped:
        first = out[0] if out else Leg(str(path), {}, t, 0, kind)
        out[:1] = [replace(first, skipped=tuple(skipped))]
    return out


def _binary(text: str) -> bool:
    return any(ord(c) < 32 and c != "\t" for c in text)


def _jsonl(path: Path) -> tuple[list[Rows], Skipped]:
    lines, skipped = text_lines(path)
    seq = []
    for n, line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            s = line.strip()
            why = (
                "binary bytes"
                if _binary(line)
                else "truncated JSON"
                if s.startswith("{") and not s.endswith("}")
                else "not JSON"
            )
            skipped.append(f"line {n}: {why}")
            continue
        if isinstance(r, dict) and "step" in r:
            try:
                step = int(r["step"])
            except (TypeError, ValueError, OverflowError):
                skipped.append(f"line {n}: its step {r['step']!r} is not a number")
                continue
            seq.append((step, numbers(r, ("step",))))
    return split_legs(seq), sorted(skipped, key=_line_no)


def _line_no(note: str) -> int:
    return int(note.split(":", 1)[0].removeprefix("line "))


# W&B's chart export ("Export CSV"): "Step" plus "<run name> - <key>" and its "__MIN" /
# "__MAX" band columns; its run-table export (`run.history()`): "_step" and the keys.
_WANDB_EXPORT = re.compile(r"^(?:.+ - )?(.+?)(?:__MIN|__MAX)?$")


def _csv(path: Path) -> tuple[list[Rows], Skipped]:
    lines, skipped = text_lines(path)
    reader = csv.DictReader([text for _, text in lines])
    records = []
    for r in reader:  # line_num: the lines read so far (a quoted field may span several)
        records.append((lines[reader.line_num - 1][0] if lines else 0, r))
    if not records:
        return [], skipped
    cols = set(reader.fieldnames or ())
    # A trainer's logger may name its step column, or count one behind (`step_rule`); else
    # W&B's chart export's "Step", the trainer's own step column (`step_key`), step or _step.
    rule_col, rule_behind = step_rule(path, "csv", cols)
    wandb_chart = "Step" in cols and any(" - " in c for c in cols)
    trainer_step, key_behind = step_key(cols) or (None, 0)
    col = (
        rule_col
        or ("Step" if wandb_chart else None)
        or trainer_step
        or ("step" if "step" in cols else "_step" if "_step" in cols else None)
    )
    if col is None:
        raise ForensicsError(
            f"{path}: a CSV log needs a step column (step, _step, Step, iter or a trainer's global_step)"
        )
    shift = max(rule_behind, key_behind)
    seq = []
    for n, r in records:
        if None in r or None in r.values():  # more fields than the header, or fewer
            got = sum(v is not None for k, v in r.items() if k is not None) + len(r.get(None) or [])  # type: ignore[call-overload]
            skipped.append(f"line {n}: {got} fields where the header has {len(cols)} (a torn row)")
            continue
        if r.get(col) in (None, ""):
            continue
        try:
            step = int(float(r[col]))
        except (TypeError, ValueError, OverflowError):
            skipped.append(f"line {n}: its step {r[col]!r} is not a number")
            continue
        vals = numbers(
            {k: v for k, v in r.items() if k and not k.endswith(("__MIN", "__MAX"))},
            ("step", col, "Step", "_step", "_runtime", "_timestamp"),
        )
        if wandb_chart:
            vals = {_WANDB_EXPORT.match(k).group(1): v for k, v in vals.items()}  # type: ignore[union-attr]
        seq.append((step + shift, vals))
    return split_legs(seq), sorted(skipped, key=_line_no)


register_format("csv", lambda p: p.suffix == ".csv", lambda p: text_legs(p, _csv, "csv"), order=50)
register_format("jsonl", lambda p: True, lambda p: text_legs(p, _jsonl, "jsonl"), order=100)
