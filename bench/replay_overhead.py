"""Benchmark: probed forward+backward vs plain, and per-sample gradient shares vs one backward.

In one run, on the same model and batch (the project's GPT at a mid size, CPU):
  plain        forward + backward
  probes       forward + backward with ckptforensics' ModuleProbe on every module (with and
               without its attention watch: every SDPA call's logit max and entropy)
  per-sample   forward + backward with probes and PerSampleGrad (Gram trick)
  HF debug     transformers' DebugUnderflowOverflow (when transformers is installed)
  anomaly      torch.autograd.detect_anomaly
Targets (issue #4): probes <= 1.3x plain; per-sample shares <= 2x one batched backward.

    python bench/replay_overhead.py [--layers 6] [--width 384] [--seq 256] [--batch 8] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptforensics.replay.probes import ModuleProbe, param_grad_stats  # noqa: E402
from ckptforensics.replay.samples import PerSampleGrad, per_token_loss  # noqa: E402
from fixtures.tinygpt import GPT, GPTConfig  # noqa: E402


def timed(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    model = GPT(cfg)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        per_token_loss(model(ids), ids).mean().backward()

    plain = timed(step, args.reps)
    # The module probes alone, then with the attention watch (every SDPA call's logit
    # statistics recomputed on the device: the attention-logit-growth evidence).
    bare = ModuleProbe(model, attention=False)

    def bare_probed() -> None:
        bare.reset()
        step()
        bare.collect()

    without_attention = timed(bare_probed, args.reps)
    bare.remove()
    probe = ModuleProbe(model)

    def probed() -> None:
        probe.reset()
        step()
        probe.collect()

    with_probes = timed(probed, args.reps)
    psg = PerSampleGrad(model)

    def per_sample() -> None:
        psg.reset()
        psg.enabled = True
        probed()
        psg.enabled = False

    with_samples = timed(per_sample, args.reps)
    # What a replayed step adds after backward: RMS, RMS_t and SPAM counts of every
    # parameter against a real AdamW state, read to the host in one transfer.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step()
    opt.step()
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}
    params = [p for p in model.parameters() if p.grad is not None]

    def with_stats() -> None:
        per_sample()
        torch.stack([param_grad_stats(p.grad, opt.state[p], groups[id(p)]) for p in params]).cpu()

    with_param_stats = timed(with_stats, args.reps)
    psg.remove()
    probe.remove()
    rows = [
        ("plain forward+backward", plain),
        ("ckptforensics probes, no attention watch", without_attention),
        ("ckptforensics probes (with the attention watch)", with_probes),
        ("probes + per-sample gradient shares", with_samples),
        ("probes + shares + per-parameter RMS_t / SPAM", with_param_stats),
    ]
    try:
        from transformers.debug_utils import DebugUnderflowOverflow

        dbg = DebugUnderflowOverflow(model, max_frames_to_save=1)
        rows.append(("transformers DebugUnderflowOverflow", timed(step, args.reps)))
        for h in getattr(model, "_forward_hooks", {}).copy():
            del h
        model = GPT(cfg)  # a fresh model: the debug hooks cannot be removed cleanly
        del dbg
    except ImportError:
        pass

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            step()

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows.append(("torch.autograd.detect_anomaly", timed(anomaly, args.reps)))
    lines = [
        f"### replay_overhead — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__})",
        "",
        f"GPT {args.layers} layers x {args.width} wide, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens; best of {args.reps}.",
        "",
        "| pass | seconds | vs plain |",
        "| --- | --- | --- |",
        *(f"| {name} | {t:.3f} | {t / plain:.2f}× |" for name, t in rows),
        "",
        f"- probes: {with_probes / plain:.2f}× plain (target ≤ 1.3×) → {'met' if with_probes / plain <= 1.3 else 'NOT met'}; "
        f"the attention watch's share: {(with_probes - without_attention) / plain:.2f}× plain",
        f"- per-sample shares: {with_samples / with_probes:.2f}× the probed backward they ride on, {with_samples / plain:.2f}× plain (target ≤ 2×) → {'met' if with_samples / plain <= 2 else 'NOT met'}",
        f"- everything a replayed step measures: {with_param_stats / plain:.2f}× plain",
        "",
    ]
    text = "\n".join(lines)
    from _results import publish

    publish("replay", text, args.record)


if __name__ == "__main__":
    main()
