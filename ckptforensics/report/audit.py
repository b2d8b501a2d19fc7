"""An audit report's renderings: the architecture found, then every check as a row (risks
first), in markdown and HTML. They format what `audit` decided and decide nothing."""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.report.blocks import (
    Block,
    Facts,
    Item,
    Para,
    Steps,
    html_blocks,
    inline,
    markdown_lines,
    md_footer,
    md_table,
)
from ckptforensics.report.page import esc, footer, page, table
from ckptforensics.report.text import fmt
from ckptforensics.report.words import explain

__all__ = ["render_audit_markdown", "render_audit_html", "is_audit"]

_MARK = {
    ("risk", "critical"): "CRITICAL",
    ("risk", "warning"): "warning",
    ("risk", "info"): "info",
    ("ok", "info"): "ok",
    ("unknown", "info"): "—",
}


def is_audit(doc: dict[str, Any]) -> bool:
    return bool(doc.get("audit"))


def _value(v: Any) -> str:
    """A row's figure for people: numbers through `fmt`; a dict as its first entries (a
    per-module dict as its largest entry); the full figure is in report.json."""
    if isinstance(v, dict):
        nums = {
            k: x
            for k, x in v.items()
            if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
        }
        if nums and len(nums) == len(v) and len(v) > 4:
            k = max(nums, key=lambda n: nums[n])
            return f"max {fmt(nums[k])} ({k}) of {len(v)}"
        items = [(k, x) for k, x in v.items() if x is not None and k != "batch"][:4]
        return ", ".join(f"{k} {_value(x)}" for k, x in items) + (
            " ..." if len(v) > len(items) + ("batch" in v) else ""
        )
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v[:4]) + (" ..." if len(v) > 4 else "")
    return fmt(v)


def _rows(doc: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            _MARK.get((r["status"], r["severity"]), r["status"]),
            r["area"],
            r["id"],
            _value(r["value"]),
            _value(r["threshold"]),
            r["message"],
            r["source"],
        ]
        for r in doc["audit"]["rows"]
    ]


_HEAD = ["", "area", "check", "measured", "threshold", "what it means", "source"]


def _arch_facts(a: dict[str, Any]) -> list[Block]:
    """The architecture found, as labelled facts (a table with no header row in HTML), and
    what its statistics mean."""
    rows = _arch_rows(a)
    note = explain(*(k for k, _ in rows))
    return [Facts([(str(k), [str(x)]) for k, x in rows]), *([Para([note])] if note else [])]


def _actions(v: dict[str, Any]) -> Steps:
    """The recommended actions, numbered, their `code` as code."""
    return Steps([Item(i, inline(x)) for i, x in enumerate(v["recommended_actions"], 1)])


def _arch_rows(a: dict[str, Any]) -> list[list[Any]]:
    layers = a.get("layers") or []
    rows = [
        ["norm placement", a.get("norm_placement") or "—"],
        ["QK-norm", fmt(a.get("qk_norm"))],
        ["attention layers", len(layers)],
        ["tied embeddings", fmt(a.get("tied_embeddings"))],
        ["final soft-cap", fmt(a.get("final_softcap"))],
        ["embedding output RMS", fmt(a.get("embed_rms"))],
        ["log Z / max logit", f"{fmt(a.get('log_z'))} / {fmt(a.get('logit_max'))}"],
    ]
    if a.get("note"):
        rows.append(["not traced", a["note"]])
    return rows


def _layer_rows(a: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            x["module"],
            x["placement"],
            fmt(x["qk_norm"]),
            x["heads"],
            fmt(x["max_logit"]),
            fmt(x["entropy"]),
            fmt(x["stream_rms"]),
        ]
        for x in a.get("layers") or []
    ]


_LAYER_HEAD = [
    "attention module",
    "placement",
    "QK-norm",
    "heads",
    "max logit",
    "entropy (of uniform)",
    "stream RMS",
]


def render_audit_markdown(doc: dict[str, Any]) -> str:
    """report.md of an audit: the counts, the architecture, every check, the actions."""
    v, au, a = doc["verdict"], doc["audit"], doc.get("architecture") or {}
    c = au["counts"]
    lines = [
        f"# ckptforensics audit: {c['critical']} critical, {c['warning']} warning, {c['info']} info",
        "",
        f"**{v['summary']}**",
        "",
        f"- **Checkpoint**: `{au['checkpoint']}` (step {fmt(au['step'])})",
        "- **Compared with**: "
        + (
            f"`{au['compared_with']['path']}` (step {fmt(au['compared_with']['step'])})"
            if au.get("compared_with")
            else "—"
        ),
        f"- **Probed on**: {au['batch']}",
        "- **Exposed to**: "
        + ", ".join(f"{x['cause']} ({x['confidence']:.0%})" for x in v["causes"]),
        "",
        "**Architecture (from the traced forward pass)**",
        "",
        *markdown_lines(_arch_facts(a)),
        "",
        "**Checks**",
        "",
        *md_table(_HEAD, _rows(doc)),
    ]
    if v["recommended_actions"]:
        lines += ["", "**Recommended actions**", "", *markdown_lines([_actions(v)])]
    if a.get("layers"):
        lines += [
            "",
            f"<details><summary>Attention layers ({len(a['layers'])})</summary>",
            "",
            *md_table(_LAYER_HEAD, _layer_rows(a)),
            "",
            "</details>",
        ]
    if au.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in au["notes"]]
    lines += ["", md_footer(doc), ""]
    return "\n".join(lines)


def render_audit_html(doc: dict[str, Any]) -> str:
    """report.html of an audit: the same rows as report.md, as one page."""
    v, au, a = doc["verdict"], doc["audit"], doc.get("architecture") or {}
    c = au["counts"]
    parts = [
        f"<h1>ckptforensics audit: {c['critical']} critical, {c['warning']} warning, {c['info']} info</h1>",
        f"<p class='summary'>{esc(v['summary'])}</p>",
        html_blocks(
            [
                Facts(
                    [
                        ("checkpoint", [f"{au['checkpoint']} (step {fmt(au['step'])})"]),
                        (
                            "compared with",
                            [
                                f"{au['compared_with']['path']} (step {fmt(au['compared_with']['step'])})"
                                if au.get("compared_with")
                                else "—"
                            ],
                        ),
                        ("probed on", [au["batch"]]),
                        (
                            "exposed to",
                            [
                                ", ".join(
                                    f"{x['cause']} ({x['confidence']:.0%})" for x in v["causes"]
                                )
                            ],
                        ),
                    ]
                )
            ]
        ),
        "<h2>Architecture</h2>" + html_blocks(_arch_facts(a)),
        "<h2>Checks</h2>" + table(_HEAD, _rows(doc)),
    ]
    if v["recommended_actions"]:
        parts.append("<h2>Recommended actions</h2>" + html_blocks([_actions(v)]))
    if a.get("layers"):
        parts.append("<h2>Attention layers</h2>" + table(_LAYER_HEAD, _layer_rows(a)))
    parts.append(footer(doc))
    return page("ckptforensics audit", parts)
