"""Benchmark: `diff` on a pair bigger than the memory it may use, in one process, with
--workers, and under torchrun; the reports must be identical.

Writes an HF-Trainer-style pair (bf16 weights, fp32 Adam moments; the generator of
bench/diff_throughput.py) of about 6 GiB, then runs the real CLI inside a cgroup whose
memory limit (page cache included) is --cap-gib, after dropping the pair from the page
cache. Records wall time, throughput, the cgroup's limit hits, the largest process RSS,
and whether every mode wrote the same report.

    python bench/scale.py [--dir build/bench-scale] [--layers 21] [--cap-gib 2] [--record]

Needs a writable cgroup memory controller (v1 or v2; root in a container usually has
one); without it the runs are uncapped and the table says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diff_throughput import evict  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30


class Cap:
    """A memory cgroup (v1 or v2) to start commands in; `None`-like when unavailable."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.path: Path | None = None
        self.v2 = False
        for base, v2 in ((Path("/sys/fs/cgroup/memory"), False), (Path("/sys/fs/cgroup"), True)):
            knob = "memory.max" if v2 else "memory.limit_in_bytes"
            if not (base / ("cgroup.controllers" if v2 else knob)).exists():
                continue
            try:
                p = base / f"ckptforensics-bench-{os.getpid()}"
                p.mkdir()
                (p / knob).write_text(str(limit))
                if not v2 and (p / "memory.memsw.limit_in_bytes").exists():
                    with contextlib.suppress(OSError):
                        (p / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no escape into swap
                self.path, self.v2 = p, v2
                break
            except OSError:
                continue

    def wrap(self, cmd: list[str]) -> list[str]:
        if self.path is None:
            return cmd
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh", *cmd]

    def peak(self) -> int | None:
        """Most memory charged to the cgroup since reset (page cache included)."""
        if self.path is None:
            return None
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else None

    def reset(self) -> None:
        if self.path is not None and not self.v2:
            (self.path / "memory.failcnt").write_text("0")
            (self.path / "memory.max_usage_in_bytes").write_text("0")

    def close(self) -> None:
        if self.path is not None:
            self.path.rmdir()


def run(cmd: list[str], cap: Cap) -> tuple[float, int, int, str]:
    """(wall s, exit code, largest RSS of any process in the tree, stderr tail)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cap.wrap(cmd), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read() if proc.stderr else ""
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, proc.returncode, usage.ru_maxrss * 1024, err.strip()[-300:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "bench-scale")
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--cap-gib", type=float, default=2.0)
    ap.add_argument("--record", action="store_true", help="Write the table into bench/RESULTS.md.")
    ap.add_argument("--keep", action="store_true", help="Keep the pair on disk afterwards.")
    args = ap.parse_args()
    made = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "diff_throughput.py"), "--write-only", "--dir", str(args.dir), "--layers", str(args.layers)],
        check=True,
        capture_output=True,
        text=True,
    )
    pa, pb, largest = json.loads(made.stdout.strip().splitlines()[-1])
    a, b = Path(pa), Path(pb)
    size = sum(f.stat().st_size for d in (a, b) for f in d.iterdir())
    cap = Cap(int(args.cap_gib * GiB))
    base = [sys.executable, "-m", "ckptforensics.cli", "-q", "diff", "--before", str(a), "--after", str(b)]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    ncpu = os.cpu_count() or 1
    modes = {
        "one process (--workers 1)": [*base, "--workers", "1"],
        f"--workers {min(ncpu, 8)} (the default at this size)": list(base),
        "torchrun, 2 ranks x --workers 1": [torchrun, "--nproc_per_node", "2", "--master_port", "29611", "-m", "ckptforensics.cli", "-q", "diff", "--before", str(a), "--after", str(b), "--workers", "1"],
    }
    rows, reports = [], {}
    # The cap is real: a process that allocates half a GiB more than it is killed.
    hog = [sys.executable, "-c", f"b = bytearray({int(args.cap_gib * GiB) + GiB // 2}); print(len(b))"]
    canary = run(hog, cap)[1] if cap.path else None
    try:
        for mode, cmd in modes.items():
            out = args.dir / "reports" / str(len(rows))
            shutil.rmtree(out, ignore_errors=True)
            evict([a, b])
            cap.reset()
            wall, rc, rss, err = run([*cmd, "--out", str(out)], cap)
            st = cap.peak()
            ok = rc == 0 and (out / "report.json").is_file()
            if ok:
                doc = json.loads((out / "report.json").read_text())
                doc["incident"].pop("command")
                reports[mode] = doc
            rows.append((mode, wall, rc, rss, st, err if not ok else ""))
    finally:
        cap.close()
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    same = len(reports) == len(modes) and all(r == next(iter(reports.values())) for r in reports.values())
    causes = {r["verdict"]["causes"][0]["cause"] for r in reports.values()}
    capped = f"a cgroup capped at {args.cap_gib:g} GiB (page cache included)" if cap.path else "NO cgroup available: uncapped"
    lines = [
        f"### scale — {dt.date.today()} — {platform.node()} ({ncpu} CPUs, {platform.machine()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM)",
        "",
        f"- pair: {size / GiB:.2f} GiB ({args.layers} Llama layers at hidden 1024, vocab 32000; bf16 weights, fp32 moments); largest tensor {largest / MiB:.0f} MiB",
        f"- every run in {capped}, page cache dropped before each"
        + (f"; a process allocating {args.cap_gib + 0.5:g} GiB in it exits {canary} ({'killed: the cap holds' if canary not in (0, None) else 'NOT killed: the cap does not hold'})" if cap.path else ""),
        "",
        "| mode | exit | wall | throughput | cgroup peak (page cache incl.) | largest process RSS |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, wall, rc, rss, st, err in rows:
        lines.append(
            f"| {mode} | {rc} | {wall:.1f} s | {size / wall / GiB:.2f} GiB/s | {'—' if st is None else f'{st / MiB:.0f} MiB'} | {rss / MiB:.0f} MiB |" + (f" {err}" if err else "")
        )
    lines += [
        "",
        f"- reports identical across the modes (the command line aside): {'yes' if same else 'NO'}; verdict: {', '.join(sorted(causes)) or '—'}",
        "- the cgroup's peak counts the page cache the reads fill; at the cap the kernel reclaims clean pages. A diff that needed more than the cap would be OOM-killed (exit -9), as the canary is.",
        "",
    ]
    text = "\n".join(lines)
    from _results import publish

    publish("scale", text, args.record)
    if not same or any(r[2] != 0 for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
