"""The words a report leads with: the verdict box's sentence, paths relative to the run, the
ranking of layers stated once, and what the statistics in its tables mean.

Everything here formats fields the verdict settled (`verdict.py`); nothing is decided. Plain
words come first and the statistic after them ("3.4x its trend (robust z 7.6)").
"""

from __future__ import annotations

import os
from typing import Any

from ckptforensics.report.blocks import Code, Text
from ckptforensics.report.regress import regress_headline
from ckptforensics.report.text import fmt

__all__ = ["run_dir", "rel", "headline", "layers_text", "how_far", "explain", "GLOSSARY"]


def run_dir(doc: dict[str, Any]) -> str | None:
    """The directory holding the report's checkpoints (the common parent of *before* and
    *after*), as the command was given it; None where they share none."""
    inc = doc["incident"]
    paths = [str(inc[k]["path"]) for k in ("before", "after") if inc.get(k)]
    parents = {os.path.dirname(p.rstrip("/")) for p in paths}
    if len(parents) == 1:
        return parents.pop() or None
    try:
        common = os.path.commonpath(list(parents))
    except ValueError:  # one absolute, one relative
        return None
    return common or None


def rel(path: Any, root: str | None) -> str:
    """`path` relative to `root` where it lies under it, else as it is."""
    p = str(path)
    if root and p.startswith(root.rstrip("/") + "/"):
        return p[len(root.rstrip("/")) + 1 :]
    return p


def _words(cause: str) -> str:
    return cause.replace("_", " ")


def _list(xs: list[Any]) -> str:
    return ", ".join(str(x) for x in xs)


def _where(v: dict[str, Any]) -> Text:
    """The rows, else the layer, else the element or tensor the verdict names."""
    rows = v.get("anomalous_samples") or []
    if rows:
        ids = [s["sample_id"] for s in rows if s.get("sample_id") is not None]
        said = f" (sample ids {_list(ids)})" if len(ids) == len(rows) else ""
        return [f": rows {_list([s['index'] for s in rows])}{said} carry the spike"]
    layer = v.get("first_anomalous_module") or (v.get("exploding_layers") or [None])[0]
    if layer:
        return [", first in ", Code(layer)]
    if v.get("corrupted_elements"):
        e = v["corrupted_elements"][0]
        part = f", in its {e['part']}" if e.get("part") else ""
        return [": ", Code(f"{e['tensor']}{e['index']}"), f" {fmt(e['before'])} → {fmt(e['after'])} ({e['kind']}{part})"]  # fmt: skip
    if v.get("overflowing_tensors"):
        o = v["overflowing_tensors"][0]
        return [": ", Code(o["name"]), f" at its {o['dtype']} limit"]
    return []


def headline(doc: dict[str, Any]) -> Text:
    """The verdict box: one sentence of cause, step, and rows or layer, then the rollback,
    checkpoints named relative to the run directory."""
    v, inc = doc["verdict"], doc["incident"]
    root = run_dir(doc)
    before = rel(inc["before"]["path"], root)
    wi = doc.get("whatif") or {}
    if wi and not doc.get("replay"):  # a what-if compares mitigations; it diagnoses nothing
        ids = wi.get("auto_sample_ids") or {}
        if wi.get("recommended") == "skip_samples=auto" and ids:  # the rows it found, by id
            said = "; ".join(f"{_list(x)} of step {k}" for k, x in ids.items())
            what: Text = [f"skipping samples {said} (", Code(wi["recommended"]), ") keeps the run on track"]  # fmt: skip
        elif wi.get("recommended"):
            what = [Code(wi["recommended"]), " keeps the run on track"]
        elif wi.get("baseline_on_track"):
            what = ["the run stays on track with no mitigation"]
        else:
            what = ["no mitigation tried keeps the run on track"]
        return ["What-if from ", Code(before), ": ", *what, "."]
    if doc.get("regress"):  # two versions of the code compared; no incident, no rollback
        return regress_headline(doc["regress"], before)
    top = v["causes"][0]["cause"]
    if top == "none" and doc.get("history"):  # every checkpoint followed, none left its trend
        n = len(doc["history"].get("checkpoints") or [])
        return ["No module left its trend from ", Code(before), " to ", Code(rel(inc["after"]["path"], root)), f" ({n} checkpoints)."]  # fmt: skip
    if top == "none":
        return ["No anomaly between ", Code(before), " and ", Code(rel(inc["after"]["path"], root)), "."]  # fmt: skip
    step = f" at step {fmt(v['first_bad_step'])}" if v.get("first_bad_step") is not None else ""
    out: list[Any] = [_words(top).capitalize() + step, *_where(v), "."]
    if v.get("rollback_checkpoint"):
        out += [" Roll back to ", Code(rel(v["rollback_checkpoint"], root)), "."]
    else:
        out += [" No checkpoint here is safe to roll back to: roll back further than ", Code(before), "."]  # fmt: skip
    return out


def layers_text(v: dict[str, Any]) -> Text:
    """The layers the verdict names, one ranking stated once: the first to leave its range
    leads (where the replay saw one), then the rest as the verdict ranks them."""
    first = v.get("first_anomalous_module")
    rest = [m for m in v.get("exploding_layers") or [] if m != first][:5]
    out: list[Any] = []
    if first:
        out += [Code(first), " went first"]
        if rest:
            out += ["; then "]
    for i, m in enumerate(rest):
        out += [", "] if i else []
        out += [Code(m)]
    if rest and not first:
        out += [" (furthest from its range first)"]
    return out


def how_far(value: Any, baseline: Any, z: Any, against: str = "its trend") -> str:
    """Plain words first, the statistic after: '3.4× its trend (robust z 7.6)'."""
    if isinstance(value, (int, float)) and isinstance(baseline, (int, float)) and baseline:
        words = f"{value / baseline:.2g}× {against}"
    else:
        words = f"far from {against}"
    return words + (f" (robust z {z:.1f})" if isinstance(z, (int, float)) else "")


# What a statistic in a report's tables and findings means, said where it appears.
GLOSSARY = {
    "r_v": "r_v: the gradient energy a tensor saw over the window against what Adam's second "
    "moment remembered from before (about 1 as usual; far above 1, a gradient burst)",
    "RMS_t": "RMS_t: the root mean square of gradient² / Adam's second moment (about 1 as usual; "
    "far above 1, the moment is stale and Adam's updates go sign-like; StableAdamW)",
    "log Z": "log Z: the log of the softmax's normaliser over the output logits (near 0 is "
    "healthy; a drift away from 0 is what z-loss holds back)",
    "sign-like share": "sign-like share: the share of a tensor's elements whose Adam update is "
    "near its largest, |m|/√v over 0.9 (the update goes by the gradient's sign alone)",
    "robust z": "robust z: how many robust spreads (median absolute deviations) a figure lies "
    "from the median of its peers",
}


def explain(*texts: Any) -> str:
    """What the terms of GLOSSARY that appear in `texts` mean, one sentence ('' for none)."""
    said = " ".join(str(t) for t in texts)
    found = [GLOSSARY[k] for k in GLOSSARY if k in said]
    return ("; ".join(found) + ".") if found else ""
