"""Benchmark: a replayed step's wall time against a plain training step of the same model.

For each depth (default 2, 8 and 32 layers) transformers' own Trainer trains a tiny HF
LlamaForCausalLM (hidden 64, MLP 128, 4 heads / 2 KV heads, untied head: 9 tensors a layer
+ 3) for a few steps on the fixtures' Markov text, keeping a checkpoint at `--before` and at
`--before + --window` and logging its batches (metrics.jsonl, batches.h5). Then, in rounds,
the window is replayed with a plain step taken before each replayed step (pairs: plain,
replay, plain, replay, ...):

  plain    one training step as the Trainer takes it: forward with labels, backward,
           clip_grad_norm_(1.0), the Trainer's own optimizer (`create_optimizer`: fused
           AdamW, decay / no-decay groups) step, zero_grad; taken at the replayed step's
           progress call, so that both steps of a pair meet the machine as it is then.
  replay   `replay.window.run_window` over the window (clip 1.0, the run's), with `after`:
           the per-step time is the wall time from the end of its plain step to the next
           progress call ("step s"), the last step ending where the comparison with
           *after* begins. So it counts everything the replay's step loop does per step
           (the vocabulary check, the fp32 probe pass where precision is not fp32, the
           probed forward+backward with per-sample shares, per-parameter RMS / RMS_t /
           SPAM, clipping, the optimizer step); not the plan (opening the checkpoints),
           the model build and weight load, the row data statistics (one call for the
           whole window before its first step, ~0.35 ms for 4 steps of 8 x 32 tokens),
           nor the comparison with *after*.

The ratio is the median over all pairs of replay / plain; min-max are the rounds' medians.
Pairs, not blocks: the blocks this bench took before (4 plain steps, then the window's 4
replayed steps) scattered 1.0-2.3x a round on a shared 2-CPU machine, and three runs of 15
rounds read 1.51-1.66x of one code; three runs of 9 rounds in pairs read 1.59-1.62x
(bench/RESULTS.md, replay_step notes). Each depth runs in a process of its own (`--one`),
as a replay does. Target (issue #30): <= 1.5x at every depth.

    python bench/replay_step.py [--layers 2 8 32] [--rounds 9] [--window 4] [--profile] [--record]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckptforensics.engine.replay import window as replay_window  # noqa: E402
from ckptforensics.engine.replay.records import ReplayConfig  # noqa: E402
from fixtures.formats import _dataset, _hf_run  # noqa: E402
from fixtures.zoo import BATCH, VOCAB, write_logs  # noqa: E402

WIDTH = 64


def llama(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def training_args(out: Path, steps: int, save: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=save, per_device_train_batch_size=BATCH,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1,
        use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant",
    )  # fmt: skip


def train_run(root: Path, layers: int, before: int, window: int) -> tuple[Path, Any]:
    """The Trainer's run: checkpoints at `before` and `before + window`, its batches logged."""
    from transformers import Trainer, default_data_collator
    from transformers.trainer_callback import PrinterCallback

    out = _hf_run(root, f"llama{layers}")
    model = llama(layers)
    steps = before + window
    data = [{"input_ids": r, "labels": r} for r in _dataset(steps * BATCH)]
    seen: list[torch.Tensor] = []

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = default_data_collator(features)
        seen.append(batch["input_ids"].clone())
        return batch

    args = training_args(out, steps, math.gcd(before, steps))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    write_logs(
        out,
        [
            {"step": e["step"], "loss": e["loss"], "grad_norm": e["grad_norm"], "lr": e["learning_rate"]}
            for e in logs
        ],
        seen[:steps],
    )  # fmt: skip
    return out, seen[:steps]


def plain_stepper(out: Path, layers: int, before: int, batches: list[torch.Tensor]) -> Any:
    """One training step as the Trainer takes it, on the model at `before`."""
    from transformers import LlamaForCausalLM, Trainer

    model = LlamaForCausalLM.from_pretrained(out / f"checkpoint-{before}").train()
    trainer = Trainer(model=model, args=training_args(out / "plain", 1, 1))
    opt = trainer.create_optimizer()
    params = [p for p in model.parameters() if p.requires_grad]
    i = [0]

    def step() -> None:
        ids = batches[before + i[0] % (len(batches) - before)]
        i[0] += 1
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def replay_steps(
    out: Path, before: int, window: int, plain: Any = None
) -> list[tuple[float, float]]:
    """(plain, replayed) seconds of each step of the window (see the module's docstring):
    with `plain`, one plain training step is taken and timed at each step's progress call,
    just before the replayed step, so that both steps of a pair meet the machine as it is
    then; without, plain 0."""
    cfg = ReplayConfig(
        before=out / f"checkpoint-{before}",
        after=out / f"checkpoint-{before + window}",
        batch=str(out / "batches.h5"),
        clip=1.0,
    )
    p = replay_window.plan(cfg)
    assert p.precision == "fp32", p.precision_source
    ends: list[float] = []
    starts: list[float] = []
    plains: list[float] = []
    compare = replay_window.compare_after

    def timed_compare(*a: Any, **k: Any) -> Any:
        ends.append(time.perf_counter())
        return compare(*a, **k)

    def progress(_msg: str) -> None:
        if starts:
            ends.append(time.perf_counter())
        t0 = time.perf_counter()
        if plain is not None:
            plain()
        t1 = time.perf_counter()
        plains.append(t1 - t0 if plain is not None else 0.0)
        starts.append(t1)

    replay_window.compare_after = timed_compare
    try:
        replay_window.run_window(p, 1.0, progress)
    finally:
        replay_window.compare_after = compare
    return [(q, b - a) for q, a, b in zip(plains, starts, ends, strict=True)]


