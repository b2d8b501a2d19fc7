"""triage on a loss that creeps: a real tiny run whose data loader corrupts a growing share of
its tokens from one step on (the loss leaves its trend for good, no step of it a spike), and
its twin without the fault; both warm up, decay their LR on a cosine and shift their data
mixture smoothly (docs/signatures.md#log-creep)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ckptforensics.engine.triage import triage
from fixtures.tinygpt import GPT, GPTConfig
from fixtures.zoo import SEEN, batch_for_step, markov_table

STEPS, PEAK, WARMUP = 220, 1e-2, 20
# a second text ramped in token by token, then held: the loss lifts ~1.15x smoothly and settles
MIX_FROM, MIX_TO, MIX_SHARE = 70, 130, 0.08
# the loader's fault: after this step a share (step - CREEP_AT) / 300 of tokens is random, the
# loss creeps to ~1.75x its floor by the end (no step of it a spike)
CREEP_AT = 140


def _train(out: Path, creep: bool) -> Path:
    """Train STEPS steps of the fixture GPT and write its metrics.jsonl (loss, grad norm, LR)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK, betas=(0.9, 0.95), weight_decay=0.1)
    text, other = markov_table(0), markov_table(1)
    rows = []
    for step in range(1, STEPS + 1):
        # 1) linear warm-up 2) cosine decay to 10% of the peak
        lr = PEAK * min(1.0, step / WARMUP) * (0.55 + 0.45 * math.cos(math.pi * step / STEPS))
        for group in opt.param_groups:
            group["lr"] = lr
        g = torch.Generator().manual_seed(step)
        ids = batch_for_step(step, text, 0)  # (B, T)
        share = MIX_SHARE * min(1.0, max(0.0, (step - MIX_FROM) / (MIX_TO - MIX_FROM)))
        mixed = torch.rand(ids.shape, generator=g) < share
        ids = torch.where(mixed, batch_for_step(step, other, 1), ids)
        if creep and step > CREEP_AT:
            bad = torch.rand(ids.shape, generator=g) < (step - CREEP_AT) / 300
            ids = torch.where(bad, torch.randint(0, SEEN, ids.shape, generator=g), ids)
        loss = model(ids, ids)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rows.append({"step": step, "loss": loss.item(), "grad_norm": float(norm), "lr": lr})
    out.mkdir(parents=True, exist_ok=True)
    log = out / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return log


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("creep-log")
    torch.set_num_threads(1)
    return {"creep": _train(root / "creep", True), "twin": _train(root / "twin", False)}


def test_triage_dates_a_creep_where_it_departs(logs: dict[str, Path]) -> None:
    res = triage(logs["creep"], None)
    loss = [json.loads(line)["loss"] for line in logs["creep"].read_text().splitlines()]
    # no step of it is a spike: the largest one-step ratio after the warm-up stays small
    assert max(b / a for a, b in zip(loss[WARMUP:], loss[WARMUP + 1 :], strict=False)) < 1.5
    # the rule that decides is the creep's, dated where the loss departs: the first corrupted
    # step, to within the knee of the two-piece line (the mixture's lift just before it tilts
    # the line before the knee)
    assert res.rule == "creep", (res.first_bad_step, res.rule)
    assert abs(res.first_bad_step - (CREEP_AT + 1)) <= 4


def test_its_twin_with_warmup_cosine_and_a_mixture_shift_stays_quiet(
    logs: dict[str, Path],
) -> None:
    res = triage(logs["twin"], None)
    assert res.first_bad_step is None, (res.first_bad_step, res.rule)
