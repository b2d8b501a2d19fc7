"""Each family's update bound and second-moment floor (its module, ckptforensics/optim/<family>.py,
found through the registry) against the framework's own optimizer step, fed gradients from tiny
to huge: no element may pass."""

from __future__ import annotations

import math

import pytest
import torch

from ckptforensics.formats.optstate import group_hyper, optimizer_family
from ckptforensics.optim import bnb, second_moment_floor, step_bound
from ckptforensics.optim.muon import ns_sup
from ckptforensics.optim.updates import quantised_floor_allowance


def _grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        scale = 10.0 ** float(
            torch.randint(-6, 7, (1,), generator=g)
        )  # 1e-6 .. 1e6: bursts included
        out.append(torch.randn(shape, generator=g) * scale)
    return out


def _make(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    if name == "lion":
        lion = pytest.importorskip("lion_pytorch")
        return lion.Lion([p], lr=1e-3, weight_decay=0.1)
    if name == "muon":
        return torch.optim.Muon([p], lr=1e-2, weight_decay=0.1)
    if name == "adafactor":
        return torch.optim.Adafactor([p], lr=1e-2, weight_decay=0.1)
    if name == "lamb":
        pyopt = pytest.importorskip(
            "pytorch_optimizer", reason="LAMB's bound needs pytorch_optimizer"
        )
        return pyopt.Lamb([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    transformers = pytest.importorskip("transformers")
    return transformers.optimization.Adafactor(
        [p], lr=1e-2, scale_parameter=False, relative_step=False, weight_decay=0.1
    )


@pytest.mark.parametrize("name", ["adamw", "lion", "muon", "adafactor", "adafactor_hf", "lamb"])
@pytest.mark.parametrize("shape", [(24, 40), (64, 8)])
def test_no_step_passes_its_family_bound(name: str, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape) * 0.05)
    opt = _make(name, p)
    for t, g in enumerate(_grads(shape, 12, seed=len(name) + shape[0]), 1):
        before = p.detach().clone()
        moments = {
            k: v.clone()
            for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
        p.grad = g
        opt.step()
        st = opt.state_dict()
        fam, impl = optimizer_family(set(st["state"][0]), st["param_groups"][0])
        h = group_hyper(st["param_groups"][0], 0, (fam, impl))
        rms_w = max(float(before.pow(2).mean().sqrt()), float(p.detach().pow(2).mean().sqrt()))
        b = step_bound(
            fam,
            lr=h.lr,
            weight_decay=h.weight_decay,
            betas=h.betas,
            options=h.options,
            t_first=t,
            t_last=t,
            shape=shape,
            rms_w=rms_w,
        )
        dw = (p.detach() - before).abs()
        w = torch.maximum(before.abs(), p.detach().abs())
        assert bool((dw <= (b.per_step + b.decay * w) * (1 + 1e-3) + 1e-7 * w).all()), (
            name,
            t,
            float((dw / (b.per_step + b.decay * w)).max()),
        )
        if b.rms is not None:
            assert float(dw.pow(2).mean().sqrt()) <= (b.rms + b.decay * rms_w) * (1 + 1e-3)
        floor = second_moment_floor(fam, h.betas, h.options, t, t)
        for k, v in moments.items():
            if floor is not None and k in (
                "exp_avg_sq",
                "row_var",
                "col_var",
                "variance",
                "exp_avg_sq_row",
                "exp_avg_sq_col",
            ):
                now = opt.state[p][k]
                assert bool((now >= v * floor * (1 - 1e-6)).all()), (name, k, t)


def test_lion_bound_is_exact() -> None:
    """Lion moves every element by exactly lr (no weight decay): the bound is sharp."""
    lion = pytest.importorskip("lion_pytorch")
    p = torch.nn.Parameter(torch.randn(16, 16))
    opt = lion.Lion([p], lr=1e-3)
    p.grad = torch.randn(16, 16)
    before = p.detach().clone()
    opt.step()
    assert torch.allclose((p.detach() - before).abs(), torch.full((16, 16), 1e-3), rtol=1e-4)


def test_newton_schulz_sup() -> None:
    """Torch's default quintic (Keller Jordan's coefficients) over five steps peaks at 1.2024."""
    assert ns_sup((3.4445, -4.7750, 2.0315), 5) == pytest.approx(1.2024, abs=1e-4)


def test_adafactor_floor_is_the_product() -> None:
    c = -0.8
    want = math.prod(1 - t**c for t in range(11, 21))
    assert second_moment_floor("adafactor", None, {"beta2_decay": c}, 11, 20) == pytest.approx(want)
    assert second_moment_floor("adam", (0.9, 0.95), {}, 11, 20) == pytest.approx(0.95**10)
    assert second_moment_floor("lion", (0.9, 0.99), {}, 11, 20) is None


@pytest.mark.parametrize("shape", [(24, 40), (8, 100)])
def test_8bit_floor_holds_through_quantisation(shape: tuple[int, int]) -> None:
    """bitsandbytes' 8-bit Adam on CPU, gradients 1e-6..1e6: over every window t0 -> t1 the
    dequantised second moment keeps b2^k v_t0 minus k code gaps of its block's absmax at t1
    (`quantised_floor_allowance`), and the floor without that allowance is broken (the
    rounding is real, so the allowance is needed)."""
    bnb_ = pytest.importorskip("bitsandbytes", reason="8-bit Adam's floor needs bitsandbytes")
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape) * 0.05)
    opt = bnb_.optim.AdamW8bit([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, min_8bit_size=16)
    vs, scales = [], []
    for g in _grads(shape, 14, seed=shape[0]):
        p.grad = g
        opt.step()
        st = bnb.unwrap(opt.state_dict()["state"][0])
        assert bnb.is_quantised(st)
        vs.append(bnb.with_moments(st)["exp_avg_sq"].reshape(-1).double())
        scales.append(bnb.per_element(st["absmax2"], p.numel()).double())
    gap = bnb.code_gap(st["qmap2"])
    plain_broken = False
    for t0 in range(len(vs)):
        for t1 in range(t0 + 1, len(vs)):
            k = t1 - t0
            floor = vs[t0] * 0.95**k * (1 - 1e-6 * (k + 4))
            assert bool((vs[t1] >= floor - quantised_floor_allowance(k, gap) * scales[t1]).all()), (
                t0,
                t1,
            )
            plain_broken |= bool((vs[t1] < floor).any())
    assert plain_broken


def test_8bit_steps_can_pass_adams_bound() -> None:
    """Why 8-bit Adam's quantised tensors get no per-element bound: its EMAs are updated from
    rounded state, so m / sqrt(v) escapes Cauchy-Schwarz, and a real bitsandbytes step under
    gradient bursts moves an element past lr C by more than the diff's slack (1.3% here)."""
    bnb_ = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes")
    from ckptforensics.core.tensors import adam_ratio_bound

    torch.manual_seed(5)
    p = torch.nn.Parameter(torch.randn(24, 40) * 0.05)
    opt = bnb_.optim.AdamW8bit([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, min_8bit_size=16)
    worst = 0.0
    for t, g in enumerate(_grads((24, 40), 14, seed=5), 1):
        before = p.detach().clone()
        p.grad = g
        opt.step()
        worst = max(
            worst,
            float(((p.detach() - before).abs() / (1e-2 * adam_ratio_bound(0.9, 0.95, t, t))).max()),
        )
    assert worst > 1 + 1e-3
    b = step_bound(
        "adam8bit",
        lr=1e-2,
        weight_decay=0.0,
        betas=(0.9, 0.95),
        options={"quantised": True},
        t_first=1,
        t_last=14,
        shape=(24, 40),
    )
    assert not b.sharp and math.isinf(b.per_step)
