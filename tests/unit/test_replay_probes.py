"""The replay's batched measurements give the figures their one-at-a-time forms give:
`param_grad_table` against `param_grad_stats` / `param_grad_sums` and `isfinite` per
parameter (NaN, spike, overflow, empty and stateless gradients among them); the probes'
deferred rows against `_stats` of each module's output; a watch scoped to the attention
modules after the first pass against the whole-forward mapping pass; per-sample gradient
norms with a Gram matrix shared by linears fed one input, against one backward per row;
the attention statistics (cached causal masks, entropy by nansum of p log_softmax, the layers'
calls measured together) against the per-call log_softmax form they replaced, and the C
kernel's causal figures against those torch ops (non-finite, huge, tied, near one-hot and NaN
logits among them)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ckptforensics.core import fused
from ckptforensics.engine.replay import attnstats
from ckptforensics.engine.replay.passstats import _stats
from ckptforensics.engine.replay.probes import (
    BWD_STATS,
    AttentionWatch,
    ModuleProbe,
    attention_logit_stats,
    attention_logit_stats_many,
    param_grad_stats,
    param_grad_sums,
    param_grad_table,
)
from ckptforensics.engine.replay.samples import PerSampleGrad, per_token_loss
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
    # with a C compiler the table above came from the kernel; the torch blocks agree
    from ckptforensics.engine.replay import paramstats

    if fused.load() is not None:
        adam = {
            k: (s["exp_avg_sq"], gr["eps"] ** 2 * (1 - gr["betas"][1] ** float(s["step"])),
                1 / (1 - gr["betas"][1] ** float(s["step"])))
            for k, (s, gr) in enumerate(zip(states, groups, strict=True)) if s
        }  # fmt: skip
        host = paramstats.host_sums(grads, states, groups)
        assert host is not None
        by_kernel = torch.tensor(host, dtype=torch.float64).float()
        by_torch = paramstats._torch_table(grads, adam, torch.device("cpu"))
        torch.testing.assert_close(by_kernel, by_torch, rtol=1e-5, atol=0.0, equal_nan=True)


def test_param_grad_table_blocks_of_one_size_in_several_shapes_and_dtypes() -> None:
    """Gradients are stacked by size: [128, 64], [64, 128] and [8192] share a block, a
    bf16 one of that size does not; each row is its own parameter's."""
    torch.manual_seed(1)
    shapes = [(128, 64), (64, 128), (8192,), (64,), (32, 256)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = torch.optim.AdamW(params[:-1], lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    grads[1][3, 5] = 1e3  # a spike in the second of the block
    grads.append(torch.randn(64, 128).bfloat16())  # a bf16 gradient of the block's size
    states = [opt.state[p] for p in params[:-1]] + [{}, opt.state[params[1]]]
    group = opt.param_groups[0]
    groups = [group] * 4 + [{}, group]
    table = param_grad_table(grads, states, groups)
    ref = torch.stack(
        [param_grad_stats(g, s, gr) for g, s, gr in zip(grads, states, groups, strict=True)]
    )
    torch.testing.assert_close(table[:, :3], ref, rtol=1e-5, atol=0.0, equal_nan=True)
    assert table[1, 2] > 0 and table[:, 3].tolist() == [1.0] * 6


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
    assert probe._patch_only  # ... and saw the attention calls through `Patched` alone
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


def _attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """[H, 3] of one SDPA call as the watch measured it before: the whole score matrix,
    entropy from log_softmax, row counts from the mask."""
    h, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hk, dim=1)
    s = q.float() @ k.float().transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    valid = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        valid = valid & torch.ones_like(valid).tril()
    if mask is not None and mask.dtype == torch.bool:
        valid = valid & mask
    elif mask is not None:
        s = s + mask
        valid = valid & (mask > torch.finfo(mask.dtype).min / 2)
    s = s.masked_fill(~valid, float("-inf"))
    logp = torch.log_softmax(s, -1)
    ent = -(logp.exp() * logp).nan_to_num(0.0, 0.0, 0.0).sum(-1)
    n = valid.sum(-1).expand_as(ent)
    use = n > 1
    return torch.stack(
        [
            s.amax(dim=(0, 2, 3)),
            torch.where(use, ent / n.clamp_min(2).float().log(), 0.0).sum((0, 2)),
            use.sum((0, 2)).float(),
        ],
        -1,
    )


def _attention_cases() -> list[tuple[str, list, list, torch.Tensor | None, bool]]:
    torch.manual_seed(0)
    b, t, d = 3, 7, 8
    qs = [torch.randn(b, 4, t, d) * 3 for _ in range(3)]
    ks = [torch.randn(b, 2, t, d) * 3 for _ in range(3)]  # GQA: 2 key heads for 4
    pad = torch.ones(b, 1, 1, t, dtype=torch.bool)
    pad[1, ..., 4:] = False  # a padded row
    pad[2] = False  # nothing to attend to
    additive = torch.zeros(b, 1, t, t).masked_fill(~pad, torch.finfo(torch.float32).min)
    nan_q = [q.clone() for q in qs]
    nan_q[1][0, 2, 3, 0] = float("nan")  # one query row's logits are NaN
    return [
        ("causal", qs, ks, None, True),
        ("no mask", qs, ks, None, False),
        ("bool mask + causal", qs, ks, pad, True),
        ("float mask", qs, ks, additive, False),
        ("NaN logits", nan_q, ks, None, True),
    ]


@pytest.mark.parametrize("chunk", [1 << 22, 588, 60])  # one block; a call a block; blocks of rows
def test_attention_stats_batched_and_cached_match_the_per_call_log_softmax_form(
    chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attnstats, "_ATTN_CHUNK", chunk)
    for name, qs, ks, mask, causal in _attention_cases():
        ref = torch.stack(
            [_attention_reference(q, k, mask, causal) for q, k in zip(qs, ks, strict=True)]
        )
        one = torch.stack(
            [attention_logit_stats(q, k, mask, causal) for q, k in zip(qs, ks, strict=True)]
        )
        many = attention_logit_stats_many(qs, ks, mask, causal)
        for got in (one, many):
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6, equal_nan=True, msg=name)
    # the NaN row: its heads' max logit is NaN, its entropy counts 0 (as before)
    assert math.isnan(float(many[1, 2, 0])) and math.isfinite(float(many[1, 2, 1]))


