"""The resume plan section, as blocks: rollback, skip, changes with their evidence, resume.

Built from the report document's `plan` dict (`planner.plan_section` made it); report.md,
report.html and `ckptforensics plan`'s terminal output render these same blocks. It formats
what the planner decided and decides nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptforensics.report.blocks import (
    Block,
    Bold,
    Bullets,
    Code,
    Item,
    Para,
    Pre,
    Steps,
    Text,
    inline,
)
from ckptforensics.report.text import finite, fmt

__all__ = ["plan_blocks", "evidence_text"]

_STATUS_WORDS = {
    "verified": "verified by what-if",
    "not_replayed": "not replayed",
    "refuted": "refuted by what-if",
}


def evidence_text(c: dict[str, Any]) -> str:
    """What backs a planned change: the what-if or bisect that verified it, or its status."""
    ev = c.get("evidence")
    if not ev:
        return _STATUS_WORDS[c["status"]]
    if ev["source"] == "bisect":
        return (
            f"verified by bisect (step {ev.get('step')}: the spike goes with rows {ev.get('rows')})"
        )
    steps = ev.get("steps") or []
    span = f" over steps {steps[0]}-{steps[-1]}" if steps else ""
    return (
        f"{_STATUS_WORDS[c['status']]} ({ev['mitigation']}{span}: max loss {finite(ev.get('max_loss'))} vs {finite(ev.get('baseline_max_loss'))} "
        f"without it, max grad norm {finite(ev.get('max_grad_norm'))} vs {finite(ev.get('baseline_max_grad_norm'))})"
    )


def _trainer(p: dict[str, Any]) -> Text:
    if p.get("settings"):
        return [f"Trainer: {p['trainer_title']} (settings read from ", Code(p["settings"]), ")"]
    return [f"Trainer: {p['trainer_title']} (its settings are not in the checkpoint)"]


def _skip(sk: dict[str, Any], n: int) -> Item:
    what = (
        f"samples {sorted(sk['sample_ids'])}"
        if sk["sample_ids"]
        else f"the batch of step{'s' if len(sk['steps']) > 1 else ''} {', '.join(map(str, sk['steps']))}"
    )
    return Item(n, [Bold("Skip"), f" {what} ({sk['format']}):"], pre=Pre(sk["text"]))


def _change(c: dict[str, Any], n: int) -> Item:
    keys: list[str | Code | Bold] = []
    for i, e in enumerate(c["edits"]):
        keys += [", "] if i else []
        keys += [Code(e["key"]), f" {fmt(e['before'])} → {fmt(e['after'])}"]
    if not keys:
        keys = [f"{c['knob']}={c['value']}"]
    return Item(
        n,
        [Bold("Change"), " ", *keys, f": {c['why']}; {evidence_text(c)}."],
        notes=[inline(e["note"]) for e in c["edits"] if e["note"]],
    )


def _code_like(x: Any) -> bool:
    """A resume value that is statements to run (a hand-written loop's load), not a setting."""
    return isinstance(x, str) and ("(" in x or ";" in x or "\n" in x)


def _resume(resume: list[dict[str, Any]], n: int) -> Item:
    """The resume keys; a value that is code to run goes in a code block under the step, one
    statement a line, with what it does."""
    text: list[str | Code | Bold] = [Bold("Resume"), ": "]
    pre = None
    for i, e in enumerate(resume):
        if _code_like(e["after"]) and pre is None:
            pre = Pre("\n".join(x.strip() for x in str(e["after"]).split("; ")), "python")
            text += ["; "] if i else []
            text += [e["note"] or f"run this ({e['key']})"]
            continue
        text += ["; "] if i else []
        text += [Code(e["key"]), " = ", Code(e["after"])]
        text += [f" ({e['note']})"] if e["note"] else []
    return Item(n, [*text, ":" if pre is not None else "."], pre=pre)


def plan_blocks(
    p: dict[str, Any], run_dir: str | None = None, plan_dir: str | None = None
) -> list[Block]:
    """The resume plan as a ticket reads it: rollback, skip, changes with their evidence, the
    diff of the run's own settings, the resume keys and the recovery command.

    Args:
        p: the report document's `plan` (empty: no blocks; not ready: why there is none).
        run_dir: the run directory the recovery command names (default: the rollback
            checkpoint's parent).
        plan_dir: the directory this plan's report is written to, which the recovery
            command's `--plan` names (None: not written yet, a placeholder said so).
    """
    if not p:
        return []
    if p["status"] != "ready":
        return [
            Para(
                [
                    f"No resume plan ({p['status'].replace('_', ' ')}): "
                    + "; ".join(p.get("notes") or [])
                    + "."
                ]
            )
        ]
    r = p["rollback"]
    # 1) roll back, 2) skip, then one step per change; a skip knob's evidence is a note of
    # the step before it (the skip's own).
    steps = [
        Item(
            1,
            [Bold("Roll back to"), " ", Code(r["path"]), f" (step {r['step']}): {r['why']}."],
            notes=[["passed over: ", *inline(note)] for note in r.get("skipped") or []],
        )
    ]
    if p.get("skip"):
        steps.append(_skip(p["skip"], len(steps) + 1))
    for c in p["changes"]:
        if c["knob"] in ("skip_samples", "skip_step"):
            steps[-1].notes.append([f"{c['knob']}: {evidence_text(c)}"])
        else:
            steps.append(_change(c, len(steps) + 1))
    blocks: list[Block] = [Para(_trainer(p)), Steps(steps)]
    if p.get("config_diff"):
        blocks.append(Pre(p["config_diff"], "diff"))
    n = len(steps) + 1
    if p.get("resume"):
        blocks.append(Steps([_resume(p["resume"], n)]))
    rd = run_dir or str(Path(r["path"]).parent)
    command = f"ckptforensics recovery --run-dir {rd} --resumed-from {r['step']} --plan {plan_dir or 'PLAN_DIR'}"
    after = "." if plan_dir else " (PLAN_DIR: the directory this plan is written to with --out)."
    blocks.append(Para(["Then, once the resumed run has trained a while: ", Code(command), after]))
    also = [
        [
            f"also replayed: {alt['mitigation']} ({'on track' if alt['on_track'] else 'leaves the track'}, max loss {finite(alt.get('max_loss'))})"
        ]
        for alt in p.get("alternatives") or []
    ]
    also += [inline(note) for note in p.get("notes") or []]
    if also:
        blocks.append(Bullets(also, tight=True))
    return blocks
