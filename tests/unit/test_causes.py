"""One `Cause` record per cause (detectors/causes.py): the registry refuses what would make two
homes for one cause, every place that lists causes is tested against it, and the verdict and
the plan read it (issue #43)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ckptforensics.detectors import Finding
from ckptforensics.detectors.causes import CAUSES, RESUME_CAUSES, Cause, lookup, registry
from ckptforensics.planner import mitigations
from ckptforensics.verdict import decide

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckptforensics"


def test_the_registry_refuses_a_cause_twice() -> None:
    c = Cause(name="gradient_explosion", meaning="twice")
    with pytest.raises(ValueError, match="'gradient_explosion' registered twice"):
        registry(c, c)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "Gradient explosion"}, "one lower-case identifier"),
        ({"meaning": "two\nlines"}, "one line"),
        ({"actions": ("Resume from {checkpoint}.",)}, r"action .* names \['checkpoint'\]"),
        ({"tries": ("clip={clip}",)}, r"try .* names \['clip'\]"),
        ({"changes": (("clip", "{clip}"),)}, "known figures"),
        ({"plan_note": "redo {cause}"}, r"plan note .* names \['cause'\]"),
    ],
)
def test_a_cause_names_only_figures_its_readers_fill_in(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Cause(**{"name": "new_cause", "meaning": "a new cause", **fields})  # type: ignore[arg-type]


def test_the_schema_enumerates_exactly_the_registry() -> None:
    """report/schema.json's cause enum is read, never written, here: a cause added to the
    registry and not to the schema (or the reverse) fails with the difference."""
    schema = json.loads((PACKAGE / "report" / "schema.json").read_text())
    enum = schema["properties"]["verdict"]["properties"]["causes"]["items"]["properties"]["cause"][
        "enum"
    ]
    assert len(enum) == len(set(enum)), "the schema lists a cause twice"
    assert set(enum) == set(CAUSES), (
        f"schema.json only: {sorted(set(enum) - set(CAUSES))}; "
        f"registry only: {sorted(set(CAUSES) - set(enum))}"
    )


def _readme_causes() -> set[str] | None:
    """The causes README.md's cause table names (its first column's `names`; "the other
    resume causes" stands for the registry's resume causes), or None without such a table."""
    lines = (ROOT / "README.md").read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if re.match(r"^\|\s*cause\s*\|", line)), None)
    if header is None:
        return None
    out: set[str] = set()
    for line in lines[header + 2 :]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        out |= set(re.findall(r"`([a-z0-9_]+)`", cell))
        if "resume causes" in cell:
            out |= set(RESUME_CAUSES)
    return out


def test_the_readme_cause_table_lists_exactly_the_registry() -> None:
    names = _readme_causes()
    if names is None:
        pytest.skip("README.md has no cause table (a '| cause |' header): nothing to check")
    assert names == set(CAUSES), (
        f"README only: {sorted(names - set(CAUSES))}; registry only: {sorted(set(CAUSES) - names)}"
    )


def _supported() -> set[str]:
    """Every cause name the package's code puts in a finding's `supports`: the `supports=`
    keyword and `Finding`'s ninth positional argument, with the string tuples of a helper of
    the same module that computes them (`_overflow_cause(dtype)`)."""
    out: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        helpers = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            values = [k.value for k in node.keywords if k.arg == "supports"]
            if isinstance(node.func, ast.Name) and node.func.id == "Finding" and len(node.args) > 8:
                values.append(node.args[8])
            for value in values:
                for n in ast.walk(value):
                    if isinstance(n, ast.Constant) and isinstance(n.value, str):
                        out.add(n.value)
                    if isinstance(n, ast.Call) and getattr(n.func, "id", None) in helpers:
                        for t in ast.walk(helpers[n.func.id]):  # type: ignore[union-attr]
                            if isinstance(t, ast.Tuple):
                                out |= {
                                    e.value
                                    for e in t.elts
                                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                                }
    return out


def test_every_cause_a_finding_supports_is_registered() -> None:
    supported = _supported()
    assert len(supported) >= 12, f"the scan found too few causes: {sorted(supported)}"
    assert supported <= set(CAUSES), f"not in the registry: {sorted(supported - set(CAUSES))}"


