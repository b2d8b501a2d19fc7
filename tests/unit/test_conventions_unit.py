"""Label conventions, calling conventions and the log check, on small tensors and real tiny
modules (no training)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from ckptforensics.engine.replay.conventions import (
    LabelError,
    detect_call,
    measure_labels,
    settle_labels,
)
from ckptforensics.engine.replay.logcheck import check_against_log, log_rounding
from fixtures.tinygpt import GPT, GPTConfig, TargetsGPT


def _text(rows: int = 4, length: int = 33, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 50, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_hf_labels_and_next_token_targets_are_told_apart() -> None:
    t = _text()
    same, nxt, n = measure_labels([{"input_ids": t, "labels": t}])
    assert (same, n > 100) == (1.0, True) and nxt < 0.1
    x, y = t[:, :-1], t[:, 1:]
    same, nxt, _ = measure_labels([{"input_ids": x, "labels": y}])
    assert nxt == 1.0 and same < 0.1
    assert settle_labels([{"input_ids": x, "labels": y}]).shifted
    assert not settle_labels([{"input_ids": t, "labels": t}]).shifted
    assert not settle_labels([{"input_ids": t}]).shifted  # no labels: the inputs are the targets


def test_padding_and_ignored_targets_do_not_blur_the_measure() -> None:
    """A padded row's last real target is the next token while its next input is padding
    (nanoGPT-style rows cut short); ignored targets (-1, -100) and masked positions count for
    neither convention."""
    t = _text()
    x, y = t[:, :-1].clone(), t[:, 1:].clone()
    x[:, 20:] = 0
    y[:, 20:] = -1
    conv = settle_labels([{"input_ids": x, "labels": y}])
    assert conv.shifted and conv.next == 1.0
    hf = {"input_ids": t.clone(), "labels": t.clone(), "attention_mask": torch.ones_like(t)}
    hf["input_ids"][:, 25:] = 0
    hf["labels"][:, 25:] = -100
    hf["attention_mask"][:, 25:] = 0
    assert settle_labels([hf]).same == 1.0


def test_contradicted_and_undecided_conventions_are_errors() -> None:
    t = _text()
    with pytest.raises(
        LabelError,
        match="labels_shifted attribute says labels are next-token targets, but the data says otherwise",
    ):
        settle_labels([{"input_ids": t, "labels": t}], declared=True)
    with pytest.raises(LabelError, match="--labels says labels are the inputs"):
        settle_labels([{"input_ids": t[:, :-1], "labels": t[:, 1:]}], flag="unshifted")
    mixed = [{"input_ids": t, "labels": torch.cat([t[:2], _text(2, 33, seed=1)])}]
    with pytest.raises(
        LabelError,
        match=r"follow neither convention \(labels == input_ids on .*; pass --labels shifted\|unshifted",
    ):
        settle_labels(mixed)
    # What the data cannot decide, a flag or the log's own attribute decides, said so.
    assert settle_labels(mixed, flag="shifted").source.startswith("--labels")
    constant = torch.full((2, 16), 7)
    assert settle_labels(
        [{"input_ids": constant, "labels": constant}], declared=True
    ).source.startswith("the batch log's labels_shifted")


def test_the_calling_convention_is_found_from_one_forward() -> None:
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2)
    t = _text(2, 9)
    batch = {"input_ids": t[:, :-1], "labels": t[:, 1:]}
    with torch.no_grad():
        hf = detect_call(GPT(cfg), batch, shifted=True)
        nano = detect_call(TargetsGPT(cfg), batch, shifted=True)
    assert hf.keywords and hf.targets is None and hf.output == "logits"
    assert (
        nano.targets == "targets"
        and nano.output == "tuple"
        and "without targets: plain call gives logits [2, 1, 64]" in nano.describe
    )

    class Positional(torch.nn.Module):  # torchtitan-style: forward(tokens) -> logits
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 64)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.emb(tokens)

    with torch.no_grad():
        pos = detect_call(Positional(), batch, shifted=True)
    assert not pos.keywords and pos.describe.startswith("model(ids)")


@dataclass(frozen=True)
class _Rec:
    step: int
    loss: float
    grad_norm: float
    sample_loss: tuple[float, ...] = ()
    sample_tokens: tuple[int, ...] = ()


def test_the_log_is_read_in_its_own_terms() -> None:
    recs = [_Rec(s, 2.0 + 0.0123457 * s, 1.0) for s in range(11, 21)]
    # A log every step: each step its own loss.
    step_log = {r.step: {"loss": r.loss, "grad_norm": r.grad_norm} for r in recs}
    assert check_against_log(recs, step_log, "fp32").first_miss is None
    # HF Trainer with logging_steps=5: the mean over the interval, at steps 15 and 20 (10's
    # interval starts before the window and is not checked).
    hf = {
        10: {"loss": 9.0},
        15: {"loss": sum(r.loss for r in recs[:5]) / 5},
        20: {"loss": sum(r.loss for r in recs[5:]) / 5},
    }
    check = check_against_log(recs, hf, "fp32")
    assert (
        check.first_miss is None
        and "interval" in check.loss_as
        and [c.step for c in check.checks if c.checked] == [15, 20]
    )
    # Printed with 4 decimals: the rounding is part of the tolerance.
    printed = {s: {"loss": round(v["loss"], 4)} for s, v in step_log.items()}
    assert log_rounding([v["loss"] for v in printed.values()]) == 5e-5
    # A grad norm of 0 on every line was never computed; a clipped one is read as such.
    zero = {s: {"loss": v["loss"], "grad_norm": 0.0} for s, v in step_log.items()}
    assert check_against_log(recs, zero, "fp32").first_miss is None
    big = [_Rec(r.step, r.loss, 5.0) for r in recs]
    clipped = {s: {"loss": v["loss"], "grad_norm": 1.0} for s, v in step_log.items()}
    got = check_against_log(big, clipped, "fp32", clip=1.0)
    assert got.first_miss is None and got.grad_as == "the clipped grad norm"
    # A step off by 2%: the first miss.
    off = {**step_log, 14: {"loss": recs[3].loss * 1.02}}
    assert check_against_log(recs, off, "fp32").first_miss.step == 14


def test_one_micro_batch_of_the_step_is_recognised() -> None:
    """nanoGPT logs the last micro-step's loss: with the micro-batch size known, the replay's
    rows give that figure."""
    rec = _Rec(5, 2.5, 1.0, sample_loss=(1.0, 2.0, 3.0, 4.0), sample_tokens=(10, 10, 10, 10))
    check = check_against_log(
        [rec], {4: {"loss": 9.9}, 5: {"loss": 3.5}}, "fp32", micro_batch_size=2
    )
    assert check.first_miss is None and check.loss_as.startswith("the last micro-batch")
    assert not math.isnan(check.checks[0].loss)
