"""Benchmark: `ckptforensics diff` on a multi-GB synthetic pair vs a raw read of the same files.

Writes an HF-Trainer-style pair (bf16 `model.safetensors` + fp32 `optimizer.pt` of a
Llama with 7B-like proportions, scaled down) under --dir, then in the same run times:
  1. a raw sequential read of every file of both checkpoints (16 MiB blocks), and
  2. the real CLI (`ckptforensics diff --json`) in a child process, with its peak RSS.
Targets (issue #2): diff >= 0.8x raw-read throughput; peak RSS <= 256 MiB + 3x largest tensor.

    python bench/diff_throughput.py [--dir build/bench] [--layers 4] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

MiB = 1 << 20


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
        save_file({n: weights[n].to(getattr(torch, wdtype)).contiguous() for n in order}, str(d / "model.safetensors"))
        ids = {n: i for i, n in enumerate(order)}
        osd = {
            "state": {ids[n]: {"step": torch.tensor(float(step)), "exp_avg": state[n][0], "exp_avg_sq": state[n][1]} for n in order},
            "param_groups": [
                {"params": [ids[n] for n in decay], "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "initial_lr": 3e-4},
                {"params": [ids[n] for n in no_decay], "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "initial_lr": 3e-4},
            ],
        }
        torch.save(osd, d / "optimizer.pt")
        paths.append(d)
    largest = max(s.numel() * 4 for s, _ in state.values())
    return paths[0], paths[1], largest


def evict(paths: list[Path]) -> None:
    """Drop the files from the page cache (no privileges needed for clean pages)."""
    for d in paths:
        for f in d.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_read(paths: list[Path]) -> tuple[float, int]:
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for d in paths:
        for f in sorted(d.iterdir()):
            with f.open("rb", buffering=0) as fh:
                while n := fh.readinto(view):
                    total += n
    return time.perf_counter() - t0, total


def peak_rss_of(cmd: list[str]) -> tuple[float, int, str]:
    """Run `cmd`, return (wall seconds, peak RSS bytes, stdout) using wait4's rusage."""
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # child: stdout to a file, then exec
        fd = os.open("/tmp/ckptforensics-bench.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.execv(cmd[0], cmd)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {status}")
    return wall, usage.ru_maxrss * 1024, Path("/tmp/ckptforensics-bench.out").read_text()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("build/bench"))
    ap.add_argument("--layers", default="4")
    ap.add_argument("--record", action="store_true", help="Append the figures to bench/RESULTS.md.")
    ap.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream_only:  # --dir and --layers carry the two checkpoint paths here
        from ckptforensics.diff import diff_checkpoints
        from ckptforensics.formats import open_checkpoint
        from ckptforensics.shard import default_workers

        ca, cb = open_checkpoint(args.dir), open_checkpoint(str(args.layers))
        size = sum(f.stat().st_size for d in (Path(args.dir), Path(args.layers)) for f in d.iterdir())
        t0 = time.perf_counter()
        diff_checkpoints(ca, cb, workers=default_workers(size))  # as the CLI runs it
        print(time.perf_counter() - t0)
        return
    if args.write_only:
        a, b, largest = write_pair(args.dir, int(args.layers))
        print(json.dumps([str(a), str(b), largest]))
        return
    # The pair is written by a child process: this process stays small, so the peak RSS
    # that wait4 reports for the diff's child is the diff's own, not an inherited one.
    import subprocess

    made = subprocess.run(
        [sys.executable, __file__, "--write-only", "--dir", str(args.dir), "--layers", str(args.layers)],
        check=True,
        capture_output=True,
        text=True,
    )
    pa, pb, largest = json.loads(made.stdout.strip().splitlines()[-1])
    a, b = Path(pa), Path(pb)
    versions = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    files = [f for d in (a, b) for f in d.iterdir()]
    size = sum(f.stat().st_size for f in files)
    cmd = [sys.executable, "-m", "ckptforensics.cli", "-q", "diff", "--before", str(a), "--after", str(b), "--json"]
    stream = [sys.executable, __file__, "--stream-only", "--dir", str(a), "--layers", str(b)]
    figures = {}
    for mode in ("cold", "warm"):
        # cold: every contender reads from disk; warm: every contender reads the page cache.
        raws, clis, streams, rsses = [], [], [], []
        for _ in range(2):
            for kind in ("raw", "cli", "stream"):
                if mode == "cold":
                    evict([a, b])
                else:
                    raw_read([a, b])
                if kind == "raw":
                    raws.append(raw_read([a, b])[0])
                elif kind == "cli":
                    wall, rss, out = peak_rss_of(cmd)
                    clis.append(wall)
                    rsses.append(rss)
                    doc = json.loads(out)
                    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]["summary"]
                else:
                    streams.append(float(peak_rss_of(stream)[2]))
        figures[mode] = (min(raws), min(clis), min(streams), max(rsses))
    limit = 256 * MiB + 3 * largest
    rss = max(f[3] for f in figures.values())
    lines = [
        f"### diff_throughput — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, {platform.machine()}, torch {versions.stdout.strip()})",
        "",
        f"- pair: {size / 2**30:.2f} GiB in {len(files)} files ({args.layers} Llama layers at hidden 1024, vocab 32000; bf16 weights, fp32 moments); largest tensor {largest / MiB:.0f} MiB",
        "",
        "| page cache | raw sequential read | diff streaming (after open) | ratio | whole CLI (start-up incl.) | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, (raw_s, cli_s, stream_s, _) in figures.items():
        lines.append(
            f"| {mode} | {raw_s:.2f} s ({size / raw_s / 2**30:.2f} GiB/s) | {stream_s:.2f} s ({size / stream_s / 2**30:.2f} GiB/s) "
            f"| **{raw_s / stream_s:.2f}×** | {cli_s:.2f} s | {raw_s / cli_s:.2f}× |"
        )
    lines += [
        "",
        f"- peak RSS of the CLI: {rss / MiB:.0f} MiB (target ≤ 256 MiB + 3 × largest = {limit / MiB:.0f} MiB) → {'met' if rss <= limit else 'NOT met'}",
        "- target: diff ≥ 0.8× raw-read throughput",
        "",
    ]
    text = "\n".join(lines)
    from _results import publish

    publish("diff", text, args.record)


if __name__ == "__main__":
    main()
