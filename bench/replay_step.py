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

`--family` builds another decoder family of `fixtures/hf_families.py` at the same sizes
(hidden 64, 4 heads / 2 KV heads, vocab 64, untied head) in place of the Llama above; a
Mixture-of-Experts family (`qwen3_moe`, `mixtral`, `gpt_oss`: 4 experts, top-2, expert MLP 64
(Mixtral: 128), `output_router_logits`, router aux loss coefficient 0.02) is trained by the
Trainer with its load-balancing loss added to the loss, its plain step is the same
(`model(input_ids, labels=...).loss` includes `router_aux_loss_coef * aux_loss`), and the replay
adds the model's aux term likewise (`engine/replay/routers.py`) and reads the routing figures.
With several families (`--family llama qwen3_moe`) each depth runs each family in turn, each in
a process of its own, and `--record` keeps the figures in the `replay_step_moe` block: each MoE
family's ratio against the dense one of the same run (target, issue #44: a MoE model's
replay / plain ratio <= 1.2x the dense one's). `--family llama` alone (the default) is the
`replay_step` block, as before.

    python bench/replay_step.py [--family llama] [--layers 2 8 32] [--rounds 9] [--window 4] [--profile] [--record]
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
from fixtures.hf_families import FAMILIES, MOE  # noqa: E402
from fixtures.hf_families import build as build_family  # noqa: E402
from fixtures.zoo import BATCH, VOCAB, write_logs  # noqa: E402

WIDTH = 64


