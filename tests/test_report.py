"""Reports: JSON Schema, self-contained HTML with plots, evidence.h5 that re-renders identically."""

from __future__ import annotations

import json
from pathlib import Path

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
def test_html_renders_in_headless_chromium(reports: dict[str, Path], tmp_path: Path) -> None:
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
    img = imread(shot)[..., :3]
    ink = (img.mean(axis=2) < 0.9).mean()  # share of pixels that are not near-white
    assert ink > 0.02, f"screenshot looks blank ({ink:.1%} ink)"
    # The plots are coloured (matplotlib's blue/orange): the page is more than text.
    colour = (np.abs(img[..., 0] - img[..., 2]) > 0.2).mean()
    assert colour > 0.001, f"no plot colours in the screenshot ({colour:.2%})"
