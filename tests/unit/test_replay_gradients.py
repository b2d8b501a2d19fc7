"""A replayed step's gradient evidence: one process's figures handed over without packing
(`Gathered.one`) give what packing and the one-rank gather give; several ranks' rows combine
as the whole gradient's; the optimizer's step counts are read as they move."""

from __future__ import annotations

import math

import numpy as np
import torch

from ckptforensics.engine.replay import gradients as gr
from ckptforensics.engine.replay.distributed import OneProcess
from ckptforensics.engine.replay.paramstats import StepCounts

NAMES = ["a.weight", "b.weight", "c.weight"]
NUMEL = [12, 8, 0]


def _figures(
    loss: float, norm: float, rows: int, seed: int
) -> tuple[dict[str, torch.Tensor | float], dict[str, torch.Tensor], np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    head: dict[str, torch.Tensor | float] = {
        "loss": torch.tensor(loss, requires_grad=True) * 1.0,
        "logit_absmax": torch.tensor(7.5 + seed),
        "log_z": 3.25,
        "logit_rows": 6.0 * rows,
        "rows": rows,
        "has_grad_sq": 1.0,
        "norm": torch.tensor(norm),
    }
    per = {
        "loss": torch.rand(rows, generator=g).requires_grad_(),
        "grad_sq": torch.rand(rows, generator=g),
        "tokens": torch.full((rows,), 6.0),
    }
    # [sum g^2, sum g^2 / v_hat, spikes, finite]: no Adam state for c (NaN), a spike in b
    params = np.array([[2.0, 5.0, 0.0, 1.0], [0.5, 9.0, 2.0, 1.0], [0.0, math.nan, 0.0, 1.0]])
    return head, per, params


def test_one_process_on_the_host_gives_what_packing_gives() -> None:
    head, per, params = _figures(2.5, 1.75, 4, 0)
    layout = gr.Layout(pad=4, params=len(NAMES))
    packed = gr.gather(
        OneProcess(torch.device("cpu")),
        layout,
        layout.pack(head, per, torch.from_numpy(params).float()),
    )
    direct = gr.Gathered.one(head, per, params.tolist())
    assert repr(packed) == repr(direct)  # the same numbers, packed or not (NaN too)
    a = packed.evidence(NAMES, NUMEL, NAMES)
    b = direct.evidence(NAMES, NUMEL, NAMES)
    assert a == b
    assert b.total == 1.75 and b.spikes == {"b.weight": 2} and b.nonfinite == ()
    assert set(b.rms_t) == {"a.weight", "b.weight"}  # c has no Adam state: not a number
    assert b.sample_tokens == (6, 6, 6, 6)
    # a non-finite gradient is named
    params[1, 3] = 0.0
    assert gr.Gathered.one(head, per, params.tolist()).evidence(NAMES, NUMEL, NAMES).nonfinite == (
        "b.weight",
    )


def test_ranks_rows_combine_as_the_whole_gradient() -> None:
    """Two ranks: losses add, norms add in squares, sums add, finite only where every
    shard is, each rank's rows in rank order."""
    h0, p0, s0 = _figures(1.0, 3.0, 2, 1)
    h1, p1, s1 = _figures(1.5, 4.0, 3, 2)
    s1[0, 3] = 0.0  # rank 1's shard of a is not finite
    layout = gr.Layout(pad=3, params=len(NAMES))
    rows = torch.stack(
        [layout.pack(h, p, torch.from_numpy(s).float()) for h, p, s in ((h0, p0, s0), (h1, p1, s1))]
    )
    ev = layout.unpack(rows).evidence(NAMES, NUMEL, NAMES)
    assert ev.loss == 2.5 and ev.total == 5.0
    assert ev.nonfinite == ("a.weight",)
    assert ev.spikes == {"b.weight": 4}
    assert ev.rms["a.weight"] == float(np.float32(math.sqrt(np.float32(4.0) / np.float32(12))))
    assert ev.sample_loss == tuple(p0["loss"].tolist() + p1["loss"].tolist())
    assert ev.logit_absmax == 9.5 and ev.log_z == 3.25


def test_step_counts_follow_the_optimizer() -> None:
    counts = StepCounts()
    t = torch.tensor(3.0)
    states = [{"step": t}, {"step": 7}, {}, {"step": torch.tensor(5, dtype=torch.int64)}]
    assert counts(states) == [3.0, 7.0, 0.0, 5.0]
    t.add_(1)  # bumped in place, as torch's optimizers do
    assert counts(states)[0] == 4.0
    states[0]["step"] = torch.tensor(9.0)  # a new tensor (a state loaded again)
    assert counts(states)[0] == 9.0
    # a count on another dtype numpy cannot view is read by value
    states[0]["step"] = torch.tensor(2.0, dtype=torch.bfloat16)
    assert counts(states)[0] == 2.0
    # counts no state holds any more are let go
    for k in range(200):
        assert counts([{"step": torch.tensor(float(k))}]) == [float(k)]
    assert len(counts._views) <= 2 + 64 + 1


def test_session_states_follow_the_optimizer() -> None:
    """`Session._states` keeps its lookups while the optimizer's state mapping is the same,
    and sees a state made on a first step, one filled in place, and a mapping loaded anew."""
    from types import SimpleNamespace

    from ckptforensics.engine.replay.session import Session

    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.AdamW(params, lr=0.1)
    s = SimpleNamespace(opt=opt, _grad_view=("view",), _state_view=None)
    with_grad = [("a", params[0]), ("b", params[1])]
    assert Session._states(s, with_grad) == [{}, {}]  # no state before the first step
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    got = Session._states(s, with_grad)
    assert all("exp_avg_sq" in st for st in got) and got[0] is opt.state[params[0]]
    assert Session._states(s, with_grad) is got  # kept
    # an entry made empty first (a defaultdict read) and filled later is seen
    fresh = torch.nn.Parameter(torch.randn(3))
    opt.add_param_group({"params": [fresh]})
    _ = opt.state[fresh]
    wg = [*with_grad, ("c", fresh)]
    s._grad_view = ("another view",)
    assert Session._states(s, wg)[2] == {}
    fresh.grad = torch.ones(3)
    opt.step()
    assert "exp_avg_sq" in Session._states(s, wg)[2]
    # a mapping loaded anew
    opt.load_state_dict(opt.state_dict())
    assert Session._states(s, wg)[0] is opt.state[params[0]]
