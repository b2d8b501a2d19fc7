"""The fused diff kernel (ckptforensics/core/fused.c) and the torch ops it stands in for give
the same statistics: per chunk on random tensors with NaN, inf, huge, subnormal and zero
elements in fp32, bf16 and fp16, and per tensor through `diff_checkpoints` on a small
written pair (fast: no training, a few AdamW steps on random gradients); the replay
probe's row kernel against the probe's torch path."""

from __future__ import annotations

import dataclasses
import math
import zlib
from pathlib import Path

import pytest
import torch

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.core import fused
from ckptforensics.engine.diff.chunks import (
    Acc,
    Moments,
    Pair,
    Staging,
    moment_stats_fused,
    moment_stats_torch,
    weight_stats,
)
from ckptforensics.engine.diff.pair import DiffConfig, diff_checkpoints

KERNELS = fused.load()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="no C compiler here: the diff runs on torch ops only"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp64 sums (kernel) against fp32 sums of <= 2^17 terms (torch), whose rounding depends on
# how many threads split them: a random walk of sqrt(n) eps ~ 2e-5 relative (one thread, as
# the suite's workers run, gave 1.3e-5 on fp16 subnormals); 1e-4 is four times that.
REL = 1e-4


def _plant(x: torch.Tensor, case: str, g: torch.Generator) -> torch.Tensor:
    """A copy of `x` (fp32) with the edge case `case` planted at a few random places."""
    x = x.clone()
    idx = torch.randint(0, x.numel(), (5,), generator=g)
    big = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}
    vals = {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "subnormal": 1e-41,
        "zero": 0.0,
    }
    if case == "huge":
        x[idx] = big[torch.float32]
    elif case in vals:
        x[idx] = vals[case]
    return x


def _assert_same(acc_k: Acc, acc_t: Acc) -> None:
    """Same sums (within REL) and maxima; a count one side leaves out is 0 (as the
    report reads it: the torch path adds non-finite counts of 0 after an overflow)."""
    for k in acc_k.sums.keys() | acc_t.sums.keys():
        vk, vt = acc_k.sums.get(k, 0.0), acc_t.sums.get(k, 0.0)
        if math.isfinite(vt):
            assert vk == pytest.approx(vt, rel=REL, abs=1e-30), k
        else:
            assert str(vk) == str(vt), k
    assert acc_k.maxes == acc_t.maxes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "nan", "inf", "-inf", "huge", "subnormal", "zero"])
