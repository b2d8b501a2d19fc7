"""Benchmark: start-up cost of the CLI (issue: `--help` <= 0.5 s, `inspect` of an HF dir <= 3 s,
a warm-cache `diff` of a 3.2 GiB HF pair <= 5 s), with `python -c pass` and `import torch`
measured in the same run as the baselines.

    python bench/startup.py [--dir build/bench-startup] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def best(cmd: list[str], n: int) -> float:
    """Best wall time of n runs (the warm-cache figure)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "bench-startup")
    ap.add_argument(
        "--layers",
        type=int,
        default=8,
        help="Llama layers of the pair (8: 3.2 GiB with optimizer state).",
    )
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    from diff_throughput import write_pair

    a, b, _ = write_pair(args.dir, args.layers)
    nbytes = sum(f.stat().st_size for d in (a, b) for f in d.rglob("*") if f.is_file())
    tiny = args.dir / "tiny-hf"
    if not tiny.is_dir():
        sys.path.insert(0, str(ROOT))
        from fixtures.formats import build_hf

        build_hf(args.dir)
        (args.dir / "hf-trainer").rename(tiny)
    hf_dir = tiny / "checkpoint-10"
    py, cli = sys.executable, [sys.executable, "-m", "ckptforensics.cli", "-q"]
    rows = [
        ("python -c pass", best([py, "-c", "pass"], 5), None),
        ("python -c 'import torch'", best([py, "-c", "import torch"], 3), None),
        ("ckptforensics --help", best([*cli, "--help"], 5), 0.5),
        (
            "ckptforensics inspect (tiny HF Trainer dir)",
            best([*cli, "inspect", str(hf_dir)], 3),
            3.0,
        ),
        (
            f"ckptforensics diff --json (HF pair, {nbytes / 2**30:.1f} GiB, warm cache)",
            best([*cli, "diff", "--before", str(a), "--after", str(b), "--json"], 3),
            5.0,
        ),
    ]
    lines = [
        f"### startup — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs)",
        "",
        "Best wall time of 3-5 runs, each a fresh process (warm page cache).",
        "",
        "| command | seconds | target |",
        "| --- | --- | --- |",
    ]
    for name, sec, target in rows:
        lines.append(
            f"| {name} | {sec:.2f} | {'—' if target is None else ('✓' if sec <= target else '✗') + f' <= {target:g}'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.record:
        from _results import record_section

        record_section("startup", text)


if __name__ == "__main__":
    main()
