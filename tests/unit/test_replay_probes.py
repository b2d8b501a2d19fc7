"""The replay's batched measurements give the figures their one-at-a-time forms give:
`param_grad_table` against `param_grad_stats` / `param_grad_sums` and `isfinite` per
parameter (NaN, spike, overflow, empty and stateless gradients among them); the probes'
deferred rows against `_stats` of each module's output; a watch scoped to the attention
modules after the first pass against the whole-forward mapping pass; per-sample gradient
norms with a Gram matrix shared by linears fed one input, against one backward per row."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ckptforensics.replay.probes import (
    BWD_STATS,
    ModuleProbe,
    _stats,
    param_grad_stats,
    param_grad_sums,
    param_grad_table,
)
from ckptforensics.replay.samples import PerSampleGrad, per_token_loss
from fixtures.tinygpt import GPT, GPTConfig


def _adam_state(n: int) -> tuple[list[torch.Tensor], list[dict], list[dict]]:
    torch.manual_seed(0)
    shapes = [(8, 4), (16,), (0,), (3, 5), (6, 6), (7,), (5, 2)][:n]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = torch.optim.AdamW(params[:-1], lr=1e-3)  # the last one has no optimizer state
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    grads[0][1, 2] = 10.0  # a SPAM spike
    grads[3][0, 0] = float("nan")
    grads[4][2, 2] = 3e30  # finite, its square overflows fp32
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    states = [opt.state.get(p) or {} for p in params]
    groups = [group.get(id(p), {}) for p in params]
    return grads, states, groups


def test_param_grad_table_matches_one_call_per_parameter() -> None:
    grads, states, groups = _adam_state(7)
    table = param_grad_table(grads, states, groups)
    ref = torch.stack(
        [param_grad_stats(g, s, gr) for g, s, gr in zip(grads, states, groups, strict=True)]
    )
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).float()
    torch.testing.assert_close(table[:, :3], ref, rtol=1e-5, atol=0.0, equal_nan=True)
    assert table[:, 3].tolist() == finite.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    assert table[0, 2] >= 1 and math.isnan(float(table[6, 1]))  # spike; no state: NaN RMS_t
    sums = param_grad_table(grads, states, groups, sums=True)
    ref_sums = torch.stack(
        [param_grad_sums(g, s, gr) for g, s, gr in zip(grads, states, groups, strict=True)]
    )
    torch.testing.assert_close(sums[:, :3], ref_sums, rtol=1e-5, atol=0.0, equal_nan=True)
    assert param_grad_table([], [], []).shape == (0, 4)


def test_probe_rows_match_stats_and_the_scoped_watch_the_mapping_pass() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    ids = torch.randint(0, 64, (2, 16))
    probe = ModuleProbe(model)
    outs: dict[str, torch.Tensor] = {}
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(
                lambda _m, _a, o, name=name: (
                    outs.__setitem__(name, o.detach())
                    if isinstance(o, torch.Tensor) and o.requires_grad
                    else None
                )
            )
    passes = []
    for _ in range(3):  # the first maps the attention calls; the others watch those modules
        probe.reset()
        model.zero_grad(set_to_none=True)
        per_token_loss(model(ids), ids).mean().backward()
        passes.append(probe.collect())
    first, later = passes[0], passes[2]
    assert later.attn is not None and later.attn.shape[0] == 2 == len(later.attn_modules)
    assert probe._scope and not probe._whole  # the later passes were scoped
    torch.testing.assert_close(first.attn, later.attn, equal_nan=True)
    torch.testing.assert_close(first.fwd, later.fwd, equal_nan=True)
    torch.testing.assert_close(first.bwd, later.bwd, equal_nan=True)
    for name, t in outs.items():
        i = probe.index[name]
        torch.testing.assert_close(
            later.fwd[i], _stats(t, with_subnormal=False), rtol=1e-6, atol=0.0
        )
    assert not math.isnan(float(later.bwd[probe.index["lm_head"], BWD_STATS.index("grad_norm")]))
    probe.remove()


class _Shared(nn.Module):
    """Two linears fed one input tensor (as q/k/v or gate/up are), and one fed another."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 12)
        self.a = nn.Linear(12, 8)
        self.b = nn.Linear(12, 8, bias=False)
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(torch.tanh(self.a(x)) * self.b(x))


@pytest.mark.parametrize("seq", [4, 20])  # Gram path (T^2 <= in x out), and the einsum one
def test_per_sample_norms_with_a_shared_input_match_one_backward_per_row(seq: int) -> None:
    torch.manual_seed(0)
    model = _Shared()
    ids = torch.randint(0, 32, (3, seq))
    psg = PerSampleGrad(model)
    psg.enabled = True
    per_token_loss(model(ids), ids).mean().backward()
    fast = psg.sq.clone()
    assert not psg._inputs  # every shared input released once its gradients used it
    psg.enabled = False
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for b in range(3):
        model.zero_grad()
        (per_token_loss(model(ids[b : b + 1]), ids[b : b + 1]).sum() / (3 * (seq - 1))).backward()
        brute = sum(
            float(m.weight.grad.pow(2).sum())
            + (float(m.bias.grad.pow(2).sum()) if m.bias is not None else 0.0)
            for m in linears
        )
        assert float(fast[b]) == pytest.approx(brute, rel=1e-4)
