"""Score `triage` on the log-only draws (fixtures/log_draws.py): onsets and false alarms.

    python bench/log_draws.py --split tuning [--record]

An incident's onset is right when it falls between the last good logged line and the first
bad one: from the first step no logged line vouches for (a Megatron line logs its interval's
loss and, where the log has the column, the next step's LR) to the line where the log first shows the fault
(`fixtures.log_draws.shows`: the loss over 1.3x its last 8 steps' median or the grad norm
over 3x, `fixtures.draws.log_onset`; for a slow rise, the loss at 1.3x its level before the
fault), plus one step for that line's LR. An excerpt, or a log printed every k iterations,
can place an onset only to within its logging interval, so any step of that span is right;
on a log of every step it is [fault, the step that shows it], and never narrower than
[fault, fault + 1]: an LR fault acts through its step's update, so the loss logged at the fault's
step predates it. A healthy log must give no onset.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def score(run: Path) -> dict[str, Any]:
    from ckptforensics.engine.triage import triage
    from fixtures.log_draws import shows

    t = json.loads((run / "truth.json").read_text())
    d = t["draw"]
    res = triage(run / t["log"], None)
    at = t["first_bad_step"]
    lines = t.get("lines") or sorted(int(s) for s in t["losses"])
    cover = lambda s: next((i for i in lines if i >= s), None)  # noqa: E731
    if at is None:
        ok = res.first_bad_step is None
        lo = hi = None
    else:
        plain = shows(
            {int(k): v for k, v in t["losses"].items()},
            {int(k): v for k, v in t["grad_norms"].items()},
            at,
            after_update=True,  # the only incident is an LR fault: the loss at `at` predates it
        )
        # A log that skips steps (Megatron's --log-interval) places the fault only between two
        # lines: from the first step no line vouches for, up to the line that first shows it by
        # the plain rule, plus one for that line's LR. A clean line L vouches for the updates
        # before it (its loss is its steps' mean, each computed before that step's update) and,
        # where the log prints the LR, for the LR of L + 1 (Megatron prints the LR the scheduler
        # has just set, the next step's): a fault at L + 2 or later; without the LR column,
        # at L or later.
        megatron = d["fmt"] != "jsonl"
        lr = 2 if d.get("log_lr") else 0
        lo = max([i for i in lines if i < at - lr + 1], default=at - lr) + lr if megatron else at
        hi = (cover(max(plain or at, at)) or lines[-1]) + (1 if megatron else 0)
        ok = res.first_bad_step is not None and lo <= res.first_bad_step <= hi
    return {
        "seed": d["seed"], "trap": d["trap"], "incident": d["incident"], "fmt": d["fmt"], "flavour": d["flavour"], "interval": d["interval"],
        "lines": len(lines), "at": at, "window": [lo, hi], "onset": res.first_bad_step, "rule": res.rule, "ok": ok, "noise": res.noise.get("kind"),
        "blips": res.noise.get("recovering_blips"), "ignored_columns": res.noise.get("ignored_columns"),
    }  # fmt: skip


def table(rows: list[dict[str, Any]], split: str) -> str:
    healthy = [r for r in rows if r["incident"] == "none"]
    bad = [r for r in rows if r["incident"] != "none"]
    fa = sum(not r["ok"] for r in healthy)
    hit = sum(r["ok"] for r in bad)
    seeds = f"seeds {rows[0]['seed']}-{rows[-1]['seed']}, " if rows else ""
    head = (f"### triage on log-only draws, {split} split ({seeds}{len(rows)} draws, `fixtures/log_draws.py`) — {dt.date.today()} — {platform.node()} ({os.cpu_count()} CPUs)\n\n"
            f"false alarms on healthy: **{fa}/{len(healthy)}** · onsets found: **{hit}/{len(bad)}**"
            f" ({100 * hit / max(len(bad), 1):.1f}%)\n")  # fmt: skip
    lines = [
        "| seed | trap | incident (step) | log | onset | rule | noise (blips) | |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        log = (
            r["fmt"]
            + (
                ""
                if r["fmt"] == "jsonl"
                else f" {r['flavour']} /{r['interval']} ({r['lines']} lines)"
            )
            + (" no grad norm" if r["ignored_columns"] else "")
        )
        lines.append(
            f"| {r['seed']} | {r['trap']} | {r['incident']} ({r['at'] if r['at'] is not None else '—'}) | {log} | {r['onset'] if r['onset'] is not None else 'none'} | {r['rule'] or '—'} | {r['noise']} ({r['blips']}) | {'✓' if r['ok'] else '✗'} |"
        )
    return head + "\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("tuning", "heldout"), default="tuning")
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "log-draws")
    ap.add_argument("--build", action="store_true", help="Train the draws that are missing first.")
    ap.add_argument(
        "--record", action="store_true", help="Write the held-out table into bench/RESULTS.md."
    )
    args = ap.parse_args()
    from fixtures.log_draws import SPLITS, build

    root = args.dir / args.split
    runs = []
    for seed in SPLITS[args.split]:
        run = root / f"log-draw-{seed}"
        if not (run / "truth.json").is_file():
            if not args.build:
                continue
            build(seed, root)
        runs.append(run)
    text = table([score(r) for r in runs], args.split)
    print(text)
    if args.record and args.split == "heldout":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _results import record_section

        # One section per held-out split (keyed by its first seed): a retired split's table stays.
        seeds = SPLITS[args.split]
        record_section(
            "log-draws-heldout" if seeds[0] == 900 else f"log-draws-heldout-{seeds[0]}", text
        )


if __name__ == "__main__":
    main()