def llama(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def model_for(family: str, layers: int) -> Any:
    """The bench's model: its own Llama (as before `--family`), or the family's causal LM from
    `fixtures/hf_families.py` at the same sizes (a MoE family: 4 experts, top-2, aux loss on)."""
    if family == "llama":
        return llama(layers)
    return build_family(family, vocab=VOCAB, seq=64, width=WIDTH, layers=layers, heads=4)


def training_args(out: Path, steps: int, save: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=save, per_device_train_batch_size=BATCH,
        learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1,
        use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant",
    )  # fmt: skip


def train_run(root: Path, family: str, layers: int, before: int, window: int) -> tuple[Path, Any]:
    """The Trainer's run: checkpoints at `before` and `before + window`, its batches logged."""
    from transformers import Trainer, default_data_collator
    from transformers.trainer_callback import PrinterCallback

    out = _hf_run(root, f"{family}{layers}")
    model = model_for(family, layers)
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


def plain_stepper(family: str, out: Path, before: int, batches: list[torch.Tensor]) -> Any:
    """One training step as the Trainer takes it, on the model at `before` (a MoE model's loss
    with labels includes its router aux loss, as the Trainer optimises it)."""
    import transformers
    from transformers import Trainer

    cls = getattr(transformers, FAMILIES[family][1])
    model = cls.from_pretrained(out / f"checkpoint-{before}").train()
    if family in MOE:  # the Trainer's loss is the model's: LM loss + coef * aux loss
        with torch.no_grad():
            ids = batches[before]
            got = model(input_ids=ids, labels=ids)
            lm = torch.nn.functional.cross_entropy(
                got.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
            )
            assert got.aux_loss is not None, family
            assert torch.allclose(
                got.loss, lm + model.router_aux_loss_coef * got.aux_loss, atol=1e-5
            ), family
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


def measure(
    family: str, layers: int, rounds: int, before: int, window: int, root: Path
) -> dict[str, Any]:
    out, batches = train_run(root, family, layers, before, window)
    plain = plain_stepper(family, out, before, batches)
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
    n_tensors = sum(1 for _ in model_for(family, layers).parameters())
    return {
        "family": family,
        "layers": layers,
        "tensors": n_tensors,
        "plain": statistics.median(q for q, _ in pairs),
        "replay": statistics.median(r for _, r in pairs),
        "ratio": statistics.median(ratios),
        "lo": min(per_round),
        "hi": max(per_round),
        "per_round": per_round,
        "pairs": pairs,
        "out": out,
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One family's figures at one depth over several processes (`--repeats`): medians over all
    their pairs, min-max over all their rounds' medians."""
    pairs = [tuple(q) for r in runs for q in r["pairs"]]
    per_round = [x for r in runs for x in r["per_round"]]
    return {
        **runs[0],
        "plain": statistics.median(q for q, _ in pairs),
        "replay": statistics.median(r for _, r in pairs),
        "ratio": statistics.median(r / q for q, r in pairs),
        "lo": min(per_round),
        "hi": max(per_round),
        "per_round": per_round,
        "pairs": pairs,
    }


def in_own_process(family: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    """`measure` at one depth in a process of its own: what one depth's run leaves behind
    (its models, the allocator's heap) weighed on the next depth's figures in one process
    (32 layers read 1.71x after 2 and 8, 1.50x alone, the same code), and a replay runs
    one model per process."""
    cmd = [
        sys.executable, __file__, "--one", "--family", family, "--layers", str(layers), "--rounds", str(args.rounds),
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


def dense_lines(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """The `replay_step` block (`--family llama`)."""
    return [
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


def moe_lines(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """The `replay_step_moe` block: each family's ratio, and each MoE family's against llama's
    at the same depth in the same run."""
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for r in results:
        dense = next(
            (d for d in results if d["family"] == "llama" and d["layers"] == r["layers"]), None
        )
        rel = r["ratio"] / dense["ratio"] if dense is not None and r["family"] in MOE else None
        rows.append(
            f"| {r['layers']} | {r['family']} | {r['tensors']} | {r['plain'] * 1e3:.1f} ms | {r['replay'] * 1e3:.1f} ms | "
            f"**{r['ratio']:.2f}×** | {r['lo']:.2f}–{r['hi']:.2f}× | "
            + (
                f"**{rel:.2f}×** | {'met' if rel <= 1.2 else 'NOT met'} |"
                if rel is not None
                else "— | — |"
            )
        )
    return [
        f"### replay_step_moe — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs, torch {torch.__version__})",
        "",
        f"`bench/replay_step.py --family {' '.join(args.family)} --layers {' '.join(map(str, args.layers))} "
        f"--rounds {args.rounds} --repeats {args.repeats}`. The models: llama, the `replay_step` block's "
        f"(hidden {WIDTH}, MLP {2 * WIDTH}, 4 heads / 2 KV heads, vocab {VOCAB}, untied head); each MoE family from "
        "`fixtures/hf_families.py` at the same sizes: 4 experts, top-2, `output_router_logits`, router aux loss "
        "coefficient 0.02 (qwen3_moe: expert MLP 64, fused 3-D expert weights, transformers' default experts "
        "implementation: `grouped_mm`, torch._grouped_mm on CPU), its Trainer's loss and the plain step's `model(input_ids, labels=...).loss` the LM loss "
        "+ 0.02 × aux loss (checked), the replay's likewise (`engine/replay/routers.py`, with its routing figures). "
        f"batch {BATCH} x 32 tokens; fp32; {torch.get_num_threads()} torch thread(s). Each (depth, family) trained "
        f"{args.before + args.window} steps by transformers' Trainer, then {args.rounds} rounds of pairs (a plain "
        f"training step, then the replayed step; as in `replay_step`) over the {args.window}-step window, in a "
        f"process of its own; the families alternate at each depth, and the whole sweep ran {args.repeats} time(s) "
        "(figures pooled: medians over all pairs, min–max over all rounds' medians). "
        f"Load average at the end {load}. Target (issue #44): a MoE model's replay / plain ratio ≤ 1.2× the "
        "dense model's of the same run.",
        "",
        "| layers | family | tensors | plain training step | replayed step | **ratio (median)** | min–max ratio "
        "| **MoE ratio / dense ratio** | target ≤ 1.2× |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--family",
        nargs="+",
        default=["llama"],
        choices=sorted(FAMILIES),
        help="decoder family (fixtures/hf_families.py; llama: the bench's own Llama); several: "
        "each depth runs each in turn, recorded as replay_step_moe",
    )
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="times the whole sweep runs (processes alternate; figures pooled)",
    )
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
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    alone = len(args.layers) == 1 and len(args.family) == 1 and args.repeats == 1
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for n in args.layers:
                for fam in args.family:
                    if args.one or args.profile or alone:
                        r = measure(fam, n, args.rounds, args.before, args.window, Path(tmp))
                        if args.one:
                            r.pop("out")
                            print(json.dumps(r))
                            return
                    else:
                        r = in_own_process(fam, n, args)
                    runs.setdefault((fam, n), []).append(r)
                    print(
                        f"{fam} {n} layers: plain {r['plain'] * 1e3:.1f} ms, replay {r['replay'] * 1e3:.1f} ms, "
                        f"{r['ratio']:.2f}x",
                        file=sys.stderr,
                    )
                    if args.profile:
                        profile(r["out"], args.before, args.window)
    results = [pooled(runs[(fam, n)]) for n in args.layers for fam in args.family]
    from _results import publish

    if args.family == ["llama"]:
        publish("replay_step", "\n".join(dense_lines(args, results)), args.record)
    else:
        publish("replay_step_moe", "\n".join(moe_lines(args, results)), args.record)


if __name__ == "__main__":
    main()
