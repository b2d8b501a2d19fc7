"""Benchmark: `diff` on a pair bigger than the memory it may use, in one process, with
--workers, and under torchrun; the reports must be identical. And `replay` of a model whose
fp32 weights, gradients and Adam moments exceed that memory: one process is killed, two
torchrun ranks (FSDP2), each in a cgroup of its own with the same cap, replay it.

Writes an HF-Trainer-style pair (bf16 weights, fp32 Adam moments; the generator of
bench/diff_throughput.py) of about 6 GiB, then runs the real CLI inside a cgroup whose
memory limit (page cache included) is --cap-gib, after dropping the pair from the page
cache. Records wall time, throughput, the cgroup's limit hits, the largest process RSS,
and whether every mode wrote the same report.

    python bench/scale.py [--dir build/bench-scale] [--layers 21] [--cap-gib 2] [--record]
                          [--only diff|replay] [--replay-layers 10] [--replay-width 1024]

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

    def __init__(self, limit: int, name: str | None = None) -> None:
        self.limit = limit
        self.path: Path | None = None
        self.v2 = False
        for base, v2 in ((Path("/sys/fs/cgroup/memory"), False), (Path("/sys/fs/cgroup"), True)):
            knob = "memory.max" if v2 else "memory.limit_in_bytes"
            if not (base / ("cgroup.controllers" if v2 else knob)).exists():
                continue
            try:
                p = base / (name or f"ckptforensics-bench-{os.getpid()}")
                p.mkdir()
                (p / knob).write_text(str(limit))
                if not v2 and (p / "memory.memsw.limit_in_bytes").exists():
                    with contextlib.suppress(OSError):
                        (p / "memory.memsw.limit_in_bytes").write_text(
                            str(limit)
                        )  # no escape into swap
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
    proc = subprocess.Popen(
        cap.wrap(cmd), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
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
    ap.add_argument(
        "--only", choices=("diff", "replay"), default=None, help="Run one of the two benchmarks."
    )
    ap.add_argument("--replay-layers", type=int, default=10, help="Blocks of the replayed GPT.")
    ap.add_argument(
        "--replay-width", type=int, default=1024, help="Hidden size of the replayed GPT."
    )
    args = ap.parse_args()
    failed = False
    if args.only in (None, "diff"):
        failed |= bench_diff(args)
    if args.only in (None, "replay"):
        failed |= bench_replay(args)
    if failed:
        raise SystemExit(1)


def bench_diff(args: argparse.Namespace) -> bool:
    """The diff modes under one cap; True when a mode failed or the reports differ."""
    made = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "diff_throughput.py"),
            "--write-only",
            "--dir",
            str(args.dir),
            "--layers",
            str(args.layers),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    pa, pb, largest = json.loads(made.stdout.strip().splitlines()[-1])
    a, b = Path(pa), Path(pb)
    size = sum(f.stat().st_size for d in (a, b) for f in d.iterdir())
    cap = Cap(int(args.cap_gib * GiB))
    base = [
        sys.executable,
        "-m",
        "ckptforensics.cli",
        "-q",
        "diff",
        "--before",
        str(a),
        "--after",
        str(b),
    ]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    ncpu = os.cpu_count() or 1
    modes = {
        "one process (--workers 1)": [*base, "--workers", "1"],
        f"--workers {min(ncpu, 8)} (the default at this size)": list(base),
        "torchrun, 2 ranks x --workers 1": [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_port",
            "29611",
            "-m",
            "ckptforensics.cli",
            "-q",
            "diff",
            "--before",
            str(a),
            "--after",
            str(b),
            "--workers",
            "1",
        ],
    }
    rows, reports = [], {}
    # The cap is real: a process that allocates half a GiB more than it is killed.
    hog = [
        sys.executable,
        "-c",
        f"b = bytearray({int(args.cap_gib * GiB) + GiB // 2}); print(len(b))",
    ]
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
    same = len(reports) == len(modes) and all(
        r == next(iter(reports.values())) for r in reports.values()
    )
    causes = {r["verdict"]["causes"][0]["cause"] for r in reports.values()}
    capped = (
        f"a cgroup capped at {args.cap_gib:g} GiB (page cache included)"
        if cap.path
        else "NO cgroup available: uncapped"
    )
    lines = [
        f"### scale — {dt.date.today()} — {platform.node()} ({ncpu} CPUs, {platform.machine()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB RAM)",
        "",
        f"- pair: {size / GiB:.2f} GiB ({args.layers} Llama layers at hidden 1024, vocab 32000; bf16 weights, fp32 moments); largest tensor {largest / MiB:.0f} MiB",
        f"- every run in {capped}, page cache dropped before each"
        + (
            f"; a process allocating {args.cap_gib + 0.5:g} GiB in it exits {canary} ({'killed: the cap holds' if canary not in (0, None) else 'NOT killed: the cap does not hold'})"
            if cap.path
            else ""
        ),
        "",
        "| mode | exit | wall | throughput | cgroup peak (page cache incl.) | largest process RSS |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, wall, rc, rss, st, err in rows:
        lines.append(
            f"| {mode} | {rc} | {wall:.1f} s | {size / wall / GiB:.2f} GiB/s | {'—' if st is None else f'{st / MiB:.0f} MiB'} | {rss / MiB:.0f} MiB |"
            + (f" {err}" if err else "")
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
    return not same or any(r[2] != 0 for r in rows)


# Written by a real (two-step) training run of the project's GPT in nanoGPT's format.
_TRAIN = """
import sys, torch, h5py, numpy as np
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fixtures.tinygpt import GPT, GPTConfig
out, layers, width = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab_size=8192, block_size=128, n_layer=layers, n_head=16, n_embd=width, tie_embeddings=False))
opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, betas=(0.9, 0.95))
batches = torch.randint(0, 8192, (2, 4, 128), generator=torch.Generator().manual_seed(1))
for step in (1, 2):
    loss = model(batches[step - 1], labels=batches[step - 1])
    opt.zero_grad(); loss.backward(); opt.step()
    (out / f"step_{step}").mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": model.model_args(), "iter_num": step,
                "config": {"grad_clip": 0.0}}, out / f"step_{step}" / "ckpt.pt")
