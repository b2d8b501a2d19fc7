"""The blocks a report section is written in, and their two renderings: Markdown and HTML.

A section (the resume plan, the recovery checks) is built once, as blocks, from the report
document's data; report.md renders the blocks as Markdown lines and report.html as HTML, so
the two say the same and neither re-parses the other. Inline text is a sequence of spans:
plain strings, `Code` (a key, a path, a command) and `Bold`; blocks are paragraphs, ordered
steps (with notes and a code block of their own), bullets, code blocks and tables.

A block is separated from the one before it by a blank line in Markdown, unless it is
`tight` (a list or a line that continues the paragraph above it); HTML has no blank lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.report.page import esc, table

__all__ = [
    "Code",
    "Bold",
    "Text",
    "Para",
    "Item",
    "Steps",
    "Bullets",
    "Pre",
    "Table",
    "Block",
    "md_table",
    "md_footer",
    "markdown_lines",
    "html_blocks",
]


@dataclass(frozen=True, slots=True)
class Code:
    """Inline code: Markdown `text`, HTML <code>."""

    text: Any


@dataclass(frozen=True, slots=True)
class Bold:
    """Strong text: Markdown **text**, HTML <strong>."""

    text: Any


# A line of inline text: plain strings (written as they are in Markdown, escaped in HTML)
# and spans.
Text = Sequence[str | Code | Bold]


@dataclass(frozen=True, slots=True)
class Para:
    """A paragraph of one line."""

    text: Text
    tight: bool = False


@dataclass(frozen=True, slots=True)
class Pre:
    """A code block, `lang` naming its syntax ('diff') or empty."""

    text: str
    lang: str = ""
    tight: bool = False


@dataclass(frozen=True, slots=True)
class Item:
    """One numbered step: its line, a code block under it, then its notes (sub-bullets)."""

    n: int
    text: Text
    pre: Pre | None = None
    notes: list[Text] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Steps:
    """An ordered list, numbered from its first item's `n`."""

    items: list[Item]
    tight: bool = False


@dataclass(frozen=True, slots=True)
class Bullets:
    """An unordered list."""

    items: list[Text]
    tight: bool = False


@dataclass(frozen=True, slots=True)
class Table:
    """A table of plain cells (any value, written as its `str`)."""

    head: list[str]
    rows: list[list[Any]]
    tight: bool = False


Block = Para | Pre | Steps | Bullets | Table


# --- Markdown ---------------------------------------------------------------------------


def _md(text: Text) -> str:
    return "".join(
        f"`{s.text}`" if isinstance(s, Code) else f"**{s.text}**" if isinstance(s, Bold) else str(s)
        for s in text
    )


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def md_table(head: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines (cells escaped)."""
    return [_row(head), _row(["---"] * len(head)), *(_row(r) for r in rows)]


def md_footer(doc: dict[str, Any]) -> str:
    """The line under a report.md: the command that made it, the tool's version, the schema."""
    inc = doc["incident"]
    return f"<sub>{inc['command']} · ckptforensics {inc['tool_version']} · schema {doc['schema']}</sub>"


def _md_pre(pre: Pre) -> list[str]:
    return ["```" + pre.lang, pre.text, "```"]


def _md_block(b: Block) -> list[str]:
    if isinstance(b, Para):
        return [_md(b.text)]
    if isinstance(b, Pre):
        return _md_pre(b)
    if isinstance(b, Table):
        return md_table(b.head, b.rows)
    if isinstance(b, Bullets):
        return [f"- {_md(t)}" for t in b.items]
    lines = []
    for it in b.items:
        lines.append(f"{it.n}. {_md(it.text)}")
        if it.pre is not None:
            lines += ["", *_md_pre(it.pre)]
        lines += [f"   - {_md(t)}" for t in it.notes]
    return lines


def markdown_lines(blocks: Sequence[Block]) -> list[str]:
    """The blocks as Markdown lines, a blank line between blocks that are not `tight`."""
    lines: list[str] = []
    for i, b in enumerate(blocks):
        if i and not b.tight:
            lines.append("")
        lines += _md_block(b)
    return lines


# --- HTML -------------------------------------------------------------------------------


def _html(text: Text) -> str:
    return "".join(
        f"<code>{esc(s.text)}</code>"
        if isinstance(s, Code)
        else f"<strong>{esc(s.text)}</strong>"
        if isinstance(s, Bold)
        else esc(s)
        for s in text
    )


def _html_pre(pre: Pre) -> str:
    cls = f" class='{esc(pre.lang)}'" if pre.lang else ""
    return f"<pre{cls}>{esc(pre.text)}</pre>"


def _ul(items: Sequence[Text]) -> str:
    return "<ul>" + "".join(f"<li>{_html(t)}</li>" for t in items) + "</ul>"


def _html_block(b: Block) -> str:
    if isinstance(b, Para):
        return f"<p>{_html(b.text)}</p>"
    if isinstance(b, Pre):
        return _html_pre(b)
    if isinstance(b, Table):
        return table(b.head, b.rows)
    if isinstance(b, Bullets):
        return _ul(b.items)
    start = f" start='{b.items[0].n}'" if b.items and b.items[0].n != 1 else ""
    lis = "".join(
        f"<li>{_html(it.text)}"
        + (_html_pre(it.pre) if it.pre is not None else "")
        + (_ul(it.notes) if it.notes else "")
        + "</li>"
        for it in b.items
    )
    return f"<ol{start}>{lis}</ol>"


def html_blocks(blocks: Sequence[Block]) -> str:
    """The blocks as HTML: paragraphs, lists (<ol>/<ul>), <pre>, tables; inline code as <code>."""
    return "".join(_html_block(b) for b in blocks)
