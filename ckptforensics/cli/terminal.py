"""A report's blocks as plain lines for a terminal: no Markdown marks, code indented.

report.md and report.html render the same blocks (`report.blocks`); a terminal gets the
words alone, so what `plan` prints reads as the other commands' summaries do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plain_lines"]


def _text(spans: Any) -> str:
    return "".join(str(getattr(s, "text", s)) for s in spans)


def plain_lines(blocks: Sequence[Any], indent: str = "") -> list[str]:
    """`blocks` (report.blocks' Para, Pre, Steps, Bullets, Facts, Table) as lines of plain
    text; a block of another kind is passed over.

    Example:
        >>> from ckptforensics.report.blocks import Bold, Code, Item, Steps
        >>> plain_lines([Steps([Item(1, [Bold("Roll back to"), " ", Code("step_30.pt")])])])
        ['1. Roll back to step_30.pt']
    """
    out: list[str] = []
    for b in blocks:
        kind = type(b).__name__
        if kind == "Para":
            out.append(indent + _text(b.text))
        elif kind == "Pre":
            out += [f"{indent}      {line}" for line in b.text.splitlines()]
        elif kind == "Steps":
            for item in b.items:
                out.append(f"{indent}{item.n}. {_text(item.text)}")
                if item.pre is not None:
                    out += plain_lines([item.pre], indent)
                out += [f"{indent}   - {_text(note)}" for note in item.notes]
        elif kind == "Bullets":
            out += [f"{indent}- {_text(item)}" for item in b.items]
        elif kind == "Facts":
            out += [f"{indent}{label}: {_text(value)}" for label, value in b.rows]
        elif kind == "Table":
            out.append(indent + "  ".join(str(h) for h in b.head))
            out += [indent + "  ".join(_text([c]) for c in row) for row in b.rows]
    return out