def test_attention_watch_measures_the_layers_together_as_one_call_at_a_time() -> None:
    """The watch holds the calls whose q / k autograd keeps, and measures them at `flush`
    (alike ones together); a call under no_grad is measured at once; row order is call order."""
    torch.manual_seed(0)
    qs = [torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3)]
    ks = [torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(3)]
    other = (torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8))  # another shape, no grad
    watch = AttentionWatch()
    with watch:
        for i, (q, k) in enumerate(zip(qs, ks, strict=True)):
            v = torch.randn_like(k)
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if i == 1:
                F.scaled_dot_product_attention(*other, other[1], scale=0.3)
    assert watch.rows[2] is not None and sum(r is None for r in watch.rows) == 3
    watch.flush()
    ref = [
        _attention_reference(q.detach(), k.detach(), None, True)
        for q, k in zip(qs, ks, strict=True)
    ]
    ref.insert(2, _attention_reference(other[0], other[1], None, False, 0.3))
    for got, want in zip(watch.rows, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


class _Bound(nn.Module):
    """Attention calling SDPA by a name `Patched` does not wrap (as a model that bound it at
    import would), and an eager softmax through Tensor.softmax."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y + (q @ k.transpose(-1, -2)).softmax(-1) @ v


class _BoundAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.attn = _Bound()
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(ids)).view(*ids.shape, 3, 2, 8).unbind(2)
        y = self.attn(*(x.transpose(1, 2) for x in (q, k, v)))
        return self.head(y.transpose(1, 2).reshape(*ids.shape, 16))


@pytest.mark.parametrize("model_of", [lambda: GPT(GPTConfig(n_layer=2)), _BoundAttention])
def test_patched_attention_watch_sees_what_the_mode_sees_or_falls_back(model_of) -> None:
    """After the mapping pass, a model whose every attention call went through `Patched`'s
    wrappers is watched by them alone; one that calls SDPA by another name keeps the mode.
    Either way every pass's attention rows are the mapping pass's, and `remove` leaves
    torch's functions as they were."""
    torch.manual_seed(0)
    model = model_of()
    ids = torch.randint(0, 32, (2, 8))
    probe = ModuleProbe(model)
    passes = []
    for _ in range(3):
        probe.reset()
        model.zero_grad(set_to_none=True)
        per_token_loss(model(ids), ids).mean().backward()
        passes.append(probe.collect())
    assert probe._patch_only == isinstance(model, GPT) and probe._scope  # scoped either way
    assert passes[0].attn is not None and passes[0].attn.shape[0] == len(passes[0].attn_modules)
    for later in passes[1:]:
        torch.testing.assert_close(later.attn, passes[0].attn, equal_nan=True)
    probe.remove()
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    assert torch.Tensor.softmax is torch._C.TensorBase.softmax


class _Returns(nn.Module):
    """A block returning its last child's output tensor, as HF attention (o_proj's) and
    MLP (down_proj's) blocks do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(x + self.block(x))


def test_a_block_returning_its_childs_output_gets_the_childs_rows_from_one_measurement() -> None:
    torch.manual_seed(0)
    model = _Returns()
    ids = torch.randint(0, 32, (2, 6))
    probe = ModuleProbe(model, attention=False)
    outs: dict[str, torch.Tensor] = {}
    for name in ("block", "block.2"):
        mod = model.get_submodule(name)
        mod.register_forward_hook(lambda _m, _a, o, name=name: outs.__setitem__(name, o))
    per_token_loss(model(ids), ids).mean().backward()
    assert outs["block"] is outs["block.2"]
    stats = probe.collect()
    child, parent = probe.index["block.2"], probe.index["block"]
    torch.testing.assert_close(stats.fwd[parent], stats.fwd[child])
    torch.testing.assert_close(stats.bwd[parent], stats.bwd[child])
    torch.testing.assert_close(
        stats.fwd[child], _stats(outs["block"].detach(), with_subnormal=False), rtol=1e-6, atol=0.0
    )
    # the hooks' order as two hooks on one tensor fire: the child's, then the parent's
    k = stats.bwd_order.index(child)
    assert stats.bwd_order[k + 1] == parent and stats.fwd_order.index(
        parent
    ) > stats.fwd_order.index(child)
    probe.remove()


def test_per_sample_norms_count_a_shared_input_whose_other_linear_gets_no_gradient() -> None:
    """q and k fed one input, k's output unused by the loss: q's share is still counted."""
    torch.manual_seed(0)
    emb, q, k = nn.Embedding(16, 6), nn.Linear(6, 8), nn.Linear(6, 8)
    psg = PerSampleGrad(nn.ModuleList([q, k]))
    psg.enabled = True
    ids = torch.randint(0, 16, (3, 4))
    x = emb(ids)
    out, _ = q(x), k(x)  # k: a consumer of x whose gradient never comes
    out.pow(2).sum().backward(inputs=[q.weight, q.bias])
    assert len(psg._inputs) == 1  # x waits for k's gradient
    fast = psg.sq
    assert fast is not None
    for b in range(3):
        q.zero_grad()
        q(emb(ids[b : b + 1])).pow(2).sum().backward(inputs=[q.weight, q.bias])
        brute = float(q.weight.grad.pow(2).sum() + q.bias.grad.pow(2).sum())
        assert float(fast[b]) == pytest.approx(brute, rel=1e-4)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_per_sample_shares_riding_on_the_probe_match_their_own_hooks(checkpointed: bool) -> None:
    """`PerSampleGrad(model, probe)` (one forward and one gradient hook per linear, the
    probe's) gives the figures of its own hooks and the probe's tables unchanged, also
    where activation checkpointing recomputes each block in the backward pass."""
    from ckptforensics.engine.replay.distributed import checkpoint_blocks

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
    ids = torch.randint(0, 32, (3, 16))
    got = []
    for ride in (False, True):
        model = copy.deepcopy(base)
        if checkpointed:
            checkpoint_blocks(model)
        probe = ModuleProbe(model)
        probe.once = checkpointed
        psg = PerSampleGrad(model, probe) if ride else PerSampleGrad(model)
        assert bool(psg._handles) != ride  # riding: no hooks of its own
        for _ in range(2):  # the mapping pass, then a scoped one
            probe.reset()
            psg.reset()
            psg.enabled = True
            per_token_loss(model(ids), ids).mean().backward()
            psg.enabled = False
            stats = probe.collect()
            sq = psg.sq
        assert not psg._inputs or checkpointed  # recomputed inputs wait for no gradient
        got.append((sq, stats))
        psg.remove()
        probe.remove()
    (sq0, s0), (sq1, s1) = got
    assert sq0 is not None and sq1 is not None
    assert torch.equal(sq0, sq1)
    assert torch.equal(s0.fwd.nan_to_num(-1.0), s1.fwd.nan_to_num(-1.0))
    assert torch.equal(s0.bwd.nan_to_num(-1.0), s1.bwd.nan_to_num(-1.0))
    assert s0.fwd_order == s1.fwd_order and s0.bwd_order == s1.bwd_order


class _TwiceMixed(nn.Module):
    """One module called twice in a pass, on an fp32 tensor (measured in place) and on a
    bf16 one (kept pending), in the order given."""

    def __init__(self, fp32_last: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.Tanh()
        self.fp32_last = fp32_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        lo = h.bfloat16()
        a, b = (self.act(lo), self.act(h)) if self.fp32_last else (self.act(h), self.act(lo))
        return a.float() + b.float()


@pytest.mark.parametrize("fp32_last", [False, True])
def test_a_module_measured_in_place_and_pending_in_one_pass_keeps_its_last_call(
    fp32_last: bool,
) -> None:
    torch.manual_seed(0)
    model = _TwiceMixed(fp32_last)
    probe = ModuleProbe(model, attention=False)
    outs: list[torch.Tensor] = []
    model.act.register_forward_hook(lambda _m, _a, o: outs.append(o.detach()))
    x = torch.randn(3, 6) * 2
    model(x).sum().backward()
    stats = probe.collect()
    assert [o.dtype for o in outs][-1] == (torch.float32 if fp32_last else torch.bfloat16)
    want = _stats(outs[-1], with_subnormal=True)
    torch.testing.assert_close(stats.fwd[probe.index["act"]], want, rtol=1e-6, atol=0.0)
    probe.reset()  # a second pass starts clean: the in-place rows of the first are not kept
    model.lin(x).sum().backward()
    again = probe.collect()
    assert math.isnan(float(again.fwd[probe.index["act"], 0]))
    assert not math.isnan(float(again.fwd[probe.index["lin"], 0]))
    probe.remove()


def test_causal_mask_by_bias_matches_masked_fill_with_non_finite_masked_logits() -> None:
    torch.manual_seed(0)
    causal = attnstats._causal(0, 5, 5, torch.device("cpu"))
    s = torch.randn(2, 3, 4, 5, 5)
    cases = {"finite": s}
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = s.clone()
        x[1, 0, 2, 1, 3] = bad  # a logit the causal mask forbids (key 3 after query 1)
        cases[f"masked {bad}"] = x
    for name, x in cases.items():
        want = x.masked_fill(causal[0], float("-inf"))
        got, top = attnstats._causal_masked(x, causal)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(top, want.amax(dim=(-4, -2, -1)), rtol=0, atol=0, msg=name)


def _kernel_spy(monkeypatch: pytest.MonkeyPatch) -> list[bool | None]:
    """What each `fused.Kernels.causal_attention` call returned, in order (skips the test
    where there is no C compiler: the statistics are then torch's anyway)."""
    if fused.load() is None:
        pytest.skip("no C compiler: the attention statistics are torch ops only")
    calls: list[bool | None] = []
    real = fused.Kernels.causal_attention

    def spy(self: fused.Kernels, *args: object) -> bool | None:
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(fused.Kernels, "causal_attention", spy)
    return calls


def _without_kernel(monkeypatch: pytest.MonkeyPatch, f, *args: object) -> torch.Tensor:
    """`f(*args)` with the C kernels unavailable (as CKPTFORENSICS_FUSED=0 or no compiler)."""
    with monkeypatch.context() as m:
        m.setattr(fused, "load", lambda: None)
        return f(*args)


@pytest.mark.parametrize(
    "n, b, h, hk, t, sk",
    [(n, 3, 4, hk, t, t) for hk in (2, 4) for n in (1, 3) for t in (1, 7, 32)]
    + [
        (2, 3, 4, 2, 7, 12),  # fewer queries than keys (top-left causal)
        (2, 3, 4, 2, 20, 7),  # more: the last rows attend every key
        (1, 2, 4, 2, 40, 40),  # a part-filled group of 16 rows
        (1, 2, 2, 1, 100, 100),  # keys summed in several blocks of 64
        (1, 20, 2, 2, 5, 5),  # rows' Z multiplied in several products
    ],
)
def test_causal_attention_kernel_matches_the_torch_path(
    n: int, b: int, h: int, hk: int, t: int, sk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`attention_logit_stats_many` of causal calls by the C kernel (`cf_attn_causal_f32`)
    and by its torch ops: the max logit and the rows counted exactly, entropies within
    1e-5 relative (~1e-7 measured), in GQA and plain layouts, one call and several."""
    calls = _kernel_spy(monkeypatch)
    g = torch.Generator().manual_seed(n * 1000 + t * 10 + hk + sk + b)
    qs = [torch.randn(b, h, t, 8, generator=g) * 2 for _ in range(n)]
    ks = [torch.randn(b, hk, sk, 8, generator=g) * 2 for _ in range(n)]
    got = attention_logit_stats_many(qs, ks, None, True)
    assert calls == [True]
    want = _without_kernel(monkeypatch, attention_logit_stats_many, qs, ks, None, True)
    assert len(calls) == 1  # the torch path did not call it
    assert torch.equal(got[..., 0], want[..., 0]) and torch.equal(got[..., 2], want[..., 2])
    torch.testing.assert_close(got[..., 1], want[..., 1], rtol=1e-5, atol=0.0)
    ref = torch.stack([_attention_reference(q, k, None, True) for q, k in zip(qs, ks, strict=True)])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _planted_logits() -> dict[str, torch.Tensor]:
    """Causal logits [L, b, H, t, S] with the bias added (as `_causal_grouped` forms them),
    each with an edge case planted where the mask lets a query attend."""
    torch.manual_seed(0)
    bias = attnstats._causal(0, 9, 9, torch.device("cpu"))[3]
    raw = torch.randn(2, 3, 4, 9, 9) * 2
    cases = {"finite": raw.clone()}
    cases["+inf"] = raw.clone()
    cases["+inf"][0, 1, 2, 5, 3] = math.inf  # the row's softmax is NaN: entropy 0
    cases["+inf"][1, 2, 0, 8, 8] = math.inf  # on the diagonal
    cases["-inf"] = raw.clone()
    cases["-inf"][1, 0, 1, 6, 2] = -math.inf  # a key the row attends with weight 0
    cases["-inf row"] = raw.clone()
    cases["-inf row"][0, 2, 3, 4, :5] = -math.inf  # every key the row may attend
    cases["huge"] = raw * 1e30  # exp underflows: one-hot rows, entropy 0
    cases["ties"] = (raw * 1e30).clamp(max=5e29)  # huge and tied: entropy log(ties)
    cases["subnormal"] = raw * 30  # e^d down to the subnormals
    return {name: x + bias for name, x in cases.items()}


def test_causal_attention_kernel_on_non_finite_huge_and_tied_logits() -> None:
    """The kernel against `_accumulate`'s torch ops on the logits `_causal_grouped` hands
    it: +inf and -inf logits the mask lets through, a row of -inf, logits so large every
    exp but the max underflows (ties among them), and exps in the subnormals."""
    kernels = fused.load()
    if kernels is None:
        pytest.skip("no C compiler: the attention statistics are torch ops only")
    causal = attnstats._causal(0, 9, 9, torch.device("cpu"))
    for name, s in _planted_logits().items():
        out = torch.empty(2, 4, 3)
        assert kernels.causal_attention(s, causal[1], float(causal[2] * 3), out), name
        want = attnstats._accumulate(s, None, causal, top=s.amax(dim=(-4, -2, -1)))
        assert torch.equal(out[..., 0], want[..., 0]), name
        assert torch.equal(out[..., 2], want[..., 2]), name
        torch.testing.assert_close(out[..., 1], want[..., 1], rtol=1e-5, atol=0.0, msg=name)
        if name == "+inf":
            assert out[0, 2, 0] == math.inf and out[1, 0, 0] == math.inf
        if name == "huge":
            assert torch.equal(out[..., 1], torch.zeros(2, 4))
        if name == "ties":
            assert bool((out[..., 1] > 0).all())


def test_causal_attention_kernel_is_exact_where_rows_are_near_one_hot() -> None:
    """Rows whose max outweighs the rest by e^15: the kernel's log Z (a count of keys at
    the max plus the others' sum, fp64) keeps the entropy to 1e-6 of an fp64 computation,
    where torch's fp32 log Z (of 1 + ~1e-5) is off by ~1e-4 relative."""
    kernels = fused.load()
    if kernels is None:
        pytest.skip("no C compiler: the attention statistics are torch ops only")
    torch.manual_seed(0)
    causal = attnstats._causal(0, 32, 32, torch.device("cpu"))
    raw = torch.randn(1, 8, 4, 32, 32) * 0.5 - 15
    raw[..., range(32), range(32)] = 0.0  # each row's own key dominates
    out = torch.empty(1, 4, 3)
    assert kernels.causal_attention(raw + causal[3], causal[1], 0.0, out)
    s64 = raw.double().masked_fill(causal[0], -math.inf)
    ent = -(s64.softmax(-1) * s64.log_softmax(-1)).nansum(-1)
    torch.testing.assert_close(
        out[..., 1].double(), (ent * causal[1].double()).sum((1, 3)), rtol=1e-6, atol=0.0
    )


def test_causal_attention_kernel_leaves_nan_logits_to_the_masked_fill_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A NaN logit, masked or not (a masked +inf turns NaN under the bias), makes the kernel
    decline; `attention_logit_stats_many` then gives what it gives without the kernel (the
    general path's masked_fill). The kernel declines tensors it does not take."""
    kernels = fused.load()
    calls = _kernel_spy(monkeypatch)
    assert kernels is not None
    causal = attnstats._causal(0, 20, 20, torch.device("cpu"))
    torch.manual_seed(0)
    raw = torch.randn(2, 3, 4, 20, 20)
    # attended; masked, among the keys its 16 rows' last may attend; masked, past those
    for where in ((0, 1, 2, 5, 3), (1, 2, 3, 2, 7), (1, 0, 1, 2, 18)):
        for bad in (math.nan, math.inf):
            if bad == math.inf and where[-1] <= where[-2]:
                continue  # an attended +inf is not NaN (the previous test)
            x = raw.clone()
            x[where] = bad
            out = torch.empty(2, 4, 3)
            assert kernels.causal_attention(x + causal[3], causal[1], 27.0, out) is False
    qs = [torch.randn(3, 4, 9, 8) for _ in range(2)]
    ks = [torch.randn(3, 2, 9, 8) for _ in range(2)]
    qs[1][0, 2, 3, 0] = math.nan  # one query row's logits are NaN
    calls.clear()
    got = attention_logit_stats_many(qs, ks, None, True)
    assert calls == [False]
    want = _without_kernel(monkeypatch, attention_logit_stats_many, qs, ks, None, True)
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0, equal_nan=True)
    assert math.isnan(float(got[1, 2, 0])) and not math.isnan(float(got[1, 2, 1]))
    s = raw + causal[3]
    for args in (
        (s.transpose(-1, -2), causal[1]),  # not contiguous
        (s.double(), causal[1]),
        (s, causal[1][:5]),  # weights for other rows
    ):
        assert kernels.causal_attention(*args, 57.0, torch.empty(2, 4, 3)) is None


class _Fusing(nn.Module):
    """Linears a fused `PerSampleGrad` forms the weight gradients of: a tied head (the
    embedding's weight), one linear called twice, one without a bias, one fed an input
    without a gradient (its bias alone gets one); with `direct`, one called through
    `.forward` (no hooks: the Gram path does not see it)."""

    def __init__(self, direct: bool = False) -> None:
        super().__init__()
        self.direct = direct
        self.emb = nn.Embedding(32, 12)
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12, bias=False)
        self.c = nn.Linear(12, 12)
        self.d = nn.Linear(12, 12)
        self.head = nn.Linear(12, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = torch.tanh(self.a(x)) + self.a(x * 0.5)
        c = self.c.forward(h) if self.direct else self.c(h)
        h = self.b(h) + c + self.d(torch.ones_like(h))
        return self.head(h)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_fused_per_sample_norms_and_weight_gradients_match_the_gram_path(
    checkpointed: bool,
) -> None:
    """`PerSampleGrad(fused=True)` forms each linear's weight gradient from its per-sample
    ones: the per-sample norms and every parameter's gradient (ties, a linear called twice
    or without its hooks, two backward passes accumulating) are those of the Gram path and
    autograd's, to float rounding; the probe's tables are unchanged."""
    from ckptforensics.engine.replay import samples
    from ckptforensics.engine.replay.distributed import checkpoint_blocks

    torch.manual_seed(0)
    models = [
        _Fusing(),
        _Fusing(direct=True),
        GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)),
    ]
    for base in models:
        ids = torch.randint(0, 32, (3, 16))
        got = []
        for fuse in (False, True):
            model = copy.deepcopy(base)
            if checkpointed and isinstance(model, GPT):
                checkpoint_blocks(model)
            probe = ModuleProbe(model)
            probe.once = checkpointed
            psg = PerSampleGrad(model, probe, fused=fuse)
            assert bool(psg._fused_mods) == fuse
            probe.reset()
            psg.reset()
            psg.enabled = True
            for _ in range(2):  # accumulating, as micro-batches do
                per_token_loss(model(ids), ids).mean().backward()
            psg.enabled = False
            assert (bool(psg._norms) or psg._nnorm > 0) == fuse  # the fused path ran
            stats = probe.collect()
            got.append((psg.sq, {n: p.grad.clone() for n, p in model.named_parameters()}, stats))
            psg.remove()
            probe.remove()
            assert all("forward" not in vars(m) or checkpointed for m in model.modules())
        (sq0, g0, s0), (sq1, g1, s1) = got
        assert sq0 is not None and sq1 is not None
        if not getattr(base, "direct", False):  # else only the fused path sees c
            torch.testing.assert_close(sq1, sq0, rtol=1e-5, atol=0)
        assert g0.keys() == g1.keys()
        for n in g0:
            torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(s1.fwd, s0.fwd, equal_nan=True)
        torch.testing.assert_close(s1.bwd, s0.bwd, equal_nan=True)
    assert samples._fuse_pays(torch.zeros(3, 16, 12), torch.zeros(12, 12))  # fused above


class _InPlace(nn.Module):
    """A linear whose output an in-place activation changes after its hook ran; with
    `late`, only from the second pass on."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(6, 3)
        self.late = False
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.lin(x)
        if not self.late or self.calls > 1:
            h = self.act(h)
        return self.out(h)


@pytest.mark.parametrize("late", [False, True])
def test_probe_rows_measure_each_output_as_its_hook_saw_it(late: bool) -> None:
    """With the C kernel (`fused.load`), an fp32 output's row is written from its hook, by
    one kernel call: `_stats` of the output as the hook saw it, also where an in-place
    activation changes it after the hook (from the first pass, or from a later one)."""
    if fused.load() is None:
        pytest.skip("no C compiler: the probe measures with torch ops")
    torch.manual_seed(0)
    model = _InPlace()
    model.late = late
    probe = ModuleProbe(model, attention=False)
    assert probe._fwd_rows._one is not None and probe._bwd_rows._one is not None
    x = torch.randn(4, 5, 6)
    i = probe.index["lin"]
    for _ in range(3):
        probe.reset()
        with torch.no_grad():  # before the activation
            want = _stats(F.linear(x, model.lin.weight, model.lin.bias), with_subnormal=False)
        model(x).sum().backward()
        assert not probe._fwd_rows.direct and not probe._fwd_rows.pending  # all by the kernel
        stats = probe.collect()
        torch.testing.assert_close(stats.fwd[i], want, rtol=1e-6, atol=0.0)
    probe.remove()


@pytest.mark.parametrize("mixed", [False, True])
def test_grad_norm_and_clip_are_torch_clip_grad_norm_to_the_bit(mixed: bool) -> None:
    """`gradients.grad_norm` / `clip_grads` skip torch's grouping where the gradients are
    one group: the norm and the clipped gradients are `clip_grad_norm_`'s exactly, and a
    bf16 gradient among fp32 ones (two groups) takes torch's own functions."""
    from ckptforensics.engine.replay import gradients

    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s)) for s in [(4, 5), (7,), (3, 3, 3)]]
    if mixed:
        ps[1] = nn.Parameter(ps[1].detach().bfloat16())
    for p in ps:
        p.grad = torch.randn_like(p) * 3
    twin = [nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ps, twin, strict=True):
        q.grad = p.grad.clone()
    norm = gradients.grad_norm([p.grad for p in ps])
    want = torch.nn.utils.clip_grad_norm_(twin, 1.0)
    assert torch.equal(norm, want)
    gradients.clip_grads(ps, 1.0, float(norm), norm)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ps, twin, strict=True))