@pytest.mark.parametrize("where", ["a", "b"])
def test_weight_statistics_match_torch(dtype: torch.dtype, case: str, where: str) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{case}{where}".encode()))
    a = torch.randn(1 << 17, generator=g) * 0.02
    b = a + torch.randn(1 << 17, generator=g) * 1e-4
    if where == "a":
        a = _plant(a, case, g)
    else:
        b = _plant(b, case, g)
    a, b = a.to(dtype), b.to(dtype)
    stage = Staging("cpu")
    acc_k, acc_t = Acc(), Acc()
    dk = weight_stats(Pair(a, b, stage), KERNELS, acc_k)
    dt = weight_stats(Pair(a, b, stage), None, acc_t)
    _assert_same(acc_k, acc_t)
    assert dk == dt


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["plain", "nan", "inf", "huge", "zero", "violations", "ties"])
@pytest.mark.parametrize("n", [1000, 1 << 17])
def test_moment_statistics_match_torch(dtype: torch.dtype, case: str, n: int) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}{case}{n}".encode()))
    ma = torch.randn(n, generator=g) * 1e-3
    va = ma * ma * (1 + torch.rand(n, generator=g)) + 1e-14
    mb = ma * 0.9 + torch.randn(n, generator=g) * 1e-4
    vb = va * 0.95 + 0.05 * mb * mb
    if case == "ties":  # every element within a few ulps of the rho, floor and m bounds
        ulps = torch.randint(-3, 4, (n,), generator=g).float() * 2.0**-23
        vb = va * (0.95**10 * (1 - 1.4e-5)) * (1 + ulps.roll(2))
        ma = (0.9 * va.sqrt() + 0.9 * 1e-8) * (1 + ulps)
        mb = (0.9 * vb.sqrt() + 0.9 * 1e-8) * (1 + ulps.roll(1))
        mb[n // 2 :] = 1.2 * vb[n // 2 :].sqrt() * (1 + ulps[n // 2 :])
    elif case == "violations":  # v below its floor, |m| over its bound, at a few places
        vb[:7] = va[:7] * 0.1
        mb[10:13] = vb[10:13].sqrt() * 50
    elif case == "huge":  # sums past fp32's range (fp16 saturates at its own max instead)
        va, vb = _plant(va, "huge", g), _plant(vb, "huge", g)
    elif case != "plain":
        mb, vb = _plant(mb, case, g), _plant(vb, case, g)
    raw = [t.to(dtype) for t in (ma, mb, va, vb)]
    st = 4 if n >= 1 << 16 else 1
    thr, eps, floor_k, c_mb = 0.9, 1e-8, 0.95**10 * (1 - 1.4e-5), 1.2
    ms = KERNELS.moments(*raw, stride=st, thr=thr, eps=eps, floor_k=floor_k, c_mb=c_mb)
    assert ms is not None
    stage = Staging("cpu")
    acc_k, acc_t = Acc(), Acc()
    moment_stats_fused(ms, Moments(raw, stage), acc_k)
    moment_stats_torch(Moments(raw, stage), acc_t, st, thr, eps)
    _assert_same(acc_k, acc_t)
    # The bound counts are torch's predicates, element for element.
    fa, fb, va32, vb32 = (t.float() for t in raw)
    assert ms.low == int((vb32 < va32 * floor_k).sum())
    assert ms.big == int((fb.abs() > vb32.double().sqrt().float() * c_mb).sum())  # IEEE's sqrt
    if case == "violations":
        assert ms.low >= 7 and ms.big >= 3


def test_the_kernel_declines_what_it_does_not_take() -> None:
    f = torch.zeros(8)
    assert KERNELS.weights(f, f.double()) is None  # mixed dtypes
    assert KERNELS.weights(f.double(), f.double()) is None  # fp64
    assert KERNELS.weights(torch.zeros(8, 2)[:, 0], torch.zeros(8, 2)[:, 0]) is None  # strided
    assert KERNELS.weights(f[:0], f[:0]) is None  # empty
    assert KERNELS.moments(f, f, f, f, stride=3, thr=0.9, eps=1e-8, floor_k=0.5, c_mb=1.0) is None


def _pair(root: Path, dtype: torch.dtype) -> tuple[Path, Path]:
    """Two torch-format checkpoints 3 AdamW steps apart, weights in `dtype`, the second
    with a NaN weight, an inf second moment and one exponent bit flipped."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(300, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 40)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    paths = []
    for step in (2, 5):
        while opt.state == {} or int(opt.state[next(iter(opt.state))]["step"]) < step:
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        if step == 5:
            sd["0.weight"].view(-1)[123] = math.nan
            osd["state"][2]["exp_avg_sq"].view(-1)[7] = math.inf
            w = sd["2.weight"].view(-1)
            half = (
                2.0**8 if dtype == torch.float16 else 2.0**64
            )  # x 2^16 / 2^128: the exponent's top bit
            w[17] = w[17] * half * half
        paths.append(root / f"step_{step}.pt")
        torch.save({"model": sd, "optimizer": osd, "step": step}, paths[-1])
    return paths[0], paths[1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_diff_is_the_same_with_and_without_the_kernel(tmp_path: Path, dtype: torch.dtype) -> None:
    a, b = _pair(tmp_path, dtype)
    results = []
    for use in (True, False):
        cfg = DiffConfig(chunk_elems=1 << 16, fused=use)
        results.append(diff_checkpoints(open_checkpoint(a), open_checkpoint(b), cfg))
    fused_r, torch_r = results
    assert fused_r is not None and torch_r is not None
    for tk, tt in zip(fused_r.tensors, torch_r.tensors, strict=True):
        dk, dt = dataclasses.asdict(tk), dataclasses.asdict(tt)
        for k, v in dt.items():
            if isinstance(v, float) and math.isfinite(v):
                assert dk[k] == pytest.approx(v, rel=REL), (tt.name, k)
            elif isinstance(v, float):
                assert str(dk[k]) == str(v), (tt.name, k)
            else:
                assert dk[k] == v, (tt.name, k)
    flips = [c for t in fused_r.tensors for c in t.candidates if c.kind == "bit_flip"]
    assert [(c.index, c.bit_field) for c in flips] == [((0, 17), "exponent")]
    assert sum(t.nonfinite_b for t in fused_r.tensors) == 1
    assert sum(t.nonfinite_v_b for t in fused_r.tensors) == 1


def test_staging_hands_out_copies_that_survive_the_next_chunk() -> None:
    """The device path's staging (`--device cuda` reads each chunk on the host into one
    buffer per stream; no GPU here, so its CPU form): a chunk handed out stays intact
    when the buffer is refilled with the next one."""
    stage = Staging("cpu", always=True)
    first = stage(torch.arange(8.0), 0)
    second = stage(torch.arange(8.0, 12.0), 0)
    assert first.tolist() == list(range(8)) and second.tolist() == [8.0, 9.0, 10.0, 11.0]
    assert stage(torch.ones(3, dtype=torch.bfloat16), 0).dtype == torch.bfloat16


def test_without_a_usable_compiler_the_diff_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CKPTFORENSICS_FUSED", "0")
    assert fused._build() is None
    monkeypatch.delenv("CKPTFORENSICS_FUSED")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert fused._build() is None


def test_a_shared_cache_is_not_used(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A cache directory others can write to is refused (a library loaded from it would
    run their code): the kernels are built per process, and the build is removed."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("CKPTFORENSICS_CACHE", str(shared))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    assert fused._build() is not None
    assert list(shared.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]


@pytest.mark.parametrize("backward", [False, True])
def test_probe_row_is_the_probes_torch_row_with_nan_inf_and_overflow(backward: bool) -> None:
    """`Kernels.probe_row` (the replay probe's rows, one C pass) gives the row the probe's
    torch path derives (`_norms` then `_derive`): a NaN makes max |x| NaN and the row
    non-finite, an inf is non-finite with a finite-or-inf norm, values past fp16's and
    bf16's largest set those flags."""
    from ckptforensics.engine.replay.proberows import _derive, _norms

    kernels = fused.load()
    if kernels is None:
        pytest.skip("no C compiler")
    torch.manual_seed(0)
    cases = [torch.randn(8, 32, 64) for _ in range(5)]
    cases[1][3, 4, 5] = float("nan")
    cases[2][0, 0, 0] = float("-inf")
    cases[3][1, 1, 1] = 70000.0  # past fp16's max
    cases[4][2, 2, 2] = 3.395e38  # past bf16's max, finite in fp32
    width = 3 if backward else 6
    table = torch.full((len(cases), width), -1.0)
    for k, x in enumerate(cases):
        assert kernels.probe_row(x, k, table)
        n, l2, lo, hi, _ = _norms(x, subnormal=False)
        want = _derive(l2[None], lo[None].float(), hi[None].float(), [n], None, backward)[0]
        torch.testing.assert_close(table[k], want, rtol=1e-6, atol=0.0, equal_nan=True)
    if not backward:  # the kernel's limits are fp16's and bf16's largest, exactly
        for top, over in (
            (torch.finfo(torch.float16).max, [0.0, 0.0]),
            (65505.0, [1.0, 0.0]),
            (torch.finfo(torch.bfloat16).max, [1.0, 0.0]),
            (
                float(
                    torch.nextafter(
                        torch.tensor(torch.finfo(torch.bfloat16).max), torch.tensor(math.inf)
                    )
                ),
                [1.0, 1.0],
            ),
        ):
            x = torch.tensor([1.0, -top])
            assert kernels.probe_row(x, 0, table)
            assert table[0, 3:5].tolist() == over, top


@pytest.mark.parametrize("v", [1, 7, 64, 5000])
def test_logit_figures_are_torchs_with_nan_inf_and_large_rows(v: int) -> None:
    """The replay's logit figures (max |logit|, summed log Z, rows) from one kernel call
    equal torch's aminmax / logsumexp on rows of random, huge and tied logits; a row of
    -inf, one holding +inf and one holding a NaN take torch's values (and NaN throughout
    where torch gives NaN)."""
    g = torch.Generator().manual_seed(v)
    x = torch.randn(6, 5, v, generator=g) * 4
    x[0, 1] = 3.0  # tied
    x[0, 2] *= 1e6  # huge: exp of all but the max underflows
    for case in ("finite", "-inf row", "+inf", "nan"):
        y = x.clone()
        if case == "-inf row":
            y[1, 0] = float("-inf")
        elif case == "+inf":
            y[2, 3, v // 2] = float("inf")
        elif case == "nan":
            y[3, 4, v - 1] = float("nan")
        got = KERNELS.logit_figures(y)
        assert got is not None
        lo, hi = torch.aminmax(y)
        lse = torch.logsumexp(y, -1).double()
        top = float(torch.maximum(-lo, hi))
        assert (math.isnan(got[0]) and math.isnan(top)) or got[0] == top, case
        assert got[2] == y.numel() // v
        if case == "finite":
            assert got[1] == pytest.approx(float(lse.sum()), rel=1e-6), case
        else:
            ref = float(lse.sum())
            assert (math.isnan(got[1]) and math.isnan(ref)) or got[1] == ref, case
    assert KERNELS.logit_figures(x.half()) is None
    assert KERNELS.logit_figures(x.transpose(0, 2)) is None
