"""report.md: the verdict on the first screen, details in <details> blocks below.

The page is the report's sections (`sections`), the same report.html renders; here only its
title line, the verdict box in bold and the footer are Markdown's own. A recovery's and an
audit's page are `recovery`'s and `audit`'s. Figures are written by `text`.
"""

from __future__ import annotations

from typing import Any

from ckptforensics.report.audit import render_audit_markdown
from ckptforensics.report.blocks import markdown_lines, md_footer, md_table, md_text
from ckptforensics.report.blocks import sections_markdown as _sections
from ckptforensics.report.plan import plan_blocks
from ckptforensics.report.recovery import recovery_blocks, render_recovery_markdown
from ckptforensics.report.sections import detail_sections, report_sections, title
from ckptforensics.report.text import fmt, reproduces
from ckptforensics.report.words import headline

__all__ = ["render_markdown", "fmt", "md_table", "reproduces", "plan_lines", "recovery_lines"]


def plan_lines(
    p: dict[str, Any], run_dir: str | None = None, plan_dir: str | None = None
) -> list[str]:
    """The resume plan as Markdown lines (`plan.plan_blocks`)."""
    return markdown_lines(plan_blocks(p, run_dir, plan_dir))


def recovery_lines(r: dict[str, Any]) -> list[str]:
    """The recovery section as Markdown lines (`recovery.recovery_blocks`)."""
    return markdown_lines(recovery_blocks(r))


def render_markdown(doc: dict[str, Any]) -> str:
    """report.md of any report document (a recovery's and an audit's have their own page):
    the verdict box first, then the sections report.html renders too."""
    if doc.get("recovery"):
        return render_recovery_markdown(doc)
    if doc.get("audit"):
        return render_audit_markdown(doc)
    lines = [f"# ckptforensics: {title(doc)}", "", f"**{md_text(headline(doc))}**"]
    lines += _sections([*report_sections(doc), *detail_sections(doc)])
    lines += ["", md_footer(doc), ""]
    return "\n".join(lines)
