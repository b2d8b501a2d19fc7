"""The notebook session of docs/api.md and the README's Python example, run as written from a
checkout where `make demo` has run (the demo's incident is the test's zoo incident, which
`make demo` builds with the same code); then what they found against the incident's truth."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tests.conftest import tree_hash

ROOT = Path(__file__).resolve().parent.parent


def _after_make_demo(tmp_path: Path, run: Path) -> Path:
    """A working folder laid out as the repository after `make demo`: build/demo/poison_batch
    (the incident) and fixtures/; returns it."""
    (tmp_path / "build" / "demo").mkdir(parents=True)
    (tmp_path / "build" / "demo" / "poison_batch").symlink_to(run, target_is_directory=True)
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures", target_is_directory=True)
    return tmp_path


def _run_as_written(code: str, where: Path, name: str) -> dict[str, object]:
    ns: dict[str, object] = {}
    cwd = os.getcwd()
    os.chdir(where)
    try:
        exec(compile(code, name, "exec"), ns)
    finally:
        os.chdir(cwd)
    return ns


def test_the_documented_notebook_session_runs_and_finds_the_poisoned_rows(
    zoo: dict[str, Path], tmp_path: Path, capsys: object
) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)
    assert len(blocks) == 5
    truth = json.loads((zoo["poison_batch"] / "truth.json").read_text())
    ns = _run_as_written(
        "\n".join(blocks), _after_make_demo(tmp_path, zoo["poison_batch"]), "api.md"
    )
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
    assert (tmp_path / "build" / "demo" / "incident" / "skip.json").is_file()
    assert ns["again"].doc == b.doc and ns["again"].extra == b.extra  # type: ignore[attr-defined]
    assert "poison_batch" in r.to_markdown()  # type: ignore[attr-defined]
    g = ns["g"]  # the regress block: GELU exact vs tanh parts at the first MLP, forward
    assert g.doc["regress"]["status"] == "parted"  # type: ignore[attr-defined]
    assert g.verdict["first_anomalous_module"] == "transformer.h.0.mlp"  # type: ignore[attr-defined]
    arch = ns["a"].doc["architecture"]  # type: ignore[attr-defined]
    assert arch["norm_placement"] == "pre" and arch["qk_norm"] is False  # the project's GPT


def test_the_readme_python_example_runs_as_written_after_make_demo(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """README's Python block, unchanged, from the repository root after `make demo`: it finds
    the poisoned rows and writes under build/demo/ only (nothing into the checkout)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### From Python") :]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    run = zoo["poison_batch"]
    truth = json.loads((run / "truth.json").read_text())
    before = tree_hash(run)
    ns = _run_as_written(code, _after_make_demo(tmp_path, run), "README.md")
    r = ns["r"]
    assert r.cause == truth["cause"] and r.verdict["first_bad_step"] == truth["first_bad_step"]  # type: ignore[attr-defined]
    assert sorted(s["index"] for s in r.verdict["anomalous_samples"]) == truth["samples"]  # type: ignore[attr-defined]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "fixtures"]
    assert sorted(p.name for p in (tmp_path / "build" / "demo").iterdir()) == [
        "incident",
        "poison_batch",
    ]
    assert (tmp_path / "build" / "demo" / "incident" / "report.md").is_file()
    assert tree_hash(run) == before
