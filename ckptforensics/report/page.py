"""The one HTML page shell: head, stylesheet, tables, footer and inline images of every page.

report.html (each report kind, triage's too) and inspect's page are all written through
`page`, so they share one head (charset, title, stylesheet) and stay self-contained: no
script, no font, nothing fetched from a network; plots are inline PNGs (`png`).
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

__all__ = ["CSS", "NO_PLOTS", "esc", "table", "ol", "page", "footer", "png", "num"]

CSS = """body{font:14px/1.45 system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
.summary{background:#fff6e5;border-left:4px solid #e8a33d;padding:.6em 1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f5f5f5}code{background:#f3f3f3;padding:0 3px}pre{background:#f7f7f7;padding:.5em;overflow-x:auto}
li>ul{margin:.2em 0}.plots img{max-width:100%;border:1px solid #eee;margin:.4em 0}
table.facts th{background:none;font-weight:600;white-space:nowrap}.note{color:#555;font-size:.92em}
details{margin:.8em 0}details>summary{font-size:1.1em;font-weight:600;cursor:pointer}"""


def esc(x: Any) -> str:
    """Any value as HTML text (its `str`, escaped)."""
    return html.escape(str(x))


def table(head: list[str], rows: list[list[Any]]) -> str:
    """A table of plain cells (escaped), `head` as its header row."""
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def ol(items: list[Any]) -> str:
    """An ordered list of plain items (escaped): the recommended actions, the next steps."""
    return "<ol>" + "".join(f"<li>{esc(x)}</li>" for x in items) + "</ol>"


# Where matplotlib is not installed a page says so once, in place of its plots, and how to
# get them.
NO_PLOTS = (
    "<p class='note'><em>No plots: they need matplotlib. Install the plots extra "
    "(<code>pip install 'ckptforensics[plots]'</code>), then render this page again from its "
    "evidence: <code>ckptforensics report evidence.h5 --to html --out report.html</code>. "
    "The tables follow.</em></p>"
)


def page(title: str, body: list[str]) -> str:
    """A whole page: the shared head titled `title`, then the `body` parts (HTML), one a line.

    Example:
        >>> page("ckptforensics triage", ["<h1>ckptforensics: triage</h1>"]).splitlines()[-1]
        '</body></html>'
    """
    head = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
        f"<style>{CSS}</style></head><body>"
    )
    return "\n".join([head, *body, "</body></html>"])


def footer(doc: dict[str, Any]) -> str:
    """The line under a report: the command that made it, the tool's version, the schema."""
    inc = doc["incident"]
    return (
        f"<p><small>{esc(inc['command'])} · ckptforensics {esc(inc['tool_version'])} · "
        f"{esc(doc['schema'])}</small></p>"
    )


def num(x: Any) -> float:
    """Report numbers are JSON: non-finite values were stored as null."""
    return (
        float(x)
        if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        else float("nan")
    )


def png(fig: Any, alt: str = "plot") -> str:
    """A matplotlib figure as an inline <img> (PNG, base64) that `alt` describes; the figure
    is closed."""
    import matplotlib.pyplot as plt  # optional (the plots extra): only a caller with a figure gets here

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
