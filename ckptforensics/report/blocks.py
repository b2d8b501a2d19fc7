"""The blocks a report is written in, and their two renderings: Markdown and HTML.

A report is a list of `Section`s, each built once, as blocks, from the report document's
data; report.md renders them as Markdown lines and report.html as HTML, so the two say the
same and neither re-parses the other. Inline text is a sequence of spans: plain strings,
`Code` (a key, a path, a command) and `Bold`; blocks are paragraphs, ordered steps (with
notes and a code block of their own), bullets, facts (label: value), code blocks and tables,
whose cells may be spans too. A text the document carries with `code` in backticks (a
recommended action) is read into spans by `inline`.

A block is separated from the one before it by a blank line in Markdown, unless it is
`tight` (a list or a line that continues the paragraph above it); HTML has no blank lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.report.page import esc

__all__ = [
    "Code",
    "Bold",
    "Spans",
    "Text",
    "inline",
    "Facts",
    "Section",
    "sections_markdown",
    "sections_html",
    "Para",
    "Item",
    "Steps",
    "Bullets",
    "Pre",
    "Table",
    "Block",
    "md_table",
    "md_text",
    "html_text",
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
class Spans:
    """A table cell of mixed inline text (a message with `code` in it, read by `inline`)."""

    text: Text


def inline(text: str) -> list[str | Code | Bold]:
    """A text the document carries, its `code` in backticks (a recommended action, a cause's
    note), as spans: every other piece between backticks is code.

    Example:
        >>> inline("run `ckptforensics bisect` next")
        ['run ', Code(text='ckptforensics bisect'), ' next']
    """
    parts = str(text).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code in it, the text as it is
        return [str(text)]
    return [Code(p) if i % 2 else p for i, p in enumerate(parts) if p]


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
    """A table: a cell is a span (`Code`, `Bold`) or any value, written as its `str`. A `note`
    under it says what its terms mean."""

    head: list[Any]
    rows: list[list[Any]]
    tight: bool = False
    note: str = ""


@dataclass(frozen=True, slots=True)
class Facts:
    """Labelled facts: Markdown `- **label**: value` lines; HTML a table of rows, each headed by
    its label (no header row)."""

    rows: list[tuple[str, Text]]
    tight: bool = False


Block = Para | Pre | Steps | Bullets | Table | Facts


@dataclass(frozen=True, slots=True)
class Section:
    """A titled part of a report: open (Markdown **title**, HTML <h2>) or `collapsed` (a
    <details> in both); an empty `title` adds its blocks with no heading."""

    title: str
    blocks: list[Block]
    collapsed: bool = False


# --- Markdown ---------------------------------------------------------------------------


def md_text(text: Text) -> str:
    """A line of spans as Markdown: `code`, **bold**, plain strings as they are."""
    return _md(text)


def _md(text: Text) -> str:
    return "".join(
        f"`{s.text}`" if isinstance(s, Code) else f"**{s.text}**" if isinstance(s, Bold) else str(s)
        for s in text
    )


def _md_cell(c: Any) -> str:
    if isinstance(c, Spans):
        return "".join(_md_cell(x) for x in c.text)
    if isinstance(c, Code):  # a backtick inside code would end it
        return "`" + str(c.text).replace("`", "'") + "`"
    return _md([c]) if isinstance(c, Bold) else str(c)


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(_md_cell(c).replace("|", "\\|") for c in cells) + " |"


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
        return md_table(b.head, b.rows) + (["", b.note] if b.note else [])
    if isinstance(b, Facts):
        return [f"- **{label}**: {_md(text)}" for label, text in b.rows]
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


def sections_markdown(sections: Sequence[Section]) -> list[str]:
    """The sections as Markdown lines: each after a blank line, its title in bold, or
    collapsed in <details>."""
    lines: list[str] = []
    for sec in sections:
        if not sec.blocks:
            continue
        if sec.collapsed:
            lines += ["", f"<details><summary>{sec.title}</summary>", ""]
            lines += [*markdown_lines(sec.blocks), "", "</details>"]
        else:
            lines += ["", f"**{sec.title}**"] if sec.title else []
            lines += ["", *markdown_lines(sec.blocks)]
    return lines


# --- HTML -------------------------------------------------------------------------------


def html_text(text: Text) -> str:
    """A line of spans as HTML: <code>, <strong>, plain strings escaped."""
    return _html(text)


def _html(text: Text) -> str:
    return "".join(
        f"<code>{esc(s.text)}</code>"
        if isinstance(s, Code)
        else f"<strong>{esc(s.text)}</strong>"
        if isinstance(s, Bold)
        else esc(s)
        for s in text
    )


def _html_cell(c: Any, tag: str) -> str:
    if isinstance(c, Spans):
        return f"<{tag}>{_html(c.text)}</{tag}>"
    return f"<{tag}>{_html([c]) if isinstance(c, (Code, Bold)) else esc(c)}</{tag}>"


def _html_table(head: list[Any], rows: list[list[Any]]) -> str:
    h = "".join(_html_cell(c, "th") for c in head)
    body = "".join("<tr>" + "".join(_html_cell(c, "td") for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


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
        note = f"<p class='note'>{esc(b.note)}</p>" if b.note else ""
        return _html_table(b.head, b.rows) + note
    if isinstance(b, Facts):
        rows = "".join(f"<tr><th>{esc(k)}</th><td>{_html(t)}</td></tr>" for k, t in b.rows)
        return f"<table class='facts'>{rows}</table>"
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


def sections_html(sections: Sequence[Section]) -> list[str]:
    """The sections as HTML parts: an <h2> and its blocks, or a <details> for a collapsed one."""
    out = []
    for sec in sections:
        if not sec.blocks:
            continue
        body = html_blocks(sec.blocks)
        if sec.collapsed:
            out.append(f"<details><summary>{esc(sec.title)}</summary>{body}</details>")
        else:
            out.append((f"<h2>{esc(sec.title)}</h2>" if sec.title else "") + body)
    return out
