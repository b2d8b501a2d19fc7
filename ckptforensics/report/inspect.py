"""`inspect`'s document (one checkpoint's summary and completeness) and its text rendering.

The document is what `inspect --json` prints and `cf.inspect(...).doc` holds; the text is
what the CLI prints, rendered here so that a notebook gets the same lines.
"""

from __future__ import annotations

import math
from typing import Any

from ckptforensics.report.document import clean
from ckptforensics.report.page import esc, page

__all__ = [
    "INSPECT_SCHEMA",
    "NOT_VERIFIED",
    "inspect_doc",
    "render_inspect_text",
    "render_inspect_html",
]

INSPECT_SCHEMA = "ckptforensics.inspect/1"


# What `checksums` says when the bytes were not checked (plain `inspect`).
NOT_VERIFIED = "not checked (--verify reads every file whole and checks each zip member's CRC-32)"


def inspect_doc(summary: Any, whole: Any, verified: Any = None) -> dict[str, Any]:
    """The document of one checkpoint's summary (`summary.CheckpointSummary`), its
    completeness (`formats.Completeness`) and, with --verify, its checksums
    (`formats.Verification`)."""
    return {
        "schema": INSPECT_SCHEMA,
        **clean(summary),
        "completeness": {
            "complete": whole.complete,
            "checked": whole.checked,
            "rule": whole.rule,
            "problems": list(whole.problems),
        },
        "files": whole.summary(),
        "checksums": verified.summary() if verified is not None else NOT_VERIFIED,
    }


def _headroom(t: dict[str, Any]) -> float:
    h = t.get("headroom")
    return math.inf if h is None else float(h)


def render_inspect_text(doc: dict[str, Any], show_all: bool = False) -> str:
    """The summary as the CLI prints it: the notable tensors (non-finite, headroom < 2x),
    or every tensor with `show_all`."""
    lines = [
        f"{doc['path']}: {doc['format']}, step {doc['step'] if doc['step'] is not None else '?'}",
        f"  files: {doc['files']}",
        f"  checksums: {doc.get('checksums', NOT_VERIFIED)}",
    ]
    dtypes = ", ".join(f"{k}: {v}" for k, v in doc["dtypes"].items())
    lines.append(f"  {doc['parameters']:,} parameters in {doc['tensors']} tensors ({dtypes})")
    o = doc.get("optimizer")
    if o:
        lines.append(
            f"  optimizer: {o['kind']}, step {o['step']}, {o['params_with_state']} params with state (ids mapped by {o['mapping']})"
        )
        for i, g in enumerate(o["groups"]):
            lines.append(
                f"    group {i}: {g['params']} params, lr {g['lr']:.4g}, betas {g['betas']}, eps {g['eps']:g}, weight_decay {g['weight_decay']:g}"
                + (f", initial_lr {g['initial_lr']:.4g}" if g["initial_lr"] else "")
            )
    else:
        lines.append("  optimizer: none (weights only)")
    for key, label in (("loss_scale", "loss scale"), ("scheduler", "scheduler")):
        if key in doc["scalars"]:
            lines.append(f"  {label}: {doc['scalars'][key]}")
    lines += [f"  note: {n}" for n in doc["notes"]]
    per = doc["per_tensor"]
    bad = sum(1 for t in per if t["nonfinite"])
    finite = [t for t in per if math.isfinite(_headroom(t))]
    least = "—"
    if finite:
        t = min(finite, key=_headroom)
        least = f"{t['name']} ({t['dtype']}, max|x| {t['max_abs']:.3g}, {_headroom(t):.3g}x)"
    lines.append(f"  non-finite: {bad} tensors; least headroom: {least}")
    for t in per:
        if show_all or t["nonfinite"] or _headroom(t) < 2:
            lines.append(
                f"    {t['name']} {list(t['shape'])} {t['dtype']}: max|x| {t['max_abs']:.4g}, headroom {_headroom(t):.3g}x, non-finite {t['nonfinite']}"
            )
    return "\n".join(lines) + "\n"


def render_inspect_html(doc: dict[str, Any]) -> str:
    """The text, every tensor listed, as one self-contained page."""
    body = f"<pre>{esc(render_inspect_text(doc, show_all=True))}</pre>"
    return page("ckptforensics inspect", [body]) + "\n"
