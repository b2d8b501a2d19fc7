"""Benchmark: `ckptforensics diff` on a multi-GB synthetic pair vs a raw read (`cat`) of the same files.

Writes an HF-Trainer-style pair (`model.safetensors` in bf16 or fp32 + fp32 `optimizer.pt` of
a Llama with 7B-like proportions, scaled down) under --dir, then interleaves, round after
round, a raw read (`cat` of every file of both checkpoints) and the diff's streaming (after
open; --workers 1 and 2, a child process each) and the whole CLI (start-up included, with
its peak RSS): A B A B ..., on a cold page cache (dropped before each pass: drop_caches as
root, else posix_fadvise DONTNEED per file) and a warm one (read once before each pass).
Each figure is the median over the rounds of the per-round ratio raw / diff, so a busy
neighbour on a shared machine moves a pair of passes together rather than one contender.
--profile adds the per-stage cost of one warm pass (read, dtype conversion, each torch
statistic of the pre-kernel path, the fused kernel), chunk by chunk as the diff streams.
Targets (issue #30): diff >= 0.8x the raw read, cold and warm; peak RSS <= 256 MiB + 3x
largest tensor.

    python bench/diff_throughput.py [--dir /tmp/bench] [--layers 8] [--weights fp32] [--rounds 5] [--profile] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
CODE = [ROOT]  # the checkout whose ckptforensics the children run (--code)


def llama_config(layers: int) -> dict:
    # 7B proportions (hidden 4096, ffn 11008, 32 heads, vocab 32000) with hidden / 4.
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2752,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }


def write_pair(root: Path, layers: int, weights: str = "bf16") -> tuple[Path, Path, int]:
    """Two checkpoints 10 Adam steps apart, weights stored in `weights` (bf16 or fp32);
    returns (a, b, largest tensor bytes)."""
    wdtype = {"bf16": "bfloat16", "fp32": "float32"}[weights]
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = llama_config(layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    decay = [n for n, s in named if len(s) >= 2]
    no_decay = [n for n, s in named if len(s) < 2]
    order = decay + no_decay
    shapes = dict(named)
    g = torch.Generator().manual_seed(0)
    paths = []
    weights, state = {}, {}
    for n in order:
        w = torch.randn(shapes[n], generator=g) * 0.02
        m = torch.randn(shapes[n], generator=g) * 1e-4
        v = 2 * m * m + 1e-12  # |m| / sqrt(v) < 1: a state Adam can reach
        weights[n], state[n] = w, (m, v)
    for step in (100, 110):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
        if step == 110:
            for n in order:  # ten small Adam-like steps
                m, v = state[n]
                weights[n] = weights[n] - 10 * 3e-4 * torch.tanh(m / v.sqrt())
                state[n] = (m * 0.9**10 + 1e-5, v * 0.95**10 + 1e-9)
        save_file(
            {n: weights[n].to(getattr(torch, wdtype)).contiguous() for n in order},
            str(d / "model.safetensors"),
        )
        ids = {n: i for i, n in enumerate(order)}
        osd = {
            "state": {
                ids[n]: {
                    "step": torch.tensor(float(step)),
                    "exp_avg": state[n][0],
                    "exp_avg_sq": state[n][1],
                }
                for n in order
            },
            "param_groups": [
                {
                    "params": [ids[n] for n in decay],
                    "lr": 3e-4,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                    "initial_lr": 3e-4,
                },
                {
                    "params": [ids[n] for n in no_decay],
                    "lr": 3e-4,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.0,
                    "initial_lr": 3e-4,
                },
            ],
        }
        torch.save(osd, d / "optimizer.pt")
        paths.append(d)
    largest = max(s.numel() * 4 for s, _ in state.values())
    return paths[0], paths[1], largest


def files_of(paths: list[Path]) -> list[Path]:
    return [f for d in paths for f in sorted(d.iterdir()) if f.is_file()]


def drop_cache(paths: list[Path]) -> str:
    """Empty the page cache of the pair: every clean page (drop_caches, as root), else the
    pair's own pages (posix_fadvise DONTNEED, no privileges needed). Returns which."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for f in files_of(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise DONTNEED"