def test_per_token_loss_scores_each_position_against_its_next_token() -> None:
    """HF's convention (labels are the inputs): position t against token t + 1, negative
    labels and masked positions 0, [B, T - 1]; the logits' gradient as cross entropy over
    the sliced logits gives it, bit for bit. Shifted targets: every position as is."""
    torch.manual_seed(3)
    b, t, v = 3, 9, 40
    logits = torch.randn(b, t, v, requires_grad=True)
    labels = torch.randint(0, v, (b, t))
    labels[0, 4], labels[2, 8] = -100, -1
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 6:] = 0
    got = per_token_loss(logits, labels, mask)
    tgt = labels[:, 1:].clone()
    tgt[tgt < 0] = -100
    ref = (
        nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, v), tgt.reshape(-1), reduction="none", ignore_index=-100
        ).view(b, t - 1)
        * mask[:, 1:]
    )
    assert got.shape == (b, t - 1) and got.is_contiguous()
    assert torch.equal(got, ref)
    assert got[0, 3] == 0 and got[2, 7] == 0 and not got[1, 5:].any()
    (g_got,) = torch.autograd.grad(got.sum(), logits)
    (g_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.equal(g_got, g_ref) and not g_got[:, -1].any()
    shifted = per_token_loss(logits, labels, shifted=True)
    assert shifted.shape == (b, t)
    assert shifted[0, 4] == 0 and shifted[2, 8] == 0
    torch.testing.assert_close(
        shifted[1, 0], nn.functional.cross_entropy(logits[1, 0], labels[1, 0]), rtol=0, atol=0
    )


def test_attention_heads_in_python_numbers_equal_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_heads`: a small table in Python numbers, a large one by torch's ops, the same
    figures bit for bit: NaN where no row was counted (0, NaN), a count under 1 taken as 1,
    infinities kept."""
    from ckptforensics.engine.replay import probes

    torch.manual_seed(5)
    a = torch.rand(3, 5, 3) * torch.tensor([30.0, 40.0, 7.0])
    a[0, 1, 2] = 0.0
    a[1, 2, 2] = math.nan
    a[2, 0, 2] = 0.25
    a[2, 3, 1] = math.inf
    a[0, 4, 0] = -math.inf
    small = probes._heads(a)
    monkeypatch.setattr(probes, "_HEADS_IN_PYTHON", 0)
    large = probes._heads(a)
    assert small.shape == (3, 5, 2) and small.dtype == torch.float32
    torch.testing.assert_close(small, large, rtol=0, atol=0, equal_nan=True)
    assert math.isnan(small[0, 1, 1]) and math.isnan(small[1, 2, 1])
    assert small[2, 0, 1] == a[2, 0, 1] and small[2, 3, 1] == math.inf