def measure(layers: int, rounds: int, before: int, window: int, root: Path) -> dict[str, Any]:
    out, batches = train_run(root, layers, before, window)
    plain = plain_stepper(out, layers, before, batches)
    for _ in range(2):
        plain()  # warm-up
    replay_steps(out, before, window)  # warm-up
    pairs: list[tuple[float, float]] = []
    for _ in range(rounds):
        got = replay_steps(out, before, window, plain)
        assert len(got) == window, got
        pairs += got
    ratios = [r / q for q, r in pairs]
    per_round = [statistics.median(ratios[i : i + window]) for i in range(0, len(ratios), window)]
    n_tensors = sum(1 for _ in llama(layers).parameters())
    return {
        "layers": layers,
        "tensors": n_tensors,
        "plain": statistics.median(q for q, _ in pairs),
        "replay": statistics.median(r for _, r in pairs),
        "ratio": statistics.median(ratios),
        "lo": min(per_round),
        "hi": max(per_round),
        "out": out,
    }


def in_own_process(layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """`measure` at one depth in a process of its own: what one depth's run leaves behind
    (its models, the allocator's heap) weighed on the next depth's figures in one process
    (32 layers read 1.71x after 2 and 8, 1.50x alone, the same code), and a replay runs
    one model per process."""
    cmd = [
        sys.executable, __file__, "--one", "--layers", str(layers), "--rounds", str(args.rounds),
        "--before", str(args.before), "--window", str(args.window), "--threads", str(args.threads),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def profile(out: Path, before: int, window: int, top: int = 30) -> None:
    """cProfile of one replay's step loop (`run_window` from its first step's progress call
    to the comparison with *after*, which is skipped), by own time, and who calls the costliest."""
    import cProfile
    import pstats

    cfg = ReplayConfig(
        before=out / f"checkpoint-{before}",
        after=out / f"checkpoint-{before + window}",
        batch=str(out / "batches.h5"),
        clip=1.0,
    )
    p = replay_window.plan(cfg)
    compare = replay_window.compare_after
    pr = cProfile.Profile()

    def until_compare(*a: Any, **k: Any) -> list:
        pr.disable()
        return []

    def from_first_step(msg: str) -> None:
        if msg == f"step {before + 1}":
            pr.enable()

    replay_window.compare_after = until_compare
    try:
        replay_window.run_window(p, 1.0, None)  # warm-up
        replay_window.run_window(p, 1.0, from_first_step)
    finally:
        replay_window.compare_after = compare
    st = pstats.Stats(pr).sort_stats("tottime")
    st.print_stats(top)
    st.print_callers(8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--before", type=int, default=4, help="step of the before checkpoint")
    ap.add_argument("--window", type=int, default=4, help="steps replayed")
    ap.add_argument("--profile", action="store_true", help="cProfile the replay at each depth")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default; on a shared 2-CPU machine a second "
        "OpenMP worker that is descheduled stalls every op, and the figures scatter 10x)",
    )
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # in_own_process
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.layers:
            if args.one or args.profile or len(args.layers) == 1:
                r = measure(n, args.rounds, args.before, args.window, Path(tmp))
                if args.one:
                    r.pop("out")
                    print(json.dumps(r))
                    return
            else:
                r = in_own_process(n, args)
            results.append(r)
            print(
                f"{n} layers: plain {r['plain'] * 1e3:.1f} ms, replay {r['replay'] * 1e3:.1f} ms, {r['ratio']:.2f}x",
                file=sys.stderr,
            )
            if args.profile:
                profile(r["out"], args.before, args.window)
    lines = [
        f"### replay_step — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__})",
        "",
        f"HF LlamaForCausalLM, hidden {WIDTH}, MLP {2 * WIDTH}, 4 heads / 2 KV heads, vocab {VOCAB}, untied head; "
        f"batch {BATCH} x 32 tokens; fp32; {torch.get_num_threads()} torch thread(s). The Trainer trained {args.before + args.window} steps "
        f"(checkpoints at {args.before} and {args.before + args.window}, batches logged). "
        f"{args.rounds} rounds, each one replay of the {args.window}-step window (`run_window`, clip 1.0, with *after*) "
        "with a plain training step (forward with labels, backward, clip_grad_norm_ 1.0, the Trainer's own optimizer: "
        "fused AdamW) taken and timed at each replayed step's progress call, just before it: pairs, plain then replay. "
        "A replayed step is timed from the end of its plain step to the next progress call (the last to the comparison "
        "with *after*): model build, checkpoint read, the window's row data statistics (one call before its first step) "
        "and the comparison excluded. "
        f"Each depth in a process of its own. Seconds are medians over all steps; the ratio is the median over all pairs "
        f"of replay / plain (min–max: the rounds' medians); "
        f"load average at the end {os.getloadavg()[0]:.1f}."
        + " session.py as committed (in one process on CPU its per-parameter stage is one C call, `paramstats.host_sums`, and its evidence Python numbers, `Gathered.one`).",
        "",
        "| layers | tensors | plain training step | replayed step | **ratio (median)** | min–max ratio | target ≤ 1.5× |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['layers']} | {r['tensors']} | {r['plain'] * 1e3:.1f} ms | {r['replay'] * 1e3:.1f} ms | "
            f"**{r['ratio']:.2f}×** | {r['lo']:.2f}–{r['hi']:.2f}× | {'met' if r['ratio'] <= 1.5 else 'NOT met'} |"
            for r in results
        ),
        "",
    ]
    from _results import publish

    publish("replay_step", "\n".join(lines), args.record)


if __name__ == "__main__":
    main()
