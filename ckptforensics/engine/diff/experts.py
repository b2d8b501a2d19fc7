"""Per-expert statistics of a fused Mixture-of-Experts tensor: one slice per expert along its
leading dim ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, gpt-oss's [E, 2I] biases), each
reduced over every other dim while the diff streams the tensor in flat chunks.

transformers 5 keeps a layer's experts in one parameter per projection, so the
tensor's own statistics average one dead or exploding expert away. Per expert: the update/weight
ratio, the step's RMS in units of the LR (1: sign-like), the second moment's level and the
gradient energy it implies (`r_v`), and how many elements of each moment left the decay a window
without gradient leaves exactly (v_B = beta2^k v_A, m_B = beta1^k m_A up to rounding).

Pure: the accumulator folds the chunks `diff_tensor` has already staged; it reads no file and
adds O(E) memory and a few chunk-sized temporaries, one at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from ckptforensics.engine.diff.chunks import Moments, Pair
from ckptforensics.engine.diff.records import ExpertStats

__all__ = ["ExpertAcc", "expert_dim", "expert_sums"]

# Relative rounding a no-gradient step leaves on a moment: beta * x rounded once per step
# (torch's `lerp_`/`mul_`: one or two roundings of fp32), 1e-6 (~8 ulps) per step plus 4, as the
# diff's second-moment floor allows (`diff_tensor`'s floor_k).
_ROUND_PER_STEP = 1e-6
_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32: underflow below it


def expert_dim(name: str, shape: tuple[int, ...], n_experts: int | None) -> int | None:
    """E when `name` is a fused expert tensor whose leading dim holds the model's `n_experts`
    experts (`...experts.gate_up_proj`, `...experts.down_proj_bias`); None otherwise (a
    per-expert tensor `experts.3.w1.weight`, a router, a dense MLP)."""
    if not n_experts or n_experts < 2 or len(shape) < 2 or shape[0] != n_experts:
        return None
    parts = name.split(".")
    if "experts" not in parts[:-1]:
        return None
    after = parts[parts.index("experts") + 1]
    return None if after.isdigit() else n_experts  # `experts.3.w1`: one tensor per expert


def expert_sums(
    lo: int, per: int, n: int, rows: Iterable[torch.Tensor], *, square: bool = False
) -> torch.Tensor:
    """Sums (of squares with `square`) of each of `rows` (equal-length chunks [L] of flat
    tensors, starting at element `lo`) per expert, each expert holding `per` consecutive
    elements; returns fp64 [len(rows), n] on the rows' device.

    A chunk is a contiguous range: the end of one expert (head), whole experts (viewed
    [m, per] and reduced over dim 1), the start of another (tail): at most three reductions
    a row, no index per element. Rows are taken one at a time (a generator keeps one alive)."""

    def red(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
        if square:
            return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64).square()
        return x.sum(dim=dim, dtype=torch.float64)

    sums: list[torch.Tensor] = []
    for r in rows:
        out = torch.zeros(n, dtype=torch.float64, device=r.device)
        hi = lo + r.numel()
        head = min(hi, -(-lo // per) * per)  # the first expert boundary at or after lo
        if head > lo:
            out[lo // per] += red(r[: head - lo])
        whole = (hi - head) // per
        if whole > 0:
            e = head // per
            out[e : e + whole] += red(r[head - lo : head - lo + whole * per].view(whole, per), 1)
        tail = head + whole * per
        if hi > tail:
            out[tail // per] += red(r[tail - lo :])
        sums.append(out)
    return torch.stack(sums)


class ExpertAcc:
    """Running per-expert sums of one fused expert tensor across the diff's chunks.

    The dead test is exact and elementwise, but run only where it can pass: a chunk's
    per-expert sums of v already show the gradient of every expert that had one
    (sum v_B - beta2^k sum v_A past the rounding of the sum), so the elementwise test
    runs only on a chunk holding an expert whose sums stayed within it."""

    def __init__(
        self,
        n: int,
        numel: int,
        *,
        k: int = 0,
        betas: tuple[float, float] | None = None,
        store_eps: float = 0.0,
    ) -> None:
        self.n, self.per = n, numel // n
        self.k, self.betas = k, betas
        self.tol = _ROUND_PER_STEP * (k + 4) + (k + 1) * store_eps
        self.w = torch.zeros(2, n, dtype=torch.float64)  # ||w_A||^2, ||dw||^2
        self.v = torch.zeros(2, n, dtype=torch.float64)  # sum v_A, sum v_B
        self.decayed = [True] * n
        self.moments = False

    def add(self, lo: int, w: Pair, mo: Moments | None) -> None:
        """Fold one chunk (its weights and, where the pair has them, its moments)."""
        self.w += expert_sums(lo, self.per, self.n, (w.fa, w.d), square=True).cpu()
        if mo is None or self.betas is None or self.k <= 0:
            return
        self.moments = True
        b1k, b2k = self.betas[0] ** self.k, self.betas[1] ** self.k
        ma, mb, va, vb = mo.ma, mo.mb, mo.va, mo.vb
        sv = expert_sums(lo, self.per, self.n, (va, vb)).cpu()  # [2, E]
        self.v += sv
        hi = lo + va.numel()
        floor = _TINY * (self.k + 4)
        here = range(lo // self.per, (hi - 1) // self.per + 1)
        # The elementwise allowance summed, plus one rounding of beta2^k v_A per element.
        excess = sv[1] - b2k * sv[0]
        allow = (self.tol + 1e-6) * b2k * sv[0] + floor * va.numel()
        maybe = []
        for e in here:
            if self.decayed[e] and not bool(excess[e] <= allow[e]):  # NaN: departed
                self.decayed[e] = False
            elif self.decayed[e]:
                maybe.append(e)
        if not maybe:
            return

        def departed() -> Iterator[torch.Tensor]:
            # Not within rounding of the decay no gradient leaves (non-finite departs too).
            v_dec = va * b2k  # [L]
            yield (~((vb - v_dec).abs() <= v_dec * self.tol + floor)).float()
            del v_dec
            m_dec = ma * b1k
            yield (~((mb - m_dec).abs() <= m_dec.abs() * self.tol + floor)).float()

        dep = expert_sums(lo, self.per, self.n, departed()).cpu()
        for e in maybe:
            if float(dep[0, e]) > 0 or float(dep[1, e]) > 0:
                self.decayed[e] = False

    def result(self, *, steps: int, lr: float, step_a: int) -> ExpertStats:
        """The statistics once every chunk is in; `steps` the window's update count, `lr` its
        largest LR, `step_a` Adam's counter at *before* (bias correction of v_A)."""
        wa2, d2 = self.w.tolist()
        per = max(self.per, 1)
        w_norm = [math.sqrt(x) for x in wa2]
        dw = [math.sqrt(x) for x in d2]
        k = max(steps, 1)
        out = dict(
            experts=self.n,
            numel=self.per,
            w_norm_a=tuple(w_norm),
            dw_norm=tuple(dw),
            update_ratio=tuple(
                d / w / k if w > 0 else math.nan for d, w in zip(dw, w_norm, strict=True)
            ),
            step_rms=tuple(
                d / math.sqrt(per) / (k * lr) if math.isfinite(lr) and lr > 0 else math.nan
                for d in dw
            ),
        )
        if self.moments and self.betas is not None:
            sva, svb = self.v.tolist()
            b2 = self.betas[1]
            b2k = b2**self.k
            corr = 1 - b2**step_a if step_a > 0 else 0.0
            r_v = []
            for a, b in zip(sva, svb, strict=True):
                den = (1 - b2k) * a / corr if corr > 0 else math.inf
                r_v.append((b - b2k * a) / den if den > 0 else (math.inf if b > 0 else 0.0))
            out.update(
                mean_v_a=tuple(x / per for x in sva),
                mean_v_b=tuple(x / per for x in svb),
                r_v=tuple(r_v),
                decayed=tuple(self.decayed),
            )
        return ExpertStats(**out)  # type: ignore[arg-type]
