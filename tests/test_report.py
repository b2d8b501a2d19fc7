"""Reports: JSON Schema, self-contained HTML with plots, evidence.h5 that re-renders identically."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.report import schema
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"


@pytest.fixture(scope="module")
def reports(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One report directory per command, on zoo incidents."""
    root = tmp_path_factory.mktemp("reports")
    run = zoo["poison_batch"]
    common = ["--run-dir", str(run), "--model", MODEL, "--batch", str(run / "batches.h5")]
    cmds = {
        "diff": [
            "diff",
            "--run-dir",
            str(zoo["silent_corruption"]),
            "--before",
            "30",
            "--after",
            "40",
        ],
        "replay": ["replay", "--before", "30", "--after", "35", *common],
        "bisect": ["bisect", "--before", "30", "--after", "35", *common],
        "whatif": [
            "whatif",
            "--before",
            "30",
            "--steps",
            "6",
            "--try",
            "skip_samples=auto",
            *common,
        ],
    }
    out = {}
    for name, args in cmds.items():
        r = CliRunner().invoke(cli, [*args, "--out", str(root / name)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def triage_dir(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """triage's report of the poisoned batch's run."""
    out = tmp_path_factory.mktemp("triage") / "t"
    args = ["triage", "--run-dir", str(zoo["poison_batch"]), "--out", str(out)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return out


def test_every_report_validates_against_the_schema(reports: dict[str, Path]) -> None:
    for name, d in reports.items():
        jsonschema.validate(json.loads((d / "report.json").read_text()), schema()), name


def test_the_schema_names_exactly_the_causes_the_verdict_knows() -> None:
    from ckptforensics.verdict import CAUSES

    cause = schema()["properties"]["verdict"]["properties"]["causes"]["items"]["properties"][
        "cause"
    ]
    assert set(cause["enum"]) == set(CAUSES)


def test_html_is_self_contained_with_plots(reports: dict[str, Path]) -> None:
    page = (reports["replay"] / "report.html").read_text()
    assert "http://" not in page and "https://" not in page  # nothing fetched from a network
    assert page.count("data:image/png;base64,") >= 3
    assert "Anomalous samples" in page and "poison batch" in page


def test_html_plots_name_the_modules_and_map_modules_by_steps(reports: dict[str, Path]) -> None:
    """Module names on the axes (not indices), and the modules x steps heatmaps of gradient
    and activation norms against each module's own baseline."""
    import re

    from ckptforensics.report.html import _heatmap, _short

    doc = json.loads((reports["replay"] / "report.json").read_text())
    page = (reports["replay"] / "report.html").read_text()
    assert (
        "Modules x steps: output-gradient norm" in page
        and "Modules x steps: activation RMS" in page
    )
    rep = doc["replay"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = _heatmap(plt, rep["per_module_steps"], rep["modules"], doc["verdict"])
    assert [t for t, _ in shown] == [
        "Modules x steps: output-gradient norm",
        "Modules x steps: activation RMS",
    ]
    assert all(re.match(r'<img alt="plot" src="data:image/png;base64,', img) for _, img in shown)
    assert _short(["transformer.h.0.attn", "transformer.h.1.mlp"]) == ["h.0.attn", "h.1.mlp"]


@pytest.mark.parametrize(
    "fmt,name", [("md", "report.md"), ("html", "report.html"), ("json", "report.json")]
)
def test_report_rerenders_from_evidence_identically(
    reports: dict[str, Path], fmt: str, name: str, tmp_path: Path
) -> None:
    for d in reports.values():
        r = CliRunner().invoke(
            cli, ["report", str(d / "evidence.h5"), "--format", fmt, "--out", str(tmp_path / name)]
        )
        assert r.exit_code == 0, r.output
        assert (tmp_path / name).read_text() == (d / name).read_text()


def test_evidence_holds_per_module_per_step_statistics(reports: dict[str, Path]) -> None:
    import h5py

    with h5py.File(reports["replay"] / "evidence.h5") as h:
        steps = h["replay/step"][()]
        assert list(steps) == [31, 32, 33, 34, 35]
        assert h["replay/module_grad_norm"].shape == (5, len(h["replay/modules"]))
        assert h["replay/sample_grad_sq"].shape[0] == 5


def test_report_refuses_other_files(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("{}")
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "x.json")])
    assert_bad_input(r, "not a ckptforensics.report/1 document")


def _chromium() -> str | None:
    import shutil

    return (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )


@pytest.mark.skipif(
    _chromium() is None, reason="no Chromium on this machine (.ci/run installs Debian's)"
)
def test_html_renders_in_headless_chromium(
    reports: dict[str, Path], triage_dir: Path, tmp_path: Path
) -> None:
    import subprocess

    import numpy as np
    from matplotlib.image import imread

    shot = tmp_path / "shot.png"
    page = (reports["replay"] / "report.html").resolve()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--hide-scrollbars",
    ]
    subprocess.run(
        [_chromium(), *flags, f"--screenshot={shot}", "--window-size=1200,2400", page.as_uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # The page as Chromium built it (its DOM): no Markdown in what a reader sees.
    for name, d in {**reports, "triage": triage_dir}.items():
        dom = subprocess.run(
            [_chromium(), *flags, "--dump-dom", (d / "report.html").resolve().as_uri()],
            check=True,
            capture_output=True,
            timeout=120,
            text=True,
        ).stdout
        assert "</table>" in dom, (name, dom[:500])
        assert not _markdown_left(dom), (name, _markdown_left(dom)[:5])
    img = imread(shot)[..., :3]
    ink = (img.mean(axis=2) < 0.9).mean()  # share of pixels that are not near-white
    assert ink > 0.02, f"screenshot looks blank ({ink:.1%} ink)"
    # The plots are coloured (matplotlib's blue/orange): the page is more than text.
    colour = (np.abs(img[..., 0] - img[..., 2]) > 0.2).mean()
    assert colour > 0.001, f"no plot colours in the screenshot ({colour:.2%})"


# --- issue #46, items 10-15: the report as a reader meets it ---------------------------


class _Text(HTMLParser):
    """The text a reader sees, outside code (<pre>, <code>) and the stylesheet."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.texts: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        while self.stack and self.stack.pop() != tag:
            pass

    def handle_data(self, data: str) -> None:
        if not {"pre", "code", "style", "script"} & set(self.stack):
            self.texts.append(data)


def _markdown_left(page: str) -> list[str]:
    """What in a page's text is Markdown not rendered: backticks, bold marks, list dashes,
    fences; and a header row of empty cells."""
    p = _Text()
    p.feed(page)
    bad = [
        t
        for t in p.texts
        if "`" in t or "**" in t or t.lstrip().startswith(("- ", "```", "|")) or t.startswith("#")
    ]
    empty = re.findall(r"<tr>(?:<th>\s*</th>)+</tr>", page)  # a header row with nothing in it
    return bad + empty


def _page(d: Path) -> str:
    return (d / "report.html").read_text()


def test_html_has_no_markdown_in_its_text(reports: dict[str, Path], triage_dir: Path) -> None:
    """#46.10: report.html of every command, parsed: no literal backticks, bold marks or
    `- ` bullets in its text, no empty header row on the summary table."""
    for name, d in {**reports, "triage": triage_dir}.items():
        assert not _markdown_left(_page(d)), (name, _markdown_left(_page(d))[:5])


def test_html_has_every_section_report_md_has(reports: dict[str, Path]) -> None:
    """#46.10: one document rendered twice: every section of report.md (a bold title or a
    <details>) is in report.html, the replay and per-tensor tables included."""
    for name, d in reports.items():
        md, page = (d / "report.md").read_text(), _page(d)
        titles = re.findall(r"^\*\*([^*]+)\*\*$", md, re.M) + re.findall(
            r"<summary>([^<]+)</summary>", md
        )
        assert titles, name
        for t in titles[1:]:  # the first is the verdict box
            assert f">{html.escape(t, quote=False)}</" in page.replace("&#x27;", "'"), (name, t)
    page = _page(reports["replay"])
    assert "<summary>Replay (5 steps, fp32)</summary>" in page
    assert re.search(r"<summary>Per-tensor diff \(\d+ tensors\)</summary>", page)
    assert "<td><code>transformer.h.0.attn.c_attn.weight</code></td>" in page


def test_the_resume_code_is_a_code_block(reports: dict[str, Path]) -> None:
    """#46.10: a hand-written loop's resume is statements to run, one a line in a code block,
    not `load` = `ck = torch.load(...)` on one line."""
    page, md = _page(reports["replay"]), (reports["replay"] / "report.md").read_text()
    assert "<pre class='python'>ck = torch.load(" in page
    assert "<code>load</code> = " not in page and "`load` = `ck" not in md
    assert "\nmodel.load_state_dict(ck[&#x27;model&#x27;])\n" in page


def _box(page: str) -> str:
    return html.unescape(
        re.sub(r"<[^>]+>", "", page.split("<p class='summary'>")[1].split("</p>")[0])
    )


def test_the_verdict_box_is_one_sentence_and_the_rollback(
    reports: dict[str, Path], zoo: dict[str, Path]
) -> None:
    """#46.11: cause, step and rows, then the rollback, named in the run; the run directory
    is written once at the top of the page."""
    run = str(zoo["poison_batch"])
    page = _page(reports["replay"])
    assert _box(page) == (
        "Poison batch at step 35: rows 1, 4, 6 (sample ids 273, 276, 278) carry the spike. "
        "Roll back to step_30.pt."
    )
    head = page.split("<h2>")[0]
    assert head.count(run) == 1 and f"<th>Run directory</th><td><code>{run}</code>" in head
    doc = json.loads((reports["replay"] / "report.json").read_text())
    assert run not in doc["verdict"]["summary"]
    assert doc["verdict"]["summary"].startswith(
        "Most likely cause between step_30.pt and step_35.pt: poison batch"
    )
    md = (reports["replay"] / "report.md").read_text()
    assert md.splitlines()[2] == (
        "**Poison batch at step 35: rows 1, 4, 6 (sample ids 273, 276, 278) carry the spike. "
        "Roll back to `step_30.pt`.**"
    )
    assert _box(_page(reports["diff"])).startswith("Silent corruption")


def test_the_layers_are_ranked_once(reports: dict[str, Path]) -> None:
    """#46.12: one line of layers (the first to leave its range leading where the replay saw
    one); no second ranking in the summary, no empty "first anomalous module"."""
    doc = json.loads((reports["replay"] / "report.json").read_text())
    v = doc["verdict"]
    md = (reports["replay"] / "report.md").read_text()
    page = _page(reports["replay"])
    for text in (md, page):
        assert "standing out" not in text and "irst anomalous module" not in text
    [line] = [x for x in md.splitlines() if x.startswith("- **Layers**")]
    named = re.findall(r"`([^`]+)`", line)
    lead = [v["first_anomalous_module"]] if v["first_anomalous_module"] else []
    assert named == list(dict.fromkeys(lead + v["exploding_layers"]))[: len(named)]
    assert not any(m in v["summary"] for m in v["exploding_layers"])


def test_actions_name_what_to_do_once(reports: dict[str, Path]) -> None:
    """#46.13: bisect's own report does not send the reader to bisect; the recovery command
    names this report's directory; a bisection's rows carry no score that all read 1; a
    what-if of skip_samples=auto names the samples."""
    for name in ("replay", "bisect"):
        acts = json.loads((reports[name] / "report.json").read_text())["verdict"][
            "recommended_actions"
        ]
        assert acts and not any("ckptforensics bisect" in a for a in acts), (name, acts)
        assert acts[0].startswith("Drop samples 273, 276, 278 of step 35"), acts
    md = (reports["replay"] / "report.md").read_text()
    assert f"--plan {reports['replay']}`." in md and "PLAN_DIR" not in md
    bis = (reports["bisect"] / "report.md").read_text()
    assert "| row | sample id | why |" in bis and "| 1 | 273 | 1 |" not in bis
    assert "| row | sample id | score | why |" in md  # the replay's scores rank the rows
    wi = _page(reports["whatif"])
    assert "<td>skip_samples=auto (samples 273, 276, 278 of step 35)</td>" in wi
    assert _box(wi) == (
        "What-if from step_30.pt: skipping samples 273, 276, 278 of step 35 "
        "(skip_samples=auto) keeps the run on track."
    )


def test_headroom_is_plotted_only_near_the_limit(reports: dict[str, Path]) -> None:
    """#46.14: an fp32 pair's headroom (every tensor 10^37 below the limit) is one line, not a
    plot; the per-tensor plot labels the tensors with the largest ratio alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ckptforensics.report.html import TOP_LABELS, _name_ticks, _short

    page = _page(reports["diff"])
    assert "headroom" not in page.split("<h2>Plots</h2>")[1].split("</div>")[0]
    assert re.search(
        r"No tensor comes within 100× of its dtype&#x27;s largest value: the closest, \S+ \(fp32\), stays [0-9.e+]+× below it",
        page,
    )
    assert "Update/weight ratio per tensor" in page
    ts = json.loads((reports["diff"] / "report.json").read_text())["diff"]["tensors"]
    assert len(ts) > TOP_LABELS
    names, ratio = [t["name"] for t in ts], [t["update_ratio"] or 0.0 for t in ts]
    fig, ax = plt.subplots()
    _name_ticks(ax, names, "x", ratio)
    shown = [t.get_text() for t in ax.get_xticklabels()]
    top = sorted(range(len(ts)), key=lambda i: -ratio[i])[:TOP_LABELS]
    assert shown == [_short(names)[i] for i in sorted(top)]
    plt.close(fig)


def test_without_matplotlib_the_page_says_how_to_get_the_plots(
    reports: dict[str, Path], triage_dir: Path
) -> None:
    """#46.14: rendered where matplotlib cannot be imported, the page has no plot and says
    how to get them (the plots extra, then render again from evidence.h5)."""
    code = (
        "import sys, json; sys.modules['matplotlib'] = None\n"
        "from ckptforensics.report import render_html\n"
        "from ckptforensics.report.timeline import render_triage_html\n"
        "doc = json.load(open(sys.argv[1])); t = json.load(open(sys.argv[2]))\n"
        "print(render_html(doc)); print('=====') ; print(render_triage_html(t))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(reports["replay"] / "report.json"), str(triage_dir / "report.json")],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    for page in r.stdout.split("====="):
        assert "<img" not in page
        assert "pip install 'ckptforensics[plots]'" in page
        assert "ckptforensics report evidence.h5 --to html" in page


def test_triage_marks_the_candidates_it_set_aside(tmp_path: Path) -> None:
    """#46.14: triage's timeline marks the candidates it set aside (a poisoned batch's blip
    on a quiet log, met again as hard: the log's routine), and says so in its description."""
    from tests.unit.test_triage_rules import _quiet_poisoned

    rows = _quiet_poisoned(1, (1.10, 1.10))
    csv = tmp_path / "metrics.csv"
    csv.write_text(
        "step,loss,grad_norm\n" + "".join(f"{k},{r['loss']!r},{r['grad_norm']!r}\n" for k, r in rows.items())
    )  # fmt: skip
    r = CliRunner().invoke(cli, ["triage", "--metrics", str(csv), "--out", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    t = json.loads((tmp_path / "t" / "report.json").read_text())
    page = (tmp_path / "t" / "report.html").read_text()
    n = sum(1 for o in t["ignored"] if o["signal"] in ("loss", "grad_norm"))
    assert n >= 1
    assert f'alt="timeline of loss and grad norm, {n} candidates set aside marked"' in page


def test_statistics_follow_plain_words_and_are_explained(
    reports: dict[str, Path], triage_dir: Path
) -> None:
    """#46.15: triage's verdict says how far in words first, then the statistic; r_v, log Z
    and robust z are explained under the tables that show them."""
    tri = (triage_dir / "report.md").read_text()
    assert (
        tri.splitlines()[2]
        == "**First bad step: 35, the grad norm at 3.4× its trend (robust z 7.6)**"
    )
    page = _page(reports["replay"])
    assert "r_v: the gradient energy a tensor saw over the window against what Adam" in page
    assert "log Z: the log of the softmax" in page
    assert "robust z: how many robust spreads" in page
    assert "sign-like share: the share of a tensor" in page
    md = (reports["replay"] / "report.md").read_text()
    diff = md.split("Per-tensor diff")[1].split("</details>")[0]
    assert "\nr_v: the gradient energy" in diff
