"""The per-expert reduction of a fused MoE tensor (`engine.diff.experts`) on hand-made
tensors: chunk boundaries that cut experts, against a reduction over every dim but the first;
and the per-expert findings (`detectors.diff.experts`) on hand-made statistics."""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.diff import diff_findings
from ckptforensics.detectors.diff.experts import (
    ENERGY_FACTOR,
    OUTLIER_FACTOR,
    detect_dead_experts,
    detect_expert_return,
    detect_expert_update_outlier,
)
from ckptforensics.engine.diff.chunks import Moments, Pair, Staging, flat_chunks
from ckptforensics.engine.diff.experts import ExpertAcc, expert_dim
from ckptforensics.engine.diff.records import DiffResult, ExpertStats, PairInfo, TensorDiff
from ckptforensics.verdict import decide

B1, B2, K = 0.9, 0.95, 5


def _state(dead: int, touch: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (4, 6, 5)  # [E, out, in]
    wa = torch.randn(shape, generator=g) * 0.02
    ma = torch.randn(shape, generator=g) * 1e-3
    va = torch.rand(shape, generator=g) * 1e-6 + 1e-8
    grads = torch.randn((K, *shape), generator=g) * 1e-3
    grads[:, dead] = 0.0  # the dead expert gets no gradient in the window
    if touch:  # ... but for one element, once, far under the sums' rounding
        grads[0, dead, 2, 3] = 1e-6
    grads[:, 3] *= 30.0  # expert 3 gets a burst
    mb, vb = ma.clone(), va.clone()
    for gk in grads:  # torch's AdamW moment updates
        mb.lerp_(gk, 1 - B1)
        vb.mul_(B2).addcmul_(gk, gk, value=1 - B2)
    wb = wa - 1e-2 * torch.sign(mb) * torch.rand(shape, generator=g)
    return {"wa": wa, "wb": wb, "ma": ma, "mb": mb, "va": va, "vb": vb}


def test_per_expert_reduction_matches_the_dense_one_across_chunk_cuts() -> None:
    s = _state(dead=1)
    acc = ExpertAcc(4, s["wa"].numel(), k=K, betas=(B1, B2))
    stage = Staging("cpu")
    flat = {n: t.reshape(-1) for n, t in s.items()}
    for lo, wa in flat_chunks(s["wa"], 7):  # 30 elements per expert: chunks cut experts
        hi = lo + wa.numel()
        w = Pair(wa, flat["wb"][lo:hi], stage)
        mo = Moments([flat[n][lo:hi] for n in ("ma", "mb", "va", "vb")], stage)
        acc.add(lo, w, mo)
    st = acc.result(steps=K, lr=1e-2, step_a=100)
    per = lambda t: t.reshape(4, -1)  # noqa: E731
    d = per(s["wb"] - s["wa"])
    want_ratio = d.norm(dim=1) / per(s["wa"]).norm(dim=1) / K
    assert torch.allclose(
        torch.tensor(st.update_ratio, dtype=torch.float64), want_ratio.double(), rtol=1e-6
    )
    want_rms = d.pow(2).mean(dim=1).sqrt() / (K * 1e-2)
    assert torch.allclose(
        torch.tensor(st.step_rms, dtype=torch.float64), want_rms.double(), rtol=1e-6
    )
    assert torch.allclose(
        torch.tensor(st.mean_v_b, dtype=torch.float64), per(s["vb"]).mean(dim=1).double(), rtol=1e-6
    )
    # No gradient: both moments decayed exactly (beta^k within rounding), every element.
    assert st.decayed == (False, True, False, False)
    # The implied gradient energy: 0 for the dead expert, highest for the burst.
    assert abs(st.r_v[1]) < 1e-4 and st.r_v[3] == max(st.r_v)
    assert st.numel == 30 and st.experts == 4


def _acc(s: dict[str, torch.Tensor], chunk: int) -> ExpertAcc:
    acc = ExpertAcc(4, s["wa"].numel(), k=K, betas=(B1, B2))
    stage, flat = Staging("cpu"), {n: t.reshape(-1) for n, t in s.items()}
    for lo, wa in flat_chunks(s["wa"], chunk):
        hi = lo + wa.numel()
        mo = Moments([flat[n][lo:hi] for n in ("ma", "mb", "va", "vb")], stage)
        acc.add(lo, Pair(wa, flat["wb"][lo:hi], stage), mo)
    return acc


def test_one_touched_element_keeps_an_expert_alive() -> None:
    """The sums cannot see one element's gradient 1e-6 against v ~ 5e-7: the elementwise
    test, run where the sums pass, does; chunks inside one expert and across several."""
    for chunk in (7, 64, 1000):
        assert _acc(_state(dead=1), chunk).result(steps=K, lr=1e-2, step_a=100).decayed[1]
        touched = _acc(_state(dead=1, touch=True), chunk).result(steps=K, lr=1e-2, step_a=100)
        assert touched.decayed == (False,) * 4


def test_weights_only_and_which_tensors_are_per_expert() -> None:
    s = _state(dead=0)
    acc = ExpertAcc(4, s["wa"].numel())
    acc.add(0, Pair(s["wa"].reshape(-1), s["wb"].reshape(-1), Staging("cpu")), None)
    st = acc.result(steps=1, lr=math.nan, step_a=0)
    assert not st.has_moments and all(math.isnan(x) for x in st.step_rms)
    assert expert_dim("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 16), 4) == 4
    assert expert_dim("model.layers.0.mlp.experts.down_proj_bias", (4, 16), 4) == 4
    assert expert_dim("model.layers.0.mlp.experts.gate_up_proj", (8, 4, 16), 4) is None
    assert expert_dim("model.layers.0.mlp.experts.3.w1.weight", (4, 16), 4) is None
    assert expert_dim("model.layers.0.mlp.gate.weight", (4, 16), 4) is None
    assert expert_dim("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 16), None) is None


def _tensor(name: str, st: ExpertStats, k: int = 10) -> TensorDiff:
    return TensorDiff(
        name=name, role="mlp", shape=(st.experts, 8, 4), dtype="float32", numel=st.experts * st.numel,
        w_norm_a=1.0, dw_norm=0.1, dw_max_abs=0.01, update_ratio=0.01, max_abs_b=1.0, headroom_b=1e30,
        nonfinite_a=0, nonfinite_b=0, has_moments=True, k=k, experts=st,
    )  # fmt: skip


def _diff(*ts: TensorDiff) -> DiffResult:
    pair = PairInfo(
        step_a=100, step_b=110, adam_step_a=100, adam_step_b=110, loss_scale_a=None, loss_scale_b=None,
        lr_a=(1e-3,), lr_b=(1e-3,), base_lr=(1e-3,), optimizer="adamw", betas=(0.9, 0.95),
        weights_only=False, n_experts=4,
    )  # fmt: skip
    return DiffResult(pair, list(ts))


def _stats(**kw: Any) -> ExpertStats:
    base: dict[str, Any] = dict(
        experts=4, numel=32, w_norm_a=(1.0,) * 4, dw_norm=(0.1,) * 4,
        update_ratio=(0.010, 0.012, 0.011, 0.009), step_rms=(0.3, 0.28, 0.32, 0.3),
        mean_v_a=(1e-6, 2e-6, 5e-7, 1e-6), mean_v_b=(1e-6, 2e-6, 5e-7, 1e-6), r_v=(1.0, 2.0, 0.5, 1.0),
        decayed=(False,) * 4,
    )  # fmt: skip
    return ExpertStats(**{**base, **kw})


def test_expert_findings_on_hand_made_statistics() -> None:
    gate, down = "model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"
    th = Thresholds()
    # Routine imbalance: nothing.
    quiet = _diff(_tensor(gate, _stats()), _tensor(down, _stats()))
    assert not [f for f in diff_findings(quiet, th) if "expert" in f.kind]
    # Expert 1 decayed exactly in both tensors; expert 0 only in one (not dead).
    dead = _diff(
        _tensor(gate, _stats(decayed=(True, True, False, False))),
        _tensor(down, _stats(decayed=(False, True, False, False))),
    )
    (f,) = detect_dead_experts(dead, th)
    assert f.subject == "model.layers.3.mlp.experts" and f.metrics["experts"] == [1]
    assert f.metrics["layer"] == 3 and f.severity == "warning"
    # Over one step only: info (routine imbalance can idle an expert a step).
    one = _diff(_tensor(gate, _stats(decayed=(False, True, False, False)), k=1))
    assert detect_dead_experts(one, th)[0].severity == "info"
    # All experts decayed: the layer had no gradient at all, not an expert's evidence.
    frozen = _diff(_tensor(gate, _stats(decayed=(True,) * 4)))
    assert detect_dead_experts(frozen, th) == []
    # Expert 2 moves 4x its tensor's median: named, its module leads the exploding layers.
    hot = _diff(_tensor(gate, _stats(update_ratio=(0.010, 0.012, 0.045, 0.009))))
    (f,) = detect_expert_update_outlier(hot, th)
    assert f.metrics["expert"] == 2 and f.metrics["ratio_threshold"] == OUTLIER_FACTOR
    v = decide(diff_findings(hot, th), before="a", after="b")
    assert v.exploding_layers[0] == "model.layers.3.mlp.experts"
    # Adam normalised the update, the moments show the energy: expert 2's gradient 20x (r_v 400x).
    energy = _diff(_tensor(gate, _stats(r_v=(1.0, 2.0, 400.0, 1.0))))
    (f,) = detect_expert_update_outlier(energy, th)
    assert f.metrics["expert"] == 2 and f.metrics["ratio_factor"] is None
    assert f.metrics["energy_factor"] > ENERGY_FACTOR
    # An expert's load swinging between windows (healthy gpt-oss: 15x the median, r_v 8.2): quiet.
    swing = _diff(_tensor(gate, _stats(r_v=(0.25, 8.2, 0.5, 0.59))))
    assert detect_expert_update_outlier(swing, th) == []
    # Expert 0 returns to a second moment 1e-4x its peers', moving lr per element.
    back = _diff(
        _tensor(gate, _stats(mean_v_a=(1e-10, 2e-6, 5e-7, 1e-6), step_rms=(0.95, 0.28, 0.32, 0.3)))
    )
    (f,) = detect_expert_return(back, th)
    assert f.metrics["expert"] == 0 and f.supports == ("adam_instability",)
    assert f.source == "docs/signatures.md#expert-return"
