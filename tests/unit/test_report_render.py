"""The report's renderings: one page shell for every HTML page, the plan and recovery sections
rendered to Markdown and HTML from the same blocks (no Markdown re-parsed into HTML), and a
report package whose modules import one way (issue #43). On hand-made documents; no runs."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from ckptforensics.report.blocks import Bold, Code, Item, Para, Pre, Steps, html_blocks
from ckptforensics.report.html import render_html
from ckptforensics.report.inspect import render_inspect_html
from ckptforensics.report.markdown import plan_lines, recovery_lines, render_markdown
from ckptforensics.report.page import page
from ckptforensics.report.plan import plan_blocks
from ckptforensics.report.recovery import recovery_blocks
from ckptforensics.report.timeline import render_triage_html

REPORT = Path(__file__).resolve().parents[2] / "ckptforensics" / "report"

PLAN: dict[str, Any] = {
    "status": "ready",
    "trainer_title": "Hugging Face Trainer",
    "settings": "run/trainer_state.json",
    "rollback": {
        "path": "run/checkpoint-30",
        "step": 30,
        "why": "the last complete checkpoint before the onset (step 35)",
        "skipped": ["checkpoint-35: after the onset"],
    },
    "skip": {
        "sample_ids": [276, 273],
        "steps": [35],
        "format": "skip.json",
        "text": '{"sample_ids": [273, 276]}',
    },
    "changes": [
        {
            "knob": "skip_samples",
            "value": "auto",
            "why": "the spike goes with these rows",
            "status": "verified",
            "evidence": {"source": "bisect", "step": 35, "rows": [3, 7]},
            "edits": [],
        },
        {
            "knob": "lr",
            "value": 0.5,
            "why": "the LR ran above its schedule",
            "status": "not_replayed",
            "evidence": None,
            "edits": [{"key": "learning_rate", "before": 0.003, "after": 0.0015, "note": "halved"}],
        },
    ],
    "config_diff": "-learning_rate: 0.003\n+learning_rate: 0.0015",
    "resume": [{"key": "resume_from_checkpoint", "after": "run/checkpoint-30", "note": ""}],
    "alternatives": [{"mitigation": "skip_step=35", "on_track": False, "max_loss": None}],
    "notes": ["resume with the optimizer state"],
}

PLAN_MD = """\
Trainer: Hugging Face Trainer (settings read from `run/trainer_state.json`)

1. **Roll back to** `run/checkpoint-30` (step 30): the last complete checkpoint before the onset (step 35).
   - passed over: checkpoint-35: after the onset
2. **Skip** samples [273, 276] (skip.json):

```
{"sample_ids": [273, 276]}
```
   - skip_samples: verified by bisect (step 35: the spike goes with rows [3, 7])
3. **Change** `learning_rate` 3.00e-03 → 1.50e-03: the LR ran above its schedule; not replayed.
   - halved

```diff
-learning_rate: 0.003
+learning_rate: 0.0015
```

4. **Resume**: `resume_from_checkpoint` = `run/checkpoint-30`.

