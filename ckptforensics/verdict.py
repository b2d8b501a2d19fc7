"""Findings -> ranked causes, culprits and recommended actions (the report's `verdict`).

What each cause means and what to do about it is its record in `detectors.causes`; the
evidence weighed together before ranking (`reattribute`) and the fields a replay settles
(`replay_fields`) are in `verdict_evidence`. Here: the ranking, and `decide`, the verdict's
one author, with the verdicts of the commands that diagnose no incident (whatif, audit).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptforensics.detectors import Finding, module_of
from ckptforensics.detectors.causes import CAUSES, RESUME_CAUSES, lookup
from ckptforensics.verdict_evidence import quiet_replay, reattribute, related, replay_fields

__all__ = [
    "replay_fields",
    "Verdict",
    "decide",
    "decide_audit",
    "reattribute",
    "quiet_replay",
    "CAUSES",
    "RESUME_CAUSES",
]

_SEVERITY_WEIGHT = {"info": 0.0, "warning": 1.0, "critical": 3.0}


@dataclass(slots=True)
class Verdict:
    """The report's `verdict` block (report/schema.json)."""

    summary: str
    causes: list[dict[str, Any]]
    reproducible: bool | None = None
    first_bad_step: int | None = None
    first_anomalous_module: str | None = None
    exploding_layers: list[str] = field(default_factory=list)
    overflowing_tensors: list[dict[str, Any]] = field(default_factory=list)
    anomalous_samples: list[dict[str, Any]] = field(default_factory=list)
    # Rows flagged in the spiking batch that the spike does not need (removing them one at a
    # time changes nothing): unusual, named apart from the culprits (issue #42's minimal set).
    unusual_samples: list[dict[str, Any]] = field(default_factory=list)
    corrupted_elements: list[dict[str, Any]] = field(default_factory=list)
    recommended_actions: list[str] = field(default_factory=list)
    rollback_checkpoint: str | None = None
    # How the replay compares with the run's own log (status, reason); None: nothing replayed.
    replay_check: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]


def _weight(f: Finding) -> float:
    return _SEVERITY_WEIGHT[f.severity] * min(1.0 + math.log2(max(f.score, 1.0)), 10.0)


