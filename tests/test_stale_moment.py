"""A tensor whose second moment went stale (held near-frozen, then released) spikes through
Adam, not through its gradient: the verdict says adam_instability, though the checkpoint diff
alone reads a gradient burst there (fixtures/hf_frozen_head.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptforensics.cli import cli
from fixtures.hf_frozen_head import RELEASE, build


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("frozen"))


def _report(*args: str) -> dict:
    r = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_released_head_is_adam_instability(run: Path) -> None:
    doc = _report(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "32",
        "--after",
        "40",
        "--batch",
        str(run / "flight"),
    )
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "adam_instability", v["causes"]
    assert v["reproducible"] is True and v["first_bad_step"] == RELEASE
    assert v["replay_check"]["status"] == "matched"
    rms = next(f for f in doc["findings"] if f["kind"] == "rms_t")
    assert rms["subject"] == "lm_head.weight" and rms["metrics"]["rms_t"] > 100
    burst = next(
        f
        for f in doc["findings"]
        if f["kind"] == "gradient_burst" and f["subject"] == "lm_head.weight"
    )
    assert burst["supports"][0] == "adam_instability"
    # The diff alone cannot tell the stale moment from a gradient burst: it says so no better.
    diff = _report("diff", "--run-dir", str(run), "--before", "32", "--after", "40")
    assert any(
        f["kind"] == "gradient_burst" and f["subject"] == "lm_head.weight" for f in diff["findings"]
    )
