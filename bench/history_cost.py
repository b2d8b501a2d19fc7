"""Benchmark: `history` over N checkpoints against what it is made of, N-1 diffs and N forward passes.

On one run (default: `fixtures/logit_runs.py`'s attention-growth run, 11 checkpoints, built
into a temporary folder), alternating so that drift in the machine's speed hits both alike:

- the parts, run apart as the lowest-cost composition of the existing commands would: the
  model built once; per checkpoint, open it, load its weights and run one probed forward
  pass on the same fixed batch (`engine.history.Forward`, the replay's probes); per
  consecutive pair, open both and diff them (`engine.diff.pair.diff_checkpoints`);
- `history` itself (`commands.history.run_history`: the walk, the detectors, the verdict and
  the report document; no files written).

The figure is the ratio of the median times. Target (issue #45): <= 1.2.

    python bench/history_cost.py [--run DIR --model SPEC] [--rounds 5] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._results import publish  # noqa: E402
from ckptforensics.checkpoints import list_checkpoints, open_checkpoint  # noqa: E402
from ckptforensics.commands.history import run_history  # noqa: E402
from ckptforensics.engine.diff.pair import diff_checkpoints  # noqa: E402
from ckptforensics.engine.history import Forward, HistoryConfig, fixed_batch  # noqa: E402
from ckptforensics.engine.replay.model import build_model, load_weights  # noqa: E402


def parts(run: Path, model: str | None) -> float:
    """N forward passes and N-1 diffs, each opening what it reads; seconds."""
    t0 = time.perf_counter()
    cks = list_checkpoints(run)
    with open_checkpoint(cks[0][1]) as first:
        fb = fixed_batch(None, None, first, run)
        m, _ = build_model(model, first)
        load_weights(m, first)
    fw = Forward(m, fb.batch, "cpu")
    for step, path in cks:
        with open_checkpoint(path) as ck:
            load_weights(fw.model, ck)
            fw.measure(step)
    fw.close()
    for (_, pa), (_, pb) in zip(cks, cks[1:], strict=False):
        with open_checkpoint(pa) as a, open_checkpoint(pb) as b:
            diff_checkpoints(a, b)
    return time.perf_counter() - t0


def whole(run: Path, model: str | None) -> float:
    t0 = time.perf_counter()
    run_history(HistoryConfig(run_dir=run, model=model), command="bench")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=None, help="a run dir (default: build the fixture)")
    ap.add_argument("--model", default="fixtures/tinygpt.py:factory")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if run is None:
            from fixtures.logit_runs import build_logit_runs

            run = build_logit_runs(Path(tmp), ["attention_growth"])["attention_growth"]
        n = len(list_checkpoints(run))
        whole(run, args.model)  # warm: kernels compiled, files in the page cache
        a, b = [], []
        for _ in range(args.rounds):
            a.append(parts(run, args.model))
            b.append(whole(run, args.model))
    pa, pb = statistics.median(a), statistics.median(b)
    text = (
        f"## history cost — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs)\n\n"
        f"{n} checkpoints of `{run.name}`, median of {args.rounds} alternating rounds: "
        f"{n - 1} diffs + {n} forward passes {pa:.3f} s; `history` {pb:.3f} s; "
        f"ratio **{pb / pa:.2f}x** (target <= 1.2x)."
    )
    publish("history_cost", text, args.record)


if __name__ == "__main__":
    main()
