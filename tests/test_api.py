"""The notebook session of docs/api.md, run as written (the run directory is the test's
zoo incident); then what it found against the incident's truth."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_documented_notebook_session_runs_and_finds_the_poisoned_rows(
    zoo: dict[str, Path], tmp_path: Path, capsys: object
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) == 4
    code = "\n".join(blocks).replace(
        'run = "build/demo/poison_batch"', f"run = {str(zoo['poison_batch'])!r}"
    )
    truth = json.loads((zoo["poison_batch"] / "truth.json").read_text())
    ns: dict[str, object] = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)  # `b.save("incident/")` writes under the working directory
    try:
        exec(compile(code.replace('"fixtures/', f'"{ROOT}/fixtures/'), "docs/api.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    assert ns["t"].first_bad_step == truth["first_bad_step"]  # type: ignore[attr-defined]
    r, b = ns["r"], ns["b"]
    assert r.cause == "poison_batch" and r.verdict["first_bad_step"] == truth["first_bad_step"]  # type: ignore[attr-defined]
    assert sorted(s["index"] for s in r.verdict["anomalous_samples"]) == truth["samples"]  # type: ignore[attr-defined]
    assert b.doc["bisect"]["rows"] == truth["samples"]  # type: ignore[attr-defined]
    assert {p.name for p in ns["written"]} == {
        "report.json",
        "report.md",
        "report.html",
        "evidence.h5",
        "skip.json",
    }  # type: ignore[attr-defined]
    assert (tmp_path / "incident" / "skip.json").is_file()
    assert ns["again"].doc == b.doc and ns["again"].extra == b.extra  # type: ignore[attr-defined]
    assert "poison_batch" in r.to_markdown()  # type: ignore[attr-defined]
    arch = ns["a"].doc["architecture"]  # type: ignore[attr-defined]
    assert arch["norm_placement"] == "pre" and arch["qk_norm"] is False  # the project's GPT


def test_the_readme_python_section_runs_as_written(zoo: dict[str, Path], tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### From Python") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    assert 'run = "build/demo/poison_batch"' in code
    code = code.replace(
        'run = "build/demo/poison_batch"', f"run = {str(zoo['poison_batch'])!r}"
    ).replace('"fixtures/', f'"{ROOT}/fixtures/')
    truth = json.loads((zoo["poison_batch"] / "truth.json").read_text())
    ns: dict[str, object] = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(code, "README.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    r = ns["r"]
    assert r.cause == truth["cause"] and r.verdict["first_bad_step"] == truth["first_bad_step"]  # type: ignore[attr-defined]
    assert sorted(s["index"] for s in r.verdict["anomalous_samples"]) == truth["samples"]  # type: ignore[attr-defined]
    assert (tmp_path / "incident" / "report.md").is_file()
