"""The resume plan: from a report's verdict, its what-if results and the run's own settings,
the checkpoint to roll back to, the data to skip and the config changes, in the trainer's terms.

Every replay, bisect and what-if report carries a `plan` section (`plan_section`); the `plan`
command replays the window and the mitigations the cause calls for first (`mitigations`), so
that each change it proposes is marked verified by a what-if, with the replayed figures, or
not replayed. `recovery` later checks the resumed run against the plan's `expect` block.

Over 400 lines: the plan's parts (rollback, skips, changes, verification) read one another's
results in order; each trainer's knowledge is in trainers/ already, each cause's in
detectors/causes.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptforensics.checkpoints import first_complete, list_checkpoints
from ckptforensics.detectors.causes import figures, lookup
from ckptforensics.engine.whatif import INVASIVENESS, parse_mitigation
from ckptforensics.formats.base import Checkpoint
from ckptforensics.planner_adam import EPS, OPTIMIZER_KEY, AdamRun, adam_change, adam_run
from ckptforensics.trainers import Edit, planner_for
from ckptforensics.trainers.settings import run_settings

__all__ = ["Change", "mitigations", "plan_section", "merge_reports", "PLAN_STATUSES"]

PLAN_STATUSES = ("ready", "no_incident", "no_rollback")

# Knobs in the order a plan applies them (whatif.INVASIVENESS, plus the per-group LR fix a
# replay's LR finding names, which no what-if knob replays).
_ORDER = ("lr_fix", *INVASIVENESS)


@dataclass(frozen=True, slots=True)
class Change:
    """One change of the plan: the knob (`clip`, `lr_scale`, `skip_samples`...) and its value,
    the edits that make it in the trainer's own keys, and how it is known to help.

    Attributes:
        status: 'verified' (a what-if or the bisection replayed it and the run stayed on
            track), 'not_replayed' (what the cause calls for; nothing replayed it), or
            'refuted' (a what-if replayed it and the run left its track).
        evidence: the replayed figures (mitigation, max loss, max grad norm, the band).
    """

    knob: str
    value: Any
    edits: tuple[Edit, ...]
    status: str
    why: str
    evidence: dict[str, Any] | None = None
    from_step: int | None = None
    groups: tuple[int, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "value": self.value,
            "from_step": self.from_step,
            "groups": list(self.groups),
            "status": self.status,
            "why": self.why,
            "evidence": self.evidence,
            "edits": [
                {"key": e.key, "before": e.before, "after": e.after, "note": e.note}
                for e in self.edits
            ],
        }


def _lr_jump(findings: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The replay's LR step jump (`lr_step_jump`: step, groups, the LR before and at it)."""
    f = next((f for f in findings if f.get("kind") == "lr_step_jump"), None)
    if f is None:
        return None
    m = f["metrics"]
    if not (m.get("lr_before") and m.get("lr")):
        return None
    jump = float(m["lr"]) / float(m["lr_before"])
    return {
        "from_step": int(m["step"]),
        "groups": [int(g) for g in m.get("groups") or [m.get("group", 0)]],
        "lr": float(m["lr"]),
        "lr_before": float(m["lr_before"]),
        "scale": 1.0 / jump,
    }


def _half(x: Any) -> float:
    """Half the run's clip, or 1.0 where it clipped at nothing (the usual pre-training clip,
    GPT-3 / Llama / OLMo configs)."""
    return round(float(x) / 2, 6) if isinstance(x, (int, float)) and x > 0 else 1.0


def _cause(doc: dict[str, Any]) -> str:
    """The report's leading cause ("none" where it names none)."""
    v = doc["verdict"]
    return v["causes"][0]["cause"] if v["causes"] else "none"