def raw_read(paths: list[Path]) -> float:
    """Wall seconds of `cat` reading every file of both checkpoints into /dev/null."""
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files_of(paths))], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def child(cmd: list[str]) -> tuple[float, float, int, str]:
    """Run `cmd`: (wall s, CPU s of it and its children, peak RSS bytes, stdout), from wait4."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(CODE[0])}
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, out


def stream_only(a: Path, b: Path, workers: int) -> None:
    """Child: open the pair, then time the diff alone (its wall and CPU seconds, the
    workers' included), as JSON on stdout."""
    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.engine.diff.pair import diff_checkpoints

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    r0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    t0 = time.perf_counter()
    diff_checkpoints(ca, cb, workers=workers)
    wall = time.perf_counter() - t0
    r1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(
        y.ru_utime + y.ru_stime - x.ru_utime - x.ru_stime for x, y in zip(r0, r1, strict=True)
    )
    print(json.dumps({"wall": wall, "cpu": cpu}))


def profile(a: Path, b: Path, chunk: int = 1 << 19) -> list[tuple[str, float]]:
    """Seconds per stage of one warm pass over every tensor pair, chunk by chunk, one
    thread: the read (page cache -> memory, page faults included), the dtype conversion,
    each statistic of the pre-kernel torch path, and the fused kernel's two calls."""
    import torch

    from ckptforensics.checkpoints import open_checkpoint
    from ckptforensics.core import fused

    torch.set_num_threads(1)
    kern = fused.load()
    ca, cb = open_checkpoint(a), open_checkpoint(b)
    cost: dict[str, float] = {}

    def timed(stage: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        out = fn()
        cost[stage] = cost.get(stage, 0.0) + time.perf_counter() - t0
        return out

    buf = torch.empty(chunk * 4, dtype=torch.uint8)
    for name in ca.names():
        sa, sb = ca.optim_state(name), cb.optim_state(name)
        streams = [
            ca.tensor(name),
            cb.tensor(name),
            sa["exp_avg"],
            sb["exp_avg"],
            sa["exp_avg_sq"],
            sb["exp_avg_sq"],
        ]
        flat = [t.reshape(-1) for t in streams]
        for lo in range(0, flat[0].numel(), chunk):
            _profile_chunk([t[lo : lo + chunk] for t in flat], buf, kern, timed)
    return sorted(cost.items(), key=lambda kv: -kv[1])


def _profile_chunk(raw: list, buf: object, kern: object, timed: Callable) -> None:
    """One chunk of (w_A, w_B, m_A, m_B, v_A, v_B) through every stage, timed."""
    import torch

    for t in raw:  # first touch of the mapped file pages: the read
        nbytes = t.numel() * t.element_size()
        timed(
            "read (page cache -> memory, page faults)",
            lambda t=t, n=nbytes: buf[:n].copy_(t.view(torch.uint8)),
        )
    fa, fb, ma, mb, va, vb = (timed("dtype conversion (.float())", t.float) for t in raw)
    d = timed("torch: d = b - a", lambda: fb - fa)
    timed("torch: ||w_A||^2 (dot)", lambda: torch.dot(fa, fa))
    timed("torch: ||dw||^2 (dot)", lambda: torch.dot(d, d))
    ad = timed("torch: |dw|", d.abs)
    timed("torch: max |dw|", ad.max)
    timed("torch: max |w_B| (aminmax)", lambda: torch.aminmax(fb))
    timed("torch: update bound, coarse test (|dw| > c)", lambda: bool((ad > 1e9).any()))
    timed("torch: sum v_A, sum v_B", lambda: (va.sum(), vb.sum()))
    amb = timed("torch: |m_B|", mb.abs)
    timed("torch: max |m_B|, max v_B", lambda: (amb.max(), vb.max()))
    sq = timed("torch: sqrt(v_B)", vb.sqrt)
    rho = [(ma, va), (mb, vb)]
    timed(
        "torch: rho shares (sample of 1/4)",
        lambda: [
            torch.count_nonzero(torch.sub(m[::4].abs(), v[::4].sqrt(), alpha=0.9) > 9e-9)
            for m, v in rho
        ],
    )
    timed(
        "torch: vanished shares (sample of 1/4)",
        lambda: [torch.count_nonzero(v[::4] < 1e-14) for v in (va, vb)],
    )
    timed("torch: v_A > 0 count", lambda: torch.count_nonzero(va > 0))
    timed("torch: v floor (v_B < f v_A)", lambda: bool((vb < va * 0.6).any()))
    timed("torch: m bound (|m_B| > c sqrt v_B)", lambda: bool((amb > sq * 1e3).any()))
    if kern is not None:
        timed("fused kernel: weights", lambda: kern.weights(raw[0], raw[1]))
        timed(
            "fused kernel: moments",
            lambda: kern.moments(*raw[2:], stride=4, thr=0.9, eps=1e-8, floor_k=0.6, c_mb=1e3),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("build/bench"))
    ap.add_argument("--layers", default="8")
    ap.add_argument("--weights", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated")
    ap.add_argument("--reuse", action="store_true", help="keep a pair already written under --dir")
    ap.add_argument(
        "--code",
        type=Path,
        default=ROOT,
        help="time the ckptforensics of another checkout (its root), e.g. before a change",
    )
    ap.add_argument(
        "--profile", action="store_true", help="add the per-stage cost of one warm pass"
    )
    ap.add_argument("--record", action="store_true", help="Append the figures to bench/RESULTS.md.")
    ap.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream-only", nargs=3, metavar=("A", "B", "WORKERS"), help=argparse.SUPPRESS)
    ap.add_argument("--profile-only", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream_only:
        stream_only(Path(args.stream_only[0]), Path(args.stream_only[1]), int(args.stream_only[2]))
        return
    if args.profile_only:
        print(json.dumps(profile(Path(args.profile_only[0]), Path(args.profile_only[1]))))
        return
    if args.write_only:
        a, b, largest = write_pair(args.dir, int(args.layers), args.weights)
        print(json.dumps([str(a), str(b), largest]))
        return
    CODE[0] = args.code.resolve()
    a, b, largest = pair_paths(args)
    figures, how = time_passes(a, b, [int(w) for w in args.workers.split(",")], args.rounds)
    prof = (
        json.loads(child([sys.executable, __file__, "--profile-only", str(a), str(b)])[3])
        if args.profile
        else None
    )
    from _results import publish

    publish("diff", render(args, a, b, largest, figures, how, prof), args.record)


def pair_paths(args: argparse.Namespace) -> tuple[Path, Path, int]:
    """The pair under --dir: written by a child process (this one stays small, so the peak
    RSS wait4 reports for the CLI's child is the diff's own), or reused with --reuse."""
    a, b = args.dir / "checkpoint-100", args.dir / "checkpoint-110"
    if not (args.reuse and a.exists() and b.exists()):
        made = child(
            [
                sys.executable,
                __file__,
                "--write-only",
                "--dir",
                str(args.dir),
                "--layers",
                str(args.layers),
                "--weights",
                args.weights,
            ]
        )
        pa, pb, _ = json.loads(made[3].strip().splitlines()[-1])
        a, b = Path(pa), Path(pb)
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as f:
        largest = max(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * 4  # noqa: SIM118 (not a dict); fp32 moments
    return a, b, largest


def time_passes(a: Path, b: Path, workers: list[int], rounds: int) -> tuple[dict, str]:
    """Per page-cache mode and contender: the per-round (raw s, contender wall s, CPU s, RSS)."""
    cli = [
        sys.executable,
        "-m",
        "ckptforensics.cli",
        "-q",
        "diff",
        "--before",
        str(a),
        "--after",
        str(b),
        "--json",
    ]
    contenders: dict[str, list[str]] = {
        f"diff --workers {w}": [sys.executable, __file__, "--stream-only", str(a), str(b), str(w)]
        for w in workers
    }
    contenders["whole CLI"] = cli
    figures: dict[str, dict[str, list[tuple[float, float, float, int]]]] = {}
    how = ""
    for mode in ("cold", "warm"):
        per: dict[str, list[tuple[float, float, float, int]]] = {k: [] for k in contenders}
        for _ in range(rounds):
            for (
                name,
                cmd,
            ) in contenders.items():  # A B A B ...: each contender paired with its own raw pass
                how = prepare(mode, [a, b]) or how
                raw_s = raw_read([a, b])
                prepare(mode, [a, b])
                wall, cpu, rss, out = child(cmd)
                if name == "whole CLI":
                    doc = json.loads(out)
                    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]["summary"]
                else:
                    got = json.loads(out.strip().splitlines()[-1])
                    wall, cpu = got["wall"], got["cpu"]
                per[name].append((raw_s, wall, cpu, rss))
        figures[mode] = per
    return figures, how


def prepare(mode: str, paths: list[Path]) -> str:
    if mode == "cold":
        return drop_cache(paths)
    raw_read(paths)
    return ""


def render(
    args: argparse.Namespace,
    a: Path,
    b: Path,
    largest: int,
    figures: dict,
    how: str,
    prof: list | None,
) -> str:
    files = files_of([a, b])
    size = sum(f.stat().st_size for f in files)
    gib = size / 2**30
    torch_v = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    load = os.getloadavg()
    lines = [
        f"### diff_throughput — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}, torch {torch_v})",
        "",
        f"- code: {'this checkout' if CODE[0] == ROOT else 'another checkout (--code)'}; {'fused kernel' if CODE[0] == ROOT and os.environ.get('CKPTFORENSICS_FUSED', '1') != '0' else 'torch ops'}",
        f"- pair: {gib:.2f} GiB in {len(files)} files ({args.layers} Llama layers at hidden 1024, vocab 32000; {args.weights} weights, fp32 AdamW moments); largest tensor {largest / MiB:.0f} MiB",
        f"- {args.rounds} rounds, interleaved (raw read, contender, raw read, contender, ...); each ratio is the median over rounds of raw / contender in the same round; cold: {how} before every pass; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}",
        "",
        "| page cache | contender | raw read (median) | contender (median) | **median ratio** | min–max ratio | CPU s | GiB per CPU-s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rss = 0
    for mode, per in figures.items():
        for name, rows in per.items():
            ratios = [r / w for r, w, _, _ in rows]
            raw_m, wall_m, cpu_m = (statistics.median(x[i] for x in rows) for i in range(3))
            rss = max(rss, max(x[3] for x in rows))
            lines.append(
                f"| {mode} | {name} | {raw_m:.2f} s ({gib / raw_m:.2f} GiB/s) | {wall_m:.2f} s ({gib / wall_m:.2f} GiB/s) "
                f"| **{statistics.median(ratios):.2f}×** | {min(ratios):.2f}–{max(ratios):.2f}× | {cpu_m:.2f} | {gib / cpu_m:.2f} |"
            )
    limit = 256 * MiB + 3 * largest
    lines += [
        "",
        f"- peak RSS of the CLI: {rss / MiB:.0f} MiB (target ≤ 256 MiB + 3 × largest = {limit / MiB:.0f} MiB) → {'met' if rss <= limit else 'NOT met'}",
        "- target: diff ≥ 0.8× the raw read, cold and warm (the whole CLI adds `import torch` and the open)",
        *scaling(figures, gib),
    ]
    if prof:
        total = sum(s for _, s in prof)
        lines += [
            "",
            "Per stage, one warm pass over every tensor pair (chunks of 2^19 elements, one thread):",
            "",
            "| stage | s | GiB/s of the pair | share |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {k} | {s:.3f} | {gib / s:.1f} | {s / total:.0%} |" for k, s in prof]
    return "\n".join(lines + [""])


def scaling(figures: dict, gib: float) -> list[str]:
    """On paper, from the measured per-core rate: where the CPUs stop being the limit."""
    one = figures.get("warm", {}).get("diff --workers 1")
    cold = figures.get("cold", {}).get("diff --workers 1")
    if not one or not cold:
        return []
    per_core = gib / statistics.median(c for _, _, c, _ in one)
    disk = gib / statistics.median(r for r, _, _, _ in cold)
    rows = ", ".join(f"{n} cores {n * per_core:.0f} GiB/s" for n in (8, 16, 32, 64))
    return [
        f"- per-core ceiling (warm, --workers 1, CPU seconds of the diff and its helper thread): {per_core:.2f} GiB/s; "
        f"this disk reads {disk:.2f} GiB/s cold (`cat`), so here the disk is the limit from one core on",
        f"- on paper (tensors shared by size, one process a core, no shared state): {rows} of CPU-bound rate, "
        "until the page cache or the drives give out: one NVMe drive (3-7 GiB/s) is the limit from 1-2 cores, "
        "a node's memory bandwidth (~100-200 GiB/s; each byte written once by the drive, read once by the kernel) from about 16-32",
    ]


if __name__ == "__main__":
    main()
