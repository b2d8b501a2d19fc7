"""A failure is one line: libraries' warnings (transformers' logging, Python's `warnings`) go
to the log, shown with -vv (as DEBUG records) or --debug, never before a refusal's line.

The case of issue #46: a tiny GPT-2 trained by transformers' Trainer, replayed with a model
of the run's shapes but another activation (its config.json with `relu`). transformers'
config checks warn twice while it builds the model (the fixture's GPT-2 keeps GPT-2's
special token ids, outside the tiny vocabulary); the replay then misses the run's log and is
refused (exit 2). Each CLI runs in its own process: transformers' handler binds the stderr of
the process that first imports it, and `warning_once` says a message once per process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ckptforensics.cli.quiet import libraries
from fixtures.formats import build_hf_gpt2

ROOT = Path(__file__).resolve().parent.parent
REFUSED = "error: the replay does not reproduce the run's own log on its first checked step (loss "
WARNED = "Model config: bos_token_id must be `None` or an integer within the vocabulary"


@pytest.fixture(scope="module")
def relu_replay(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The replay's arguments: the HF run, and a --model config of its shapes with ReLU."""
    root = tmp_path_factory.mktemp("quiet")
    run = build_hf_gpt2(root)
    cfg = json.loads((run / "checkpoint-30" / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new"
    model = root / "relu"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**cfg, "activation_function": "relu"}))
    return [
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        str(model),
        "--batch",
        str(run / "batches.h5"),
    ]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptforensics.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def test_a_wrong_activation_is_refused_in_one_line_without_transformers_warnings(
    relu_replay: list[str],
) -> None:
    # -q: no progress lines (on a stderr that is not a terminal, a line every few seconds).
    r = _cli("-q", *relu_replay)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(REFUSED), lines
    assert r.stdout == ""
    r = _cli(*relu_replay)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(REFUSED)
    assert WARNED not in r.stderr, r.stderr


def test_the_warnings_are_in_the_log_at_debug_level(relu_replay: list[str]) -> None:
    r = _cli("-vv", *relu_replay)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    said = [ln for ln in lines if WARNED in ln]
    assert len(said) == 1 and said[0].startswith("DEBUG transformers.configuration_utils: "), said
    assert lines[-1].startswith(REFUSED) and not any(
        ln.startswith("[transformers]") for ln in lines
    )
    # --debug: nothing rerouted, transformers prints as it would, and the traceback shows.
    r = _cli("--debug", "-q", *relu_replay)
    assert r.returncode != 0 and f"[transformers] {WARNED}" in r.stderr and "Traceback" in r.stderr


@pytest.mark.parametrize("level", [logging.WARNING, logging.DEBUG])
def test_python_warnings_go_to_the_log_and_the_hooks_come_off_again(level: int) -> None:
    """`warnings.warn` inside a command's work is a DEBUG record (shown when the log shows
    DEBUG, -vv), not a warning on stderr; afterwards warnings print as they did."""
    root = logging.getLogger()
    seen: list[tuple[str, str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.name, record.levelname, record.getMessage()))

    keep, was, hooks = Keep(), root.level, list(sys.meta_path)
    root.addHandler(keep)
    root.setLevel(level)
    try:
        with warnings.catch_warnings(record=True) as printed:
            warnings.simplefilter("always")
            with libraries():
                warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
            warnings.warn("after the command", FutureWarning, stacklevel=1)
    finally:
        root.removeHandler(keep)
        root.setLevel(was)
    mine = [s for s in seen if s[0] == "py.warnings"]
    if level == logging.DEBUG:
        assert len(mine) == 1 and mine[0][1] == "DEBUG" and "a library's deprecation" in mine[0][2]
    else:
        assert mine == []
    assert [str(w.message) for w in printed] == ["after the command"]
    assert sys.meta_path == hooks and not keep.filters