def mitigations(doc: dict[str, Any], clip: float | None = None) -> list[str]:
    """The what-ifs a cause calls for (`--try` strings), least invasive first: its record's
    `tries` (detectors.causes), or its `jump_tries` where the replay dates an LR jump, with
    the report's figures filled in (half the clip, the onset, 1 / the jump); a try whose
    figure the report lacks is left out. A hardware fault and a healthy run call for none.
    """
    cause = lookup(_cause(doc))
    onset = doc["verdict"].get("first_bad_step")
    jump = _lr_jump(doc.get("findings") or [])
    tries = cause.jump_tries if cause.jump_tries and jump is not None else cause.tries
    known = {
        "half_clip": _half(clip),
        "onset": onset,
        "jump_scale": jump["scale"] if jump is not None else None,
    }
    return [t.format(**known) for t in tries if all(known[f] is not None for f in figures(t))]


def merge_reports(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several reports of one incident (a replay or bisect, a what-if) as one document: the
    diagnosing report's verdict and findings, each report's own section."""
    diag = next((d for d in docs if not (d.get("whatif") and not d.get("replay"))), docs[0])
    out = dict(diag)
    for d in docs:
        for k in ("replay", "bisect", "whatif", "diff"):
            if d.get(k) and not out.get(k):
                out[k] = d[k]
    return out


def _parse(text: str) -> list[tuple[str, str]]:
    return list(parse_mitigation(text).knobs)


def _value(knob: str, raw: str) -> Any:
    if knob in ("clip", "eps", "lr_scale"):
        return float(raw)
    if knob == "skip_step":
        return int(float(raw))
    return raw


def _evidence(o: dict[str, Any], w: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "source": "whatif",
        "mitigation": o["mitigation"],
        "on_track": o["on_track"],
        "steps": [o["steps"][0], o["steps"][-1]] if o.get("steps") else [],
        # A skipped step is not replayed: the figures are of the steps around it.
        "skipped_steps": list(o.get("skipped_steps") or []),
        "max_loss": o.get("max_loss"),
        "max_grad_norm": o.get("max_grad_norm"),
        "final_loss": o.get("final_loss"),
        "baseline_max_loss": (base or {}).get("max_loss"),
        "baseline_max_grad_norm": (base or {}).get("max_grad_norm"),
        "band": {
            "loss": [w.get("level"), w.get("band")],
            "grad_norm": [w.get("grad_norm_level"), w.get("grad_norm_band")],
        },
    }


def _whatif_changes(
    w: dict[str, Any],
) -> tuple[list[tuple[str, Any, str, dict[str, Any]]], list[tuple[str, dict[str, Any]]]]:
    """(knob, value, status, evidence) of the recommended mitigation's knobs; and every other
    mitigation the what-if replayed, with its outcome (for the notes)."""
    outcomes = w.get("outcomes") or []
    base = next((o for o in outcomes if o["mitigation"] == "baseline"), None)
    chosen: list[tuple[str, Any, str, dict[str, Any]]] = []
    others: list[tuple[str, dict[str, Any]]] = []
    for o in outcomes:
        if o["mitigation"] == "baseline":
            continue
        if o["mitigation"] == w.get("recommended"):
            ev = _evidence(o, w, base)
            chosen = [(k, _value(k, raw), "verified", ev) for k, raw in _parse(o["mitigation"])]
        else:
            others.append((o["mitigation"], _evidence(o, w, base)))
    return chosen, others


def _cause_changes(
    doc: dict[str, Any], clip: Any, adam: AdamRun | None = None
) -> list[tuple[str, Any, str, dict[str, Any] | None]]:
    """What the cause calls for where no what-if replayed a mitigation on track: the LR fix
    where the replay dates the jump that is its fault, else the first of its record's
    `changes` (detectors.causes) whose figures the report has."""
    v = doc["verdict"]
    cause = lookup(_cause(doc))
    jump = _lr_jump(doc.get("findings") or [])
    if cause.jump_tries and jump is not None:
        return [("lr_fix", jump, "not_replayed", None)]
    bis = doc.get("bisect") or {}
    known = {
        "{half_clip}": _half(clip),
        "{onset}": int(v["first_bad_step"]) if v.get("first_bad_step") is not None else None,
        "{culprits}": "culprits" if v.get("anomalous_samples") or bis.get("rows") else None,
        "{safe_beta2}": adam.safe_beta2 if adam is not None else None,
        "{raised_eps}": adam.raised_eps if adam is not None else EPS,
    }
    for knob, raw in cause.changes:
        value = known[raw] if isinstance(raw, str) and raw in known else raw
        if value is None:
            continue
        ev = None
        if knob == "skip_samples" and bis.get("rows"):
            ev = {
                "source": "bisect",
                "step": bis.get("first_bad_step"),
                "rows": bis["rows"],
                "presence_spikes": bis.get("presence_spikes"),
                "evaluations": bis.get("replays"),
            }
        return [(knob, value, "verified" if ev else "not_replayed", ev)]
    return []


def _culprits(doc: dict[str, Any]) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """(steps, sample ids, step -> rows) to skip: the what-if's skipped rows, else the
    bisection's, else the verdict's anomalous samples at its first bad step."""
    w = doc.get("whatif") or {}
    rec = next(
        (
            o
            for o in w.get("outcomes") or []
            if o["mitigation"] == w.get("recommended") and o.get("skipped_rows")
        ),
        None,
    )
    if rec is not None:
        rows = {int(k): list(v) for k, v in rec["skipped_rows"].items()}
        ids = [
            int(x) for v in (w.get("auto_sample_ids") or {}).values() for x in v if x is not None
        ]
        return sorted(rows), ids, rows
    bis = (doc.get("bisect") or {}).get("skip") or {}
    if bis.get("steps"):
        return (
            list(bis["steps"]),
            list(bis.get("sample_ids") or []),
            {int(k): list(v) for k, v in (bis.get("rows") or {}).items()},
        )
    v = doc["verdict"]
    s = v.get("first_bad_step")
    samples = v.get("anomalous_samples") or []
    if s is None or not samples:
        return [], [], {}
    return (
        [int(s)],
        [int(x["sample_id"]) for x in samples if x.get("sample_id") is not None],
        {int(s): [int(x["index"]) for x in samples]},
    )


def _rollback(ck: Checkpoint, onset: int | None) -> tuple[tuple[int, Path] | None, list[str], Path]:
    """The last complete checkpoint before the onset in the run dir of `ck` (the checkpoint of
    step c holds the state after c's update: safe when c < onset); `ck` itself without an onset."""
    path = Path(ck.path)
    run_dir = (
        path.parent.parent
        if path.parent.name == "checkpoints" and path.suffix == ".ckpt"
        else path.parent
    )
    cands = list_checkpoints(run_dir)
    if not any(p == path or p.resolve() == path.resolve() for _, p in cands):
        cands = [(ck.step, path)] if ck.step is not None else []
    limit = onset if onset is not None else (ck.step + 1 if ck.step is not None else None)
    safe = [(s, p) for s, p in cands if limit is None or s < limit]
    back, skipped = first_complete(safe[::-1])
    return back, skipped, run_dir


def _knob_edits(planner: Any, knob: str, value: Any, s: Any) -> tuple[Edit, ...]:
    return tuple(planner.edits(knob, value, s))


def plan_section(doc: dict[str, Any], ck: Checkpoint) -> dict[str, Any]:
    """The report's `plan` block: the resume in the trainer's own terms.

    Args:
        doc: the report document (verdict, findings, and the replay, bisect and whatif
            sections it has).
        ck: the report's *before* checkpoint, open (its format names the trainer and its
            files hold the run's settings).

    Returns:
        The plan section (report/schema.json `plan`).
    """
    v = doc["verdict"]
    cause = _cause(doc)
    w = doc.get("whatif") or {}
    planner = planner_for(ck)
    s = planner.settings(ck)
    out: dict[str, Any] = {
        "status": "ready",
        "trainer": planner.NAME,
        "trainer_title": planner.TITLE,
        "settings": s.source,
        "cause": cause,
        "onset": v.get("first_bad_step"),
        "rollback": None,
        "skip": None,
        "changes": [],
        "config_diff": "",
        "resume": [],
        "expect": {},
        "alternatives": [],
        "notes": [],
    }
    healthy = cause == "none" or (cause == "undiagnosed" and w.get("baseline_on_track"))
    if healthy and not w.get("recommended"):
        out["status"] = "no_incident"
        out["notes"].append("nothing to resume from: the run stays on its track")
        return out
    onset = v.get("first_bad_step")
    back, skipped, run_dir = _rollback(ck, onset)
    out["notes"] += skipped
    if back is None:
        out["status"] = "no_rollback"
        out["notes"].append(
            f"no complete checkpoint before step {onset} in {run_dir}: nothing safe to resume from"
        )
        return out
    r_step, r_path = back
    out["rollback"] = {
        "path": str(r_path),
        "step": r_step,
        "skipped": skipped,
        "why": f"the last complete checkpoint before the onset (step {onset})"
        if onset is not None
        else "the what-if's starting checkpoint",
    }
    clip = (
        (doc.get("replay") or {}).get("config", {}).get("clip", {}).get("value")
        if doc.get("replay")
        else (w.get("clip") or {}).get("value")
    )
    if clip is None:  # a diff's report: the clip the run recorded (else "half" is no change)
        clip = run_settings(ck).clip
    adam = adam_run(doc, ck)
    chosen: list[tuple[str, Any, str, dict[str, Any] | None]]
    others: list[tuple[str, dict[str, Any]]] = []
    if w.get("outcomes"):
        picked, others = _whatif_changes(w)
        chosen = list(picked)
        if not chosen:
            out["notes"].append(
                "no mitigation the what-if tried kept the run on track: the changes below are what the cause calls for, not replayed"
            )
            chosen = _cause_changes(doc, clip, adam)
    else:
        chosen = _cause_changes(doc, clip, adam)
    # The per-group LR a replay names is the fault itself: fix it whatever else helps.
    jump = _lr_jump(doc.get("findings") or [])
    if jump is not None and lookup(cause).jump_tries and not any(k == "lr_fix" for k, *_ in chosen):
        chosen.insert(0, ("lr_fix", jump, "not_replayed", None))
    if jump is not None and any(k == "lr_fix" for k, *_ in chosen):
        # The what-if's `lr_scale={jump_scale}` replays the fix itself (the whole LR scaled back
        # by the jump); on top of `lr_fix` it would scale the fixed LR down once more.
        undo = [c for c in chosen if c[0] == "lr_scale" and _is_jump_scale(c[1], jump["scale"])]
        if undo:
            chosen = [c for c in chosen if c not in undo]
            out["notes"].append(
                f"lr_scale={undo[0][1]:g} (what the what-if replayed) is the LR fix itself: the plan fixes the "
                "jumped LR (lr_fix) and does not scale it again"
            )
    steps, ids, rows = _culprits(doc)
    changes: list[Change] = []
    for knob, value, status, ev in sorted(
        chosen, key=lambda c: _ORDER.index(c[0]) if c[0] in _ORDER else len(_ORDER)
    ):
        if knob in ("skip_samples", "skip_step"):
            if knob == "skip_step":
                steps, ids, rows = [int(value)], [], {}
            why = f"the batch of step {steps[0]} drives the spike" if steps else "the culprit rows"
            changes.append(
                Change(
                    knob,
                    {
                        "steps": steps,
                        "sample_ids": ids,
                        "rows": {str(k): x for k, x in rows.items()},
                    },
                    (),
                    status,
                    why,
                    ev,
                )
            )
            continue
        if knob == "lr_fix":
            why = f"the logged LR of groups {value['groups']} jumps {1 / value['scale']:.3g}x at step {value['from_step']} ({value['lr_before']:.3g} -> {value['lr']:.3g})"
            changes.append(
                Change(
                    knob,
                    value["scale"],
                    _knob_edits(planner, knob, value, s),
                    status,
                    why,
                    ev,
                    value["from_step"],
                    tuple(value["groups"]),
                )
            )
            continue
        if knob == "reset_moments":
            changes.append(Change(knob, value, (), status, "the what-if zeroed these moments", ev))
            continue
        why = {"clip": "a lower clip bounds the bad steps' updates", "lr_scale": "a lower LR keeps the update within what the loss tolerates",
               "precision": "the overflow is the precision's", "eps": "a larger epsilon damps updates of a stale second moment"}.get(knob, "")  # fmt: skip
        edits = _knob_edits(planner, knob, value, s)
        if adam is not None and knob in ("eps", "beta2"):
            why, edits = adam_change(knob, value, adam, why, edits)
        changes.append(Change(knob, value, edits, status, why, ev))
    out["changes"] = [c.as_dict() for c in changes]
    skip_change = next((c for c in changes if c.knob in ("skip_samples", "skip_step")), None)
    if skip_change is not None:
        sk = (
            planner.skip(steps, ids, rows, s)
            if skip_change.knob == "skip_samples"
            else planner.skip(steps, [], {}, s)
        )
        out["skip"] = {
            "steps": steps,
            "sample_ids": ids,
            "rows": {str(k): x for k, x in rows.items()},
            "format": sk.format,
            "value": sk.value,
            "text": sk.text,
        }
    edits = [e for c in changes for e in c.edits if not e.key.startswith(OPTIMIZER_KEY)]
    resume = planner.resume(r_path, r_step, s)
    out["resume"] = [
        {"key": e.key, "before": e.before, "after": e.after, "note": e.note} for e in resume
    ]
    out["config_diff"] = planner.render([*edits, *resume], s)
    out["alternatives"] = [{"mitigation": m, **ev} for m, ev in others]
    out["expect"] = _expect(doc, changes, r_step, steps, ids, onset, clip)
    out["notes"] += _notes(changes, cause, v.get("first_anomalous_module"))
    return out


def _expect(
    doc: dict[str, Any],
    changes: Sequence[Change],
    resumed_from: int,
    steps: list[int],
    ids: list[int],
    onset: int | None,
    clip: Any,
) -> dict[str, Any]:
    """What a resumed run that applied the plan logs: the LR per step (the run's logged LR
    times the plan's scale), the clip, the precision, the skipped samples."""
    by = {c.knob: c for c in changes}
    logged = {
        **((doc.get("replay") or {}).get("history") or {}),
        **((doc.get("replay") or {}).get("logged") or {}),
    }
    scale = float(by["lr_scale"].value) if "lr_scale" in by else 1.0
    fix = by.get("lr_fix")
    lr: dict[str, float] = {}
    for k, row in logged.items():
        if (
            int(k) > resumed_from
            and isinstance(row.get("lr"), (int, float))
            and math.isfinite(row["lr"])
        ):
            f = scale * (
                float(fix.value)
                if fix is not None
                and fix.from_step is not None
                and int(k) >= fix.from_step
                and 0 in fix.groups
                else 1.0
            )
            lr[k] = float(row["lr"]) * f
    return {
        "resumed_from": resumed_from,
        "onset": onset,
        "clip": float(by["clip"].value)
        if "clip" in by
        else (float(clip) if isinstance(clip, (int, float)) else None),
        "precision": by["precision"].value if "precision" in by else None,
        "lr_scale": scale if "lr_scale" in by else None,
        "lr": lr,
        "skip_steps": steps if "skip_step" in by else [],
        "skip_sample_ids": ids if "skip_samples" in by else [],
        "skip_sample_steps": steps
        if "skip_samples" in by
        else [],  # where the skipped samples came
    }


def _notes(changes: Sequence[Change], cause: str, layer: str | None = None) -> list[str]:
    out = []
    note = lookup(cause).plan_note
    if note is not None:
        out.append(note.format(what=cause.replace("_", " "), layer=layer or "the affected layers"))
    if not changes and note is None:
        out.append(
            f"no change is known to help with {cause.replace('_', ' ')}: resume from the rollback checkpoint and watch it with `ckptforensics recovery`"
        )
    out.append(
        "resume with the optimizer state (Adam's moments and step counter): a fresh optimizer restarts bias correction and moves every weight by ~lr at once"
    )
    return out


def _is_jump_scale(value: Any, scale: float) -> bool:
    """Whether an `lr_scale` is the LR jump's own undoing (the what-if's try is printed to 4
    significant digits)."""
    try:
        return abs(float(value) / float(scale) - 1.0) < 1e-3
    except (TypeError, ValueError, ZeroDivisionError):
        return False