def rank_causes(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    """Causes ranked by evidence, ordered by confidence.

    A finding supporting several causes gives its full weight to the first and half to
    the rest; direct (primary) evidence counts twice, so a cause it supports outranks
    causes that only have effects shared with others (a gradient burst follows an LR
    jump, not the reverse) unless their evidence is much heavier.
    """
    primary: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    evidence: dict[str, list[str]] = defaultdict(list)
    for f in findings:
        w = _weight(f)
        if w <= 0:
            continue
        for i, cause in enumerate(f.supports):
            share = w if i == 0 else w / 2
            total[cause] += share
            if f.primary:
                primary[cause] += share
            evidence[cause].append(f.id)
    if not total:
        return [{"cause": "none", "confidence": 1.0, "evidence": []}]
    # Direct evidence counts twice: it outweighs shared effects, yet a cause's confidence
    # is its share of the one score it is ranked by, so the first listed is the most confident.
    score = {c: total[c] + primary[c] for c in total}
    order = sorted(score, key=lambda c: (score[c], primary[c]), reverse=True)
    norm = sum(score.values())
    return [
        {"cause": c, "confidence": round(score[c] / norm, 3), "evidence": evidence[c]}
        for c in order
    ]


def decide(
    findings: Sequence[Finding],
    *,
    before: str,
    after: str,
    before_healthy: bool = True,
    extra: dict[str, Any] | None = None,
    weights_only: bool = False,
    replayed: bool = False,
    state_steps: Sequence[int] = (),
) -> Verdict:
    """Turn findings into the verdict.

    Args:
        findings: from the detectors (diff, and replay when it ran).
        before, after: checkpoint labels for the actions and the rollback.
        before_healthy: False when *before* itself holds non-finite state.
        extra: verdict fields another engine settled (a bisection's first bad step and
            rows); they override what the findings say.
        weights_only: the pair has no optimizer state, so no update was checked against
            Adam's bounds (the summary must not claim it was).
        replayed: the window's batches were replayed: the replay's findings settle their
            fields (`replay_fields`), and a healthy verdict says so instead of asking for a
            replay. A replay's overflowing tensors come before the diff's, its layers after
            the diff's exploding layers.
        state_steps: first bad steps the *before* state pins (with `replayed`).
    """
    causes = rank_causes(findings)
    top = causes[0]["cause"]
    weights_only = weights_only or any(f.kind == "weights_only" for f in findings)
    rollback = before if before_healthy else None
    v = Verdict(summary="", causes=causes, rollback_checkpoint=rollback if top != "none" else None)
    layers: dict[str, float] = {}
    for f in findings:
        if f.kind in ("gradient_burst", "nonfinite", "sign_like_updates", "vanished_v_burst",
                      "expert_update_outlier", "expert_return_sign_like"):  # fmt: skip
            mod = module_of(f.subject)
            layers[mod] = max(layers.get(mod, 0.0), f.score)
        if f.kind in ("lr_above_schedule", "lr_jump") and "gradient_explosion" in f.supports:
            for mod in f.metrics.get("modules", []):
                layers[mod] = max(layers.get(mod, 0.0), f.score)
        if f.kind in ("dtype_overflow", "dtype_headroom"):
            m = f.metrics
            v.overflowing_tensors.append(
                {
                    "name": f.subject,
                    "dtype": m["dtype"],
                    "max_abs": m["max_abs"],
                    "limit": m["max_abs"] * m["headroom"],
                    "where": m["where"],
                }
            )
        if f.kind in ("adam_bound_violation", "isolated_change"):
            for e in f.metrics["elements"]:
                kind = (
                    f"bit_flip({e['bit_field']} bit {e['bit']})"
                    if e["kind"] == "bit_flip"
                    else e["kind"]
                )
                v.corrupted_elements.append(
                    {
                        "tensor": f.subject,
                        "where": e["where"],
                        "index": e["index"],
                        "before": e["before"],
                        "after": e["after"],
                        "kind": kind,
                        # the q/k/v, gate/up or norm part of a fused tensor it lies in
                        **({"part": e["part"]} if e.get("part") else {}),
                    }
                )
    v.exploding_layers = [m for m, _ in sorted(layers.items(), key=lambda kv: -kv[1])]
    extra = {**(replay_fields(findings, state_steps) if replayed else {}), **(extra or {})}
    resumed = [
        f.metrics["resume_step"]
        for f in findings
        # The findings of a resume that lost state (detectors.diff) are of the resume causes'
        # kinds, each carrying its `resume_step`.
        if top in RESUME_CAUSES
        and (f.kind in RESUME_CAUSES or f.kind == "replay_variant_lands")
        and f.metrics.get("resume_step") is not None
    ]
    if resumed:
        # The first update after a resume that lost state is the first bad one; the replay's
        # own onset (a spike it cannot reproduce from the healthy state) does not override it.
        extra["first_bad_step"] = min(resumed) + 1
    v.overflowing_tensors = list(extra.pop("overflowing_tensors", [])) + v.overflowing_tensors
    if replayed:  # the diff's layers, then the replay's; ten are enough to read
        v.exploding_layers = list(
            dict.fromkeys(v.exploding_layers + list(extra.pop("replay_layers", [])))
        )[:10]
    for k, val in extra.items():
        setattr(v, k, val)
    withheld = v.replay_check is not None and v.replay_check["status"] in (
        "missed_first",
        "missed_later",
        "unexplained",
    )
    if withheld:
        assert v.replay_check is not None
        # The replay is not the run: nothing it measured is evidence; the diff speaks alone.
        v.summary = _withheld(top, causes, findings, v, before, after, v.replay_check["reason"])
        if top != "none":
            v.recommended_actions = _actions(top, rollback, after, "the affected layers")
        return v
    if top == "none":
        v.summary = f"No anomaly between {before} and {after}: " + _healthy_body(
            findings, weights_only, replayed
        )
        return v
    layer_kind = lookup(top).layer_finding
    layer_finding = next(
        (f for f in findings if layer_kind and f.kind == layer_kind and top in f.supports), None
    )
    if layer_finding is not None:
        # The layer whose logits grew is the one to fix; modules the replay saw move after it are its effect.
        v.first_anomalous_module = layer_finding.subject
        v.exploding_layers = list(dict.fromkeys([layer_finding.subject, *v.exploding_layers]))[:10]
    layer = layer_finding.subject if layer_finding is not None else "the affected layers"
    v.recommended_actions = _actions(top, rollback, after, layer)
    lr_groups = [
        f for f in findings if f.kind in ("lr_above_schedule", "lr_jump") and top in f.supports
    ]
    if lr_groups and top != "lr_too_high":
        members = list(dict.fromkeys(m for f in lr_groups for m in f.metrics.get("modules", [])))
        mods = ", ".join(members)
        v.recommended_actions.insert(
            0,
            f"Fix the LR of {mods}: its param group runs far above the schedule (per-module LR multiplier?).",
        )
        # The modules whose own LR jumped are the ones that explode first (their update is
        # the fault); a neighbour the replay saw move first is its effect.
        if members and not any(related(v.first_anomalous_module or "", m) for m in members):
            v.first_anomalous_module = members[0]
    if v.anomalous_samples and top == "poison_batch":
        ids = ", ".join(
            str(x["sample_id"] if x["sample_id"] is not None else f"row {x['index']}")
            for x in v.anomalous_samples
        )
        at = f" of step {v.first_bad_step}" if v.first_bad_step is not None else ""
        # The rows are named: the cause's own action (find them) is done.
        found = _actions(top, rollback, after, layer)
        v.recommended_actions = [a for a in v.recommended_actions if a not in found]
        v.recommended_actions.insert(
            0,
            f"Drop samples {ids}{at} from the data and resume from {rollback or 'an earlier checkpoint'}.",
        )
    if not before_healthy:
        v.recommended_actions.insert(
            0, f"{before} already holds non-finite state: roll back further than it."
        )
    v.summary = _summary(top, causes, findings, v, before, after)
    return v


def _actions(cause: str, rollback: str | None, after: str, layer: str) -> list[str]:
    """The cause's recommended actions (detectors.causes), its figures filled in."""
    return [
        a.format(rollback=rollback or "an earlier checkpoint", after=after, layer=layer)
        for a in lookup(cause).actions
    ]


def _healthy_body(findings: Sequence[Finding], weights_only: bool, replayed: bool) -> str:
    """The healthy summary: what was checked, and what the replay refuted."""
    gone = [f for f in findings if f.metrics.get("refuted_by_replay")]
    if weights_only:
        head = "every tensor moved within its peers' range (weights only: no optimizer state, so the optimizer's update bounds were not checked). "
    elif gone:  # a tensor stood out among its peers; the replay says it was no incident
        head = "every tensor moved within its optimizer's update bound. "
    else:
        head = "every tensor moved within its optimizer's update bound and its peers' range. "
    if gone:
        what = ", ".join(
            dict.fromkeys(
                module_of(f.subject) if f.subject != "run" else "the median tensor" for f in gone
            )
        )
        return head + (
            f"The rise in gradient energy the moments show on {what} is no incident: the replay computed every step of the "
            "window, matched the run's log on each, and none spiked."
        )
    if replayed:
        return head + "The replay of the window's batches shows no spike either."
    return head + (
        "A spike that gradient clipping absorbed (one bad batch, say) leaves no trace in the weights: "
        "replay the window's batches to rule it out."
    )


def _summary(
    top: str,
    causes: list[dict[str, Any]],
    findings: Sequence[Finding],
    v: Verdict,
    before: str,
    after: str,
) -> str:
    by_id = {f.id: f for f in findings}
    lead = [by_id[i] for i in causes[0]["evidence"] if i in by_id]
    lead.sort(key=lambda f: (not f.primary, -_weight(f)))
    what = top.replace("_", " ")
    rollback = v.rollback_checkpoint
    before, after, rollback = _names(before, after, rollback or before)
    parts = [
        f"Most likely cause between {before} and {after}: {what} (confidence {causes[0]['confidence']:.0%})."
    ]
    if lead:
        parts.append(lead[0].message[0].upper() + lead[0].message[1:] + ".")
    if v.corrupted_elements:
        e = v.corrupted_elements[0]
        parts.append(
            f"Corrupted element: {e['tensor']}{e['index']} {e['before']:.6g} -> {e['after']:.6g} ({e['kind']})."
        )
    if len(causes) > 1:
        parts.append("Also consistent with: " + ", ".join(c["cause"] for c in causes[1:3]) + ".")
    if v.rollback_checkpoint:
        parts.append(f"Last safe checkpoint: {rollback}.")
    return " ".join(parts)


def _names(*paths: str) -> tuple[str, ...]:
    """Checkpoints in one directory (the run's) by their own names, once said where they are."""
    parents = {os.path.dirname(p.rstrip("/")) for p in paths}
    return tuple(os.path.basename(p.rstrip("/")) for p in paths) if len(parents) == 1 else paths


def _withheld(
    top: str,
    causes: list[dict[str, Any]],
    findings: Sequence[Finding],
    v: Verdict,
    before: str,
    after: str,
    reason: str,
) -> str:
    head = (
        _summary(top, causes, findings, v, before, after)
        if top != "none"
        else f"No anomaly in the checkpoint diff between {before} and {after}."
    )
    return f"{head} The replay is withheld and nothing in this report comes from it: {reason[0].lower()}{reason[1:]}."


def decide_whatif(
    *, before: str, n_steps: int, outcome: str, recommended: str | None, baseline_on_track: bool
) -> Verdict:
    """The verdict of a `whatif`: it compares mitigations and diagnoses nothing, so its cause
    is "none" only where its own baseline stays on track, else "undiagnosed" (replay or
    bisect name the cause); the action is the least invasive mitigation on track."""
    v = Verdict(
        summary=f"What-if from {_names(before)[0]} over {n_steps} steps: {outcome}.",
        causes=[],
        rollback_checkpoint=None,
    )
    if baseline_on_track:
        v.causes = [{"cause": "none", "confidence": 1.0, "evidence": []}]
    else:
        v.causes = [{"cause": "undiagnosed", "confidence": 0.0, "evidence": ["F1"]}]
        v.summary += (
            " The baseline replay leaves its track: `ckptforensics replay` names the cause."
        )
    v.recommended_actions = [f"Resume from {before} with {recommended}."] if recommended else []
    return v


def decide_audit(findings: Sequence[Finding], rows: Sequence[Any], *, checkpoint: str) -> Verdict:
    """The verdict of an `audit`: it diagnoses no incident; its causes are the failure modes
    the run is exposed to, ranked by its risks as a diagnosis ranks evidence (info-level
    risks weigh nothing: "none" when only they remain), and its actions are the risks'
    fixes, most severe first."""
    causes = rank_causes(findings)
    risks = [r for r in rows if r.status == "risk"]
    order = {"critical": 0, "warning": 1, "info": 2}
    risks.sort(key=lambda r: order[r.severity])
    counts = {s: sum(1 for r in risks if r.severity == s) for s in order}
    unknown = sum(1 for r in rows if r.status == "unknown")
    head = (
        f"Audit of {checkpoint}: "
        + (
            ", ".join(f"{n} {s}" for s, n in counts.items() if n)
            + f" risk{'s' if len(risks) != 1 else ''} in {len(rows)} checks"
            if risks
            else f"no risk in {len(rows)} checks"
        )
        + (f" ({unknown} not checkable from what the run recorded)." if unknown else ".")
    )
    parts = [head]
    if risks and risks[0].severity != "info":
        parts.append(risks[0].message[0].upper() + risks[0].message[1:] + ".")
    if causes[0]["cause"] != "none":
        parts.append("Exposed to: " + ", ".join(c["cause"] for c in causes[:3]) + ".")
    v = Verdict(summary=" ".join(parts), causes=causes, rollback_checkpoint=None)
    v.recommended_actions = list(
        dict.fromkeys(f"{r.id.replace('_', ' ')}: {r.fix}" for r in risks if r.fix)
    )
    subjects = [r.subject for r in risks if r.severity != "info" and r.subject != "run"]
    v.exploding_layers = list(dict.fromkeys(subjects))[:10]
    return v
