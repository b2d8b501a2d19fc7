"""triage on the log draws whose misses were read and fixed (issue 32, rounds five to seven), each
rebuilt by the generator's own tiny training run (fixtures/log_draws.py, seconds each) and
scored by the benchmark's own rule (bench/log_draws.py `score`: the onset inside the window
the log allows, or no onset on a healthy log)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from log_draws import score  # noqa: E402

from fixtures.log_draws import build  # noqa: E402

# seed -> the rule that should decide (None: no onset), and what was wrong before.
CLASSES = {
    544: (
        "trend",
        "a single rank's three-step blip, unconfirmed by the grad norm, called an onset",
    ),
    554: ("lr-growth", "heavy-tailed noise held seven steps and fell back: a held rise"),
    581: ("trend", "the fault's own five lines stretched the blip duration that excused it"),
    10165: ("lr-growth", "a held shift starting on noise one step before the logged LR jump"),
    10245: ("lr-growth", "a hard batch met twice at z 7 and 12, its later meetings weaker"),
    # Since the settled level shift (docs/signatures.md#log-settled) the trend's onset at the
    # fault is set aside on this log without a grad norm, and the held rise dates it, now inside
    # the fault's window (270 of [269, 270]).
    10278: ("held", "a held rise dated on noise one step before the fault, the grad norm quiet"),
    10379: (None, "a heavy tail's burst of blips read as a held shift that fell back"),
    10408: ("short-joint", "an excerpt's faulted loss easing back, still past every earlier line"),
    10417: ("held", "a held start a line late: the line before's grad norm led it"),
    10510: ("lr-growth", "a blip the grad norm did not see, overtaken by the LR jump after it"),
    10575: (None, "an excerpt's two-line blip of a heavy tail, back on the third line"),
    10625: ("lr-growth", "a loss past its lines by a hair, named for the next line's grad norm"),
}


@pytest.mark.parametrize("seed", sorted(CLASSES))
def test_a_read_miss_class_is_right_on_its_draw(seed: int, tmp_path: Path) -> None:
    run = build(seed, tmp_path)
    row = score(run)
    rule, was = CLASSES[seed]
    assert row["ok"], (row, was)
    assert row["rule"] == rule, row