Then, once the resumed run has trained a while: `ckptforensics recovery --run-dir runs/x --resumed-from 30 --plan PLAN_DIR` (PLAN_DIR: the directory this plan is written to with --out).
- also replayed: skip_step=35 (leaves the track, max loss not finite)
- resume with the optimizer state"""

RECOVERY: dict[str, Any] = {
    "status": "recovered",
    "step": 45,
    "resumed_from": 30,
    "checkpoint_after": None,
    "onset": 35,
    "checks": [
        {
            "name": "skipped_samples",
            "status": "ok",
            "expected": [273, 276],
            "observed": [],
            "message": "the culprits are gone",
        }
    ],
    "trajectory": {
        "loss": {"fitted_on": [5, 30], "slope": -0.21, "sigma": 0.004},
        "band_z": 3.0,
    },
    "windows": [
        {
            "first": 31,
            "last": 40,
            "loss": 2.5,
            "expected_loss": 2.45,
            "ratio": 1.02,
            "z": 0.8,
            "grad_norm": None,
            "grad_level": 0.9,
            "grad_ratio": None,
            "grad_z": None,
            "onsets": [],
            "in_band": True,
        }
    ],
    "gap_trend": {},
    "legs": [{"source": "metrics.jsonl", "first": 1, "last": 60}],
    "log": "metrics.jsonl",
    "plan": "plan/report.json",
    "series": {},
}


def _doc(**sections: Any) -> dict[str, Any]:
    """A diff report with no findings: the least a renderer reads."""
    ckpt = {"path": "run/step_30.pt", "step": 30, "format": "torch"}
    verdict = {
        "summary": "No anomaly <here> & there.",
        "causes": [{"cause": "none", "confidence": 1.0}],
        "reproducible": None,
        "rollback_checkpoint": None,
        "exploding_layers": [],
        "first_bad_step": None,
        "first_anomalous_module": None,
        "corrupted_elements": [],
        "anomalous_samples": [],
        "overflowing_tensors": [],
        "recommended_actions": ["Roll back to `step_30`."],
    }
    return {
        "schema": "ckptforensics.report/1",
        "incident": {
            "before": ckpt,
            "after": {**ckpt, "path": "run/step_40.pt", "step": 40},
            "command": "ckptforensics diff --before 30 --after 40",
            "tool_version": "0.1.0",
        },
        "verdict": verdict,
        "findings": [],
        "diff": {},
        "replay": {},
        "bisect": {},
        "whatif": {},
        **sections,
    }


def test_rows_the_spike_does_not_need_are_listed_apart() -> None:
    """The culprits under "Anomalous samples"; flagged rows the spike does not need under a
    table of their own, in Markdown and in HTML."""
    row = {
        "index": 3,
        "sample_id": 17,
        "score": 9.0,
        "why": "its loss stands out; removing it removes the spike",
    }
    odd = {"index": 5, "sample_id": 19, "score": 7.0, "why": "its loss stands out"}
    doc = _doc()
    doc["verdict"] = {**doc["verdict"], "anomalous_samples": [row], "unusual_samples": [odd]}
    md = render_markdown(doc)
    culprits, apart = md.split("**Anomalous samples**")[1].split(
        "**Also unusual (the spike does not need them)**"
    )
    assert "| 3 | 17 |" in culprits and "| 5 |" not in culprits
    assert "| 5 | 19 |" in apart.split("**Recommended actions**")[0]
    assert "<h2>Also unusual (the spike does not need them)</h2>" in render_html(doc)
    doc["verdict"] = {**doc["verdict"], "unusual_samples": []}
    assert "Also unusual" not in render_markdown(doc)


def test_the_plan_reads_in_markdown_as_a_ticket_does() -> None:
    assert "\n".join(plan_lines(PLAN, "runs/x")) == PLAN_MD
    assert plan_lines({}) == []
    assert plan_lines({"status": "no_rollback", "notes": ["no checkpoint before 35"]}) == [
        "No resume plan (no rollback): no checkpoint before 35."
    ]


def test_the_plan_in_html_is_lists_and_code_not_markdown() -> None:
    page_ = render_html(_doc(plan=PLAN))
    section = page_.split("<h2>Resume plan</h2>")[1].split("<h2>")[0]
    assert "`" not in section and "**" not in section and "<p>- " not in section
    assert "<ol><li><strong>Roll back to</strong> <code>run/checkpoint-30</code>" in section
    assert "<ul><li>passed over: checkpoint-35: after the onset</li></ul>" in section
    assert "<pre>{&quot;sample_ids&quot;: [273, 276]}</pre>" in section
    assert "<pre class='diff'>-learning_rate: 0.003\n+learning_rate: 0.0015</pre>" in section
    assert (
        "<ol start='4'><li><strong>Resume</strong>: <code>resume_from_checkpoint</code>" in section
    )
    assert "<ul><li>also replayed: skip_step=35" in section
    # Markdown of the same document still carries the plan, in Markdown.
    assert "1. **Roll back to** `run/checkpoint-30`" in render_markdown(_doc(plan=PLAN))


def test_markdown_and_html_render_the_same_plan_blocks() -> None:
    """Every piece of inline code in the Markdown is a <code> in the HTML."""
    blocks = plan_blocks(PLAN)
    md = "\n".join(plan_lines(PLAN))
    html = html_blocks(blocks)
    codes = md.split("```")[0::2]  # outside the fenced blocks
    spans = [s for part in codes for s in part.split("`")[1::2]]
    assert spans and all(f"<code>{s}</code>" in html.replace("&#x27;", "'") for s in spans)


def test_recovery_section_in_markdown_and_html() -> None:
    md = recovery_lines(RECOVERY)
    assert md[:2] == ["**Checks that the resume was the plan**", ""]
    assert md[-2:] == [
        "Legs read: `metrics.jsonl` steps 1-60 (resumed leg: `metrics.jsonl`).",
        "Plan: `plan/report.json`.",
    ]
    html = html_blocks(recovery_blocks(RECOVERY))
    assert "`" not in html and "**" not in html
    assert "<p>Legs read: <code>metrics.jsonl</code> steps 1-60" in html
    assert "<td>[273, 276]</td>" in html and "<td>not finite</td>" in html


def test_blocks_escape_html_and_number_steps() -> None:
    html = html_blocks(
        [
            Para(["a <b> & ", Code("x<y"), " ", Bold("c")]),
            Steps([Item(2, ["two"], pre=Pre("<pre>"), notes=[["n"]])]),
        ]
    )
    assert html == (
        "<p>a &lt;b&gt; &amp; <code>x&lt;y</code> <strong>c</strong></p>"
        "<ol start='2'><li>two<pre>&lt;pre&gt;</pre><ul><li>n</li></ul></li></ol>"
    )


def _head(html: str) -> str:
    return html.split("<body>")[0].split("<title>")[0]


def test_every_html_page_shares_one_head() -> None:
    triage = {
        "first_bad_step": None,
        "metrics_file": "run/metrics.jsonl",
        "steps": 60,
        "rollback": None,
        "after": None,
        "drift": None,
        "commands": [],
        "onsets": [],
        "rollback_step": None,
    }
    inspect = {
        "path": "run/step_30.pt",
        "format": "torch",
        "step": 30,
        "files": "1 file",
        "dtypes": {},
        "parameters": 0,
        "tensors": 0,
        "optimizer": None,
        "scalars": {},
        "notes": [],
        "per_tensor": [],
    }
    recovery = _doc(recovery=RECOVERY)
    recovery["verdict"]["recommended_actions"] = []
    pages = {
        "report": render_html(_doc()),
        "recovery": render_html(recovery),
        "triage": render_triage_html(triage),
        "inspect": render_inspect_html(inspect),
    }
    heads = {_head(p) for p in pages.values()}
    assert heads == {_head(page("x", []))}, pages
    for name, p in pages.items():
        assert p.count("<!doctype html>") == 1 and "</body></html>" in p, name
        assert "http://" not in p and "https://" not in p, name
    assert "No anomaly &lt;here&gt; &amp; there." in pages["report"]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported from ckptforensics, at module top?) for each import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("ckptforensics"):
            out += [(n.module, id(n) in top)]
            out += [(f"{n.module}.{a.name}", id(n) in top) for a in n.names]
        elif isinstance(n, ast.Import):
            out += [(a.name, id(n) in top) for a in n.names if a.name.startswith("ckptforensics")]
    return out


def test_report_modules_import_one_way_at_module_top() -> None:
    mods = {
        "ckptforensics.report" + ("" if p.stem == "__init__" else f".{p.stem}"): p
        for p in REPORT.glob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        found = _imports(path)
        inner = [m for m, at_top in found if not at_top]
        assert not inner, f"{name} imports {inner} inside a function"
        graph[name] = {m for m, _ in found if m in mods and m != name}
    # The package's __init__ is its face: no module of it imports the package back.
    assert not [n for n, deps in graph.items() if "ckptforensics.report" in deps]

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(d == b or (d not in seen and reaches(d, b, seen | {d})) for d in graph[a])

    cycles = sorted(n for n in graph if reaches(n, n, set()))
    assert not cycles, f"import cycles among {cycles}"
