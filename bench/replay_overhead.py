"""Benchmark: probed forward+backward vs plain, and per-sample gradient shares vs one backward.

In one run, on the same model and batch (the project's GPT at a mid size, CPU):
  plain        forward + backward
  probes       forward + backward with ckptforensics' ModuleProbe on every module (with and
               without its attention watch: every SDPA call's logit max and entropy)
  per-sample   forward + backward with probes and PerSampleGrad as session.py runs it in one
               process (linears forming their weight gradients from the per-sample ones
               where that costs less than the Gram matrices), and by Gram matrices only
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
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptforensics.engine.replay.probes import (  # noqa: E402
    ModuleProbe,
    param_grad_stats,
    param_grad_table,
)
from ckptforensics.engine.replay.samples import PerSampleGrad, per_token_loss  # noqa: E402
from fixtures.tinygpt import GPT, GPTConfig  # noqa: E402


def interleaved(
    variants: list[tuple[str, Callable[[], None]]], rounds: int
) -> dict[str, tuple[float, float]]:
    """name -> (median seconds, median of per-round ratios to the first variant): every
    round runs each variant once (A B C ... A B C ...), so a busy neighbour on a shared
    machine slows a round's passes together instead of one variant's best-of."""
    for _, fn in variants:
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, fn in variants:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = times[variants[0][0]]
    return {
        name: (
            statistics.median(ts),
            statistics.median(t / b for t, b in zip(ts, base, strict=True)),
        )
        for name, ts in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=9, help="interleaved rounds")
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
    base = GPT(cfg)
    n_params = sum(1 for _ in base.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))

    def copy() -> GPT:
        """A model of its own for each variant (same weights): its hooks stay installed
        for the whole run, so the variants can take turns."""
        return copy_module(base)

    def stepper(model: GPT) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            per_token_loss(model(ids), ids).mean().backward()

        return step

    variants: list[tuple[str, Callable[[], None]]] = [("plain forward+backward", stepper(copy()))]
    # The module probes alone, then with the attention watch (every SDPA call's logit
    # statistics recomputed on the device: the attention-logit-growth evidence).
    for label, attention in (
        ("ckptforensics probes, no attention watch", False),
        ("ckptforensics probes (with the attention watch)", True),
    ):
        variants.append((label, probed(copy(), stepper, attention)))
    m_samples = copy()
    variants.append(("probes + per-sample gradient shares", with_samples(m_samples, stepper)))
    variants.append((GRAM_ONLY, with_samples(copy(), stepper, fused=False)))
    variants.append(
        ("probes + shares + per-parameter RMS_t / SPAM", with_param_stats(copy(), stepper, True))
    )
    variants.append((PER_PARAM_OLD, with_param_stats(copy(), stepper, False)))
    try:
        from transformers.debug_utils import DebugUnderflowOverflow

        m_dbg = copy()
        DebugUnderflowOverflow(m_dbg, max_frames_to_save=1)
        variants.append(("transformers DebugUnderflowOverflow", stepper(m_dbg)))
    except ImportError:
        pass
    plain_anomaly = stepper(copy())

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            plain_anomaly()

    variants.append(("torch.autograd.detect_anomaly", anomaly))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        figures = interleaved(variants, args.reps)
    rows = [(name, *figures[name]) for name, _ in variants]
    plain = figures[variants[0][0]][0]
    r = {name: ratio for name, _, ratio in rows}
    with_probes = r["ckptforensics probes (with the attention watch)"]
    without_attention = r["ckptforensics probes, no attention watch"]
    with_samples_r = r["probes + per-sample gradient shares"]
    everything = r["probes + shares + per-parameter RMS_t / SPAM"]
    per_param_old = r[PER_PARAM_OLD]
    gram_only = r[GRAM_ONLY]
    lines = [
        f"### replay_overhead — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__})",
        "",
        f"GPT {args.layers} layers x {args.width} wide, vocab {args.vocab}, batch {args.batch} x {args.seq} tokens; "
        f"{args.reps} interleaved rounds (each variant once a round, on its own copy of the model); median seconds, "
        f"median of the per-round ratios to plain; load average at the end {os.getloadavg()[0]:.1f}.",
        "",
        "| pass | seconds (median) | vs plain (median ratio) |",
        "| --- | --- | --- |",
        *(f"| {name} | {t:.3f} | {ratio:.2f}× |" for name, t, ratio in rows),
        "",
        f"- probes: {with_probes:.2f}× plain (target ≤ 1.3×) → {'met' if with_probes <= 1.3 else 'NOT met'}; "
        f"the attention watch's share: {with_probes - without_attention:.2f}× plain",
        f"- per-sample shares: {with_samples_r / with_probes:.2f}× the probed backward they ride on, {with_samples_r:.2f}× plain (target ≤ 2×) → {'met' if with_samples_r <= 2 else 'NOT met'}; "
        f"by Gram matrices only (no linear forming its own weight gradient): {gram_only:.2f}× plain",
        f"- everything a replayed step measures: {everything:.2f}× plain (target ≤ 1.2×) → {'met' if everything <= 1.2 else 'NOT met'}; plain step {plain:.3f} s",
        f"- the per-parameter stage (RMS, RMS_t, SPAM counts, finite check of {n_params} gradients; `param_grad_table`: one C-kernel call on CPU, whole-block torch ops elsewhere): "
        f"{everything - with_samples_r:+.2f}× plain ({(everything - with_samples_r) * plain * 1e3:+.0f} ms); "
        f"one call per parameter, as session.py called it before: {per_param_old - with_samples_r:+.2f}× plain "
        f"({(per_param_old - with_samples_r) * plain * 1e3:+.0f} ms), everything then {per_param_old:.2f}×",
        "",
    ]
    text = "\n".join(lines)
    from _results import publish

    publish("replay", text, args.record)


def copy_module(model: GPT) -> GPT:
    import copy

    return copy.deepcopy(model)


def probed(
    model: GPT, stepper: Callable[[GPT], Callable[[], None]], attention: bool
) -> Callable[[], None]:
    probe = ModuleProbe(model, attention=attention)
    step = stepper(model)

    def run() -> None:
        probe.reset()
        step()
        probe.collect()

    run.probe = probe  # type: ignore[attr-defined] - the shares ride on its hooks
    return run


def with_samples(
    model: GPT, stepper: Callable[[GPT], Callable[[], None]], fused: bool = True
) -> Callable[[], None]:
    """Probes and per-sample shares as session.py runs them in one process (`fused`: each
    linear forms its weight gradient from the per-sample ones where that costs less than
    the Gram matrices); `fused=False`: the Gram matrices everywhere, as before."""
    run_probed = probed(model, stepper, True)
    psg = PerSampleGrad(model, run_probed.probe, fused=fused)  # type: ignore[attr-defined]

    def run() -> None:
        psg.reset()
        psg.enabled = True
        run_probed()
        psg.enabled = False
        assert psg.sq is not None  # what a step reads (the held gradients are measured here)

    return run


GRAM_ONLY = "probes + shares by Gram matrices only (before: no linear fused)"
PER_PARAM_OLD = "probes + shares + per-parameter, one call per parameter (session.py before)"


def with_param_stats(
    model: GPT, stepper: Callable[[GPT], Callable[[], None]], table: bool
) -> Callable[[], None]:
    """What a replayed step adds after backward: RMS, RMS_t, SPAM counts and the finite
    check of every parameter against a real AdamW state, read to the host in one transfer:
    with `table`, `param_grad_table` (whole-block ops over gradients of one size); else one
    `param_grad_stats` and one `isfinite(g).all()` per parameter (session.py's
    `_gradients` today)."""
    run_samples = with_samples(model, stepper)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stepper(model)()
    opt.step()
    groups = {id(p): g for g in opt.param_groups for p in g["params"]}

    def run() -> None:
        run_samples()
        params = [p for p in model.parameters() if p.grad is not None]
        if table:
            param_grad_table(
                [p.grad for p in params],
                [opt.state[p] for p in params],
                [groups[id(p)] for p in params],
            ).cpu()
            return
        torch.stack([torch.isfinite(p.grad).all() for p in params]).cpu()
        torch.stack([param_grad_stats(p.grad, opt.state[p], groups[id(p)]) for p in params]).cpu()

    return run


if __name__ == "__main__":
    main()