with h5py.File(out / "batches.h5", "w") as h:
    h["step"] = np.array([1, 2]); h["input_ids"] = batches.numpy(); h.attrs["micro_batch_size"] = 4
print(sum(p.numel() for p in model.parameters()))
"""


def bench_replay(args: argparse.Namespace) -> bool:
    """`replay` of a model too big for one process under the cap: in one process (killed),
    and on two torchrun ranks, each in a cgroup of its own with the same cap. True on failure."""
    run_dir = args.dir / "replay-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRAIN,
            str(ROOT),
            str(run_dir),
            str(args.replay_layers),
            str(args.replay_width),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    n = int(made.stdout.strip().splitlines()[-1])
    state = 16 * n  # fp32 weights, gradients, exp_avg, exp_avg_sq
    replay = ["-m", "ckptforensics.cli", "-q", "replay", "--run-dir", str(run_dir), "--before", "1", "--after", "2",
              "--model", "fixtures/tinygpt.py:factory", "--batch", str(run_dir / "batches.h5")]  # fmt: skip
    caps = [
        Cap(int(args.cap_gib * GiB), f"ckptforensics-bench-{os.getpid()}-rank{i}") for i in range(2)
    ]
    rows, reports = [], {}
    try:
        for mode, world in (
            ("one process", 1),
            ("2 ranks (FSDP2, torchrun's environment), a cap each", 2),
        ):
            out = args.dir / "replay-reports" / str(len(rows))
            shutil.rmtree(out, ignore_errors=True)
            for c in caps:
                c.reset()
            wall, rc, rss, err = run_ranks(
                [sys.executable, *replay, "--out", str(out)], caps[:world]
            )
            peaks = [c.peak() for c in caps[:world]]
            ok = rc == 0 and (out / "report.json").is_file()
            if ok:
                doc = json.loads((out / "report.json").read_text())
                reports[mode] = doc
            rows.append((mode, wall, rc, rss, peaks, err if not ok else ""))
    finally:
        for c in caps:
            c.close()
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    two = reports.get("2 ranks (FSDP2, torchrun's environment), a cap each")
    repro = two is not None and two["verdict"]["reproducible"] is True
    capped = (
        f"a cgroup of {args.cap_gib:g} GiB (page cache included)"
        if caps[0].path
        else "NO cgroup available: uncapped"
    )
    lines = [
        f"### scale: replay — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {_torch_version()})",
        "",
        f"- model: the project's GPT, {args.replay_layers} blocks at width {args.replay_width}, vocab 8192 untied: {n / 1e6:.0f} M parameters; "
        f"fp32 weights + gradients + Adam moments = {state / GiB:.2f} GiB; checkpoints written by its own two training steps (nanoGPT format)",
        f"- each process (one process; each rank) in {capped}",
        "",
        "| mode | exit | wall | cgroup peak per process (page cache incl.) | largest anonymous RSS of a process |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, wall, rc, rss, peaks, err in rows:
        pk = ", ".join("—" if p is None else f"{p / MiB:.0f} MiB" for p in peaks)
        lines.append(
            f"| {mode} | {rc} | {wall:.1f} s | {pk} | {rss / MiB:.0f} MiB |"
            + (f" {err[-120:]}" if err else "")
        )
    lines += [
        "",
        f"- the 2-rank replay reproduces *after*: {'yes' if repro else 'NO'}; per rank the state is 16 B x {n / 1e6:.0f} M / 2 = {state / 2 / GiB:.2f} GiB",
        "",
    ]
    from _results import publish

    publish("scale-replay", "\n".join(lines), args.record)
    one_killed = rows[0][2] != 0
    return not (repro and one_killed) if caps[0].path else not repro


def run_ranks(cmd: list[str], caps: list[Cap]) -> tuple[float, int, int, str]:
    """`cmd` as len(caps) ranks, each in its own cgroup: torchrun's environment for a single
    node (MASTER_ADDR/PORT, RANK, LOCAL_RANK, WORLD_SIZE), set here because torchrun's
    children cannot move themselves into a cgroup. (wall s, first non-zero exit, largest
    RSS, stderr tail of the failing rank)."""
    world = len(caps)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29612",
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )
    if world == 1:
        env.pop("WORLD_SIZE")
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            c.wrap(cmd),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r, c in enumerate(caps)
    ]
    anon, results = 0, {}
    while len(results) < len(procs):  # RssAnon: what the formula counts (no file pages)
        anon = max([anon, *(_rss_anon(p.pid) for p in procs if p.pid not in results)])
        for p in procs:
            if p.pid not in results:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    results[p.pid] = (
                        os.waitstatus_to_exitcode(status),
                        usage.ru_maxrss * 1024,
                        p.stderr.read() if p.stderr else "",
                    )
        time.sleep(0.1)
    results = [results[p.pid] for p in procs]
    wall = time.perf_counter() - t0
    rc = next((r for r, _, _ in results if r != 0), 0)
    err = next((e for r, _, e in results if r != 0), "")
    return wall, rc, anon, err.strip()[-300:]


def _rss_anon(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _torch_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torch")


if __name__ == "__main__":
    main()