def test_resume_causes_and_layer_causes_come_from_their_records() -> None:
    assert RESUME_CAUSES == (
        "optimizer_state_lost",
        "lr_scheduler_restarted",
        "loss_scaler_reset",
        "data_loader_restarted",
    )
    assert {n: c.layer_finding for n, c in CAUSES.items() if c.layer_finding} == {
        "adam_instability": "adam_step_growth",
        "attention_logit_growth": "attention_logit_growth",
        "output_logit_divergence": "output_logit_drift",
        "expert_collapse": "expert_collapse",
    }
    assert lookup("a_cause_from_another_version").actions == ()


def _doc(cause: str, onset: int | None = 17, jump: bool = False) -> dict[str, object]:
    lr_jump = {
        "kind": "lr_step_jump",
        "metrics": {"step": 12, "lr": 3e-3, "lr_before": 1e-3, "groups": [0]},
    }
    return {
        "verdict": {"causes": [{"cause": cause}], "first_bad_step": onset},
        "findings": [lr_jump] if jump else [],
    }


@pytest.mark.parametrize(
    ("cause", "onset", "jump", "clip", "tries"),
    [
        ("poison_batch", 17, False, None, ["skip_samples=auto", "skip_step=17"]),
        ("poison_batch", None, False, None, ["skip_samples=auto"]),
        ("lr_too_high", 17, True, 1.0, ["lr_scale=0.3333", "lr_scale=0.5", "clip=0.5"]),
        ("gradient_explosion", 17, True, None, ["lr_scale=0.3333", "lr_scale=0.5", "clip=1"]),
        ("lr_too_high", 17, False, None, ["lr_scale=0.5", "lr_scale=0.1"]),
        ("gradient_explosion", 17, False, 0.3333333, ["clip=0.166667", "lr_scale=0.5"]),
        ("fp16_overflow", 17, False, None, ["precision=bf16", "precision=fp32"]),
        ("loss_scale_collapse", 17, False, None, ["precision=bf16", "precision=fp32"]),
        ("bf16_overflow", 17, False, 2.0, ["precision=fp32", "clip=1"]),
        ("adam_instability", 17, False, None, ["eps=1e-6", "clip=1"]),
        ("output_logit_divergence", 17, True, None, ["lr_scale=0.5", "clip=1"]),
        ("attention_logit_growth", 17, False, None, ["lr_scale=0.5", "clip=1"]),
        ("silent_corruption", 17, False, None, []),
        ("optimizer_state_lost", 17, False, None, []),
        ("none", None, False, None, []),
        ("a_cause_from_another_version", 17, True, None, []),
    ],
)
def test_the_plan_tries_what_the_record_says(
    cause: str, onset: int | None, jump: bool, clip: float | None, tries: list[str]
) -> None:
    """The what-ifs of each cause, as the planner's own table had them before the registry."""
    assert mitigations(_doc(cause, onset, jump), clip) == tries


def _finding(fid: str, kind: str, subject: str, supports: tuple[str, ...], **metrics: object):
    return Finding(fid, kind, subject, 5.0, "critical", dict(metrics), f"{kind} on {subject}", "s", supports, True)  # fmt: skip


@pytest.mark.parametrize("cause", [c for c in CAUSES if c not in ("none", "undiagnosed")])
def test_the_verdict_recommends_the_records_actions(cause: str) -> None:
    v = decide([_finding("F1", "k", "model.h.0", (cause,))], before="ckpt-100", after="ckpt-200")
    assert v.causes[0]["cause"] == cause
    expected = [
        a.format(rollback="ckpt-100", after="ckpt-200", layer="the affected layers")
        for a in CAUSES[cause].actions
    ]
    assert v.recommended_actions[-len(expected) :] == expected


def test_a_layer_cause_under_a_withheld_replay_still_gets_its_actions() -> None:
    """A replay that misses the log is withheld; the actions of a cause that names a layer
    say "the affected layers" (before the registry, their `{layer}` raised KeyError)."""
    findings = [
        _finding("F1", "attention_logit_growth", "model.h.2.attn", ("attention_logit_growth",)),
        Finding(
            "F2",
            "replay_log_agreement",
            "run",
            1.0,
            "info",
            {"status": "missed_first"},
            "missed",
            "s",
            (),
        ),  # fmt: skip
    ]
    v = decide(findings, before="ckpt-100", after="ckpt-200", replayed=True)
    assert v.replay_check is not None and v.replay_check["status"] == "missed_first"
    assert len(v.recommended_actions) == 1
    assert "in the affected layers" in v.recommended_actions[0]
