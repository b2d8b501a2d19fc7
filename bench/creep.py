"""Scoreboard of the slow divergences: `ckptforensics history` on every creep draw of a split.

    python bench/creep.py [--split creep-tuning] [--out build/creep] [--rebuild] [--record]

Each draw of `fixtures/creep_draws.py` is built (trained) unless its truth.json is there,
then the real CLI runs on it as a user would type it
(`ckptforensics history --run-dir RUN --batch RUN/batches.h5 --model ... --json`) and its
JSON is held to the truth: cause top-1 (the verdict's first cause), layer (the verdict's
`first_anomalous_module` equal to, a parent or a child of the truth's layer), onset in range
(`history.onset_step` inside the truth's `creep.onset_range`, the rule written down in
`fixtures/creep_draws.py`), and false alarms on the twins (any finding, or a cause other
than `none`). The held-out split is only scored, once: it runs with `--heldout` alone, and
its figures are recorded only when asked (`--record`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench._results import publish  # noqa: E402
from fixtures.creep_draws import KINDS, SPLITS, build_creep, draw_creep  # noqa: E402

MODEL = "fixtures/tinygpt.py:factory"
# The console script beside this interpreter: what a user of the venv types.
CLI = Path(sys.executable).with_name("ckptforensics")
HELDOUT = ("creep-heldout", "creep-heldout-2")


@dataclass(frozen=True, slots=True)
class Score:
    """One draw held to its truth; None where the field does not apply (twins: no layer)."""

    seed: int
    kind: str  # the draw's mechanism (a twin carries its fix)
    twin: bool
    cause: str  # the verdict's first cause
    cause_ok: bool
    layer: str | None  # the verdict's first_anomalous_module
    layer_ok: bool | None
    onset: int | None  # history.onset_step
    onset_range: tuple[int, int] | None
    onset_ok: bool | None
    false_alarm: bool | None
    seconds: float  # the history command's wall time


def related(a: str | None, b: str) -> bool:
    """`a` names module `b`, a parent or a child of it (the zoo scoreboard's layer match)."""
    return a is not None and (a == b or a.startswith(b + ".") or b.startswith(a + "."))


def run_history(run: Path) -> tuple[dict[str, Any], float]:
    """The CLI's JSON on `run`, and its wall time (seconds)."""
    cmd = [
        str(CLI),
        "history",
        "--run-dir",
        str(run),
        "--batch",
        str(run / "batches.h5"),
        "--model",
        MODEL,
        "--json",
    ]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    took = time.perf_counter() - t
    if res.returncode not in (0, 1):
        raise RuntimeError(f"history on {run} exited {res.returncode}: {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout), took


def score(seed: int, run: Path) -> Score:
    """Hold the history of the draw at `run` to its truth.json."""
    truth = json.loads((run / "truth.json").read_text())
    d = draw_creep(seed)
    doc, took = run_history(run)
    causes = [c["cause"] for c in doc["verdict"]["causes"]] or ["none"]
    module = doc["verdict"].get("first_anomalous_module")
    onset = doc["history"].get("onset_step")
    if truth["cause"] == "none":
        alarm = causes[0] != "none" or bool(doc["findings"])
        return Score(
            seed,
            d.kind,
            True,
            causes[0],
            causes[0] == "none",
            module,
            None,
            onset,
            None,
            None,
            alarm,
            took,
        )
    lo, hi = truth["creep"]["onset_range"]
    return Score(
        seed,
        d.kind,
        False,
        causes[0],
        causes[0] == truth["cause"],
        module,
        related(module, truth["layers"][0]),
        onset,
        (lo, hi),
        onset is not None and lo <= onset <= hi,
        None,
        took,
    )


def _frac(flags: Iterable[bool | None]) -> str:
    got = [f for f in flags if f is not None]
    return f"{sum(got)}/{len(got)}" if got else "-"


def table(scores: list[Score], split: str) -> str:
    """The figures as Markdown: totals, per kind, then one line per draw."""
    inc = [s for s in scores if not s.twin]
    twins = [s for s in scores if s.twin]
    lines = [
        f"## Slow divergences (`bench/creep.py`, split `{split}`)",
        "",
        f"{dt.date.today()} · {platform.machine()} · {platform.python_version()} · "
        f"{len(inc)} incidents, {len(twins)} twins",
        "",
        "| | cause top-1 | layer | onset in range | false alarms on twins |",
        "|---|---|---|---|---|",
        f"| all | {_frac(s.cause_ok for s in inc)} | {_frac(s.layer_ok for s in inc)} | "
        f"{_frac(s.onset_ok for s in inc)} | {sum(bool(s.false_alarm) for s in twins)}/{len(twins)} |",
    ]
    for kind in KINDS:
        k = [s for s in inc if s.kind == kind]
        t = [s for s in twins if s.kind == kind]
        lines.append(
            f"| {kind} | {_frac(s.cause_ok for s in k)} | {_frac(s.layer_ok for s in k)} | "
            f"{_frac(s.onset_ok for s in k)} | {sum(bool(s.false_alarm) for s in t)}/{len(t)} |"
        )
    lines += [
        "",
        "| seed | kind | twin | cause | layer | onset (range) | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        rng = f" ({s.onset_range[0]}-{s.onset_range[1]})" if s.onset_range else ""
        lines.append(
            f"| {s.seed} | {s.kind} | {'yes' if s.twin else ''} | {s.cause}{'' if s.cause_ok else ' ✗'} | "
            f"{s.layer or '-'}{' ✗' if s.layer_ok is False else ''} | {s.onset}{rng}"
            f"{' ✗' if s.onset_ok is False else ''} | {s.seconds:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=sorted(SPLITS), default="creep-tuning")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "creep")
    ap.add_argument("--rebuild", action="store_true", help="retrain draws already built")
    ap.add_argument("--record", action="store_true", help="keep the figures in bench/RESULTS.md")
    ap.add_argument(
        "--heldout", action="store_true", help=f"confirm scoring {' or '.join(HELDOUT)} (once)"
    )
    args = ap.parse_args()
    if args.split in HELDOUT and not args.heldout:
        ap.error(f"{args.split} is only scored, once: pass --heldout to score it")
    scores = []
    for seed in SPLITS[args.split]:
        run = args.out / draw_creep(seed).name
        if args.rebuild or not (run / "truth.json").is_file():
            build_creep(seed, args.out)
        scores.append(score(seed, run))
        print(f"{seed}: {scores[-1]}", file=sys.stderr, flush=True)
    publish(args.split, table(scores, args.split), args.record)


if __name__ == "__main__":
    main()
