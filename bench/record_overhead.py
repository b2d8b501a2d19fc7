"""Benchmark: a training step with the flight recorder attached vs the same step without it.

In one run, on the same model and batches (the project's GPT, CPU), steps alternate
between a plain loop (forward, backward, clip, AdamW step) and the same loop with
`ckptforensics.record.Recorder` at its defaults (every step's batch, per-parameter
statistics every 10 steps, the spike monitor), so that drift in the machine's speed hits
both alike. The figure is the ratio of the median step times; the recorder's disk per
step is the segment's size over its steps. Target (issue #15): <= 2% of step time.

    python bench/record_overhead.py [--layers 6] [--width 384] [--seq 256] [--batch 8] [--steps 40] [--record]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptforensics.record import Recorder  # noqa: E402
from fixtures.tinygpt import GPT, GPTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=40, help="steps of each kind (alternating)")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.width // 64,
        n_embd=args.width,
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(Path(tmp) / "flight")

        def step(s: int, recorder: Recorder | None) -> float:
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            t0 = time.perf_counter()
            if recorder is not None:
                recorder.on_batch(s, {"input_ids": ids, "labels": ids})
            loss = model(ids, labels=ids)
            loss.backward()
            if recorder is not None:
                recorder.after_backward(model)
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if recorder is not None:
                recorder.after_step(s, opt, loss=loss, grad_norm=gn, model=model)
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        for s in (1, 2):  # warm-up, both kinds
            step(s, None)
        plain, recorded = [], []
        for k in range(args.steps):
            plain.append(step(k, None))
            recorded.append(step(k + 1, rec))  # recorded steps 1..N: every 10th a stats step
        rec.close()
        seg = sum(p.stat().st_size for p in (Path(tmp) / "flight").glob("segment-*.h5"))
        log = (Path(tmp) / "flight" / "metrics.jsonl").stat().st_size
    p, r = statistics.median(plain), statistics.median(recorded)
    mean_p, mean_r = statistics.fmean(plain), statistics.fmean(recorded)
    ratio = r / p - 1
    lines = [
        f"### record_overhead — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__})",
        "",
        f"GPT {args.layers} layers x {args.width} wide, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens; {args.steps} steps of each kind, alternating.",
        "",
        "| loop | median step (s) | mean step (s) |",
        "| --- | --- | --- |",
        f"| plain | {p:.3f} | {mean_p:.3f} |",
        f"| with Recorder (defaults) | {r:.3f} | {mean_r:.3f} |",
        "",
        f"- overhead: {ratio:+.2%} of the median step, {mean_r / mean_p - 1:+.2%} of the mean (stats steps included; target ≤ 2%) → {'met' if ratio <= 0.02 else 'NOT met'}",
        f"- disk: {seg / args.steps / 1024:.1f} KiB per step in the batch segments (int32 ids, shuffle + gzip; random tokens: real text compresses further), {log / args.steps:.0f} B per step in metrics.jsonl",
        "",
    ]
    from _results import publish

    publish("record", "\n".join(lines), args.record)


if __name__ == "__main__":
    main()
