"""Per-expert statistics of a fused Mixture-of-Experts tensor: one slice per expert along its
leading dim ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, gpt-oss's [E, 2I] biases), each
reduced over every other dim while the diff streams the tensor in flat chunks.

transformers 5 keeps a layer's experts in one parameter per projection, so the
tensor's own statistics average one dead or exploding expert away. Per expert: the update/weight
ratio, the step's RMS in units of the LR (1: sign-like), the second moment's level and the
gradient energy it implies (`r_v`), and how many elements of each moment left the decay a window
without gradient leaves exactly (v_B = beta2^k v_A, m_B = beta1^k m_A up to rounding).

Pure: the accumulator folds the chunks `diff_tensor` has already staged; it reads no file and
adds O(E) memory plus one chunk-sized index per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from ckptforensics.engine.diff.chunks import Moments, Pair, sqrt32
from ckptforensics.engine.diff.records import ExpertStats

__all__ = ["ExpertAcc", "expert_dim", "expert_sums"]

# The sums kept per expert (fp64): weights, then moments (absent from a weights-only pair).
_W = ("wa2", "d2")
_M = ("sum_va", "sum_vb", "v_dep", "m_dep", "rho_b", "v_pos")
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


def expert_sums(lo: int, per: int, n: int, rows: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sums of each of `rows` (equal-length chunks [L] of flat tensors, starting at element
    `lo`) per expert, each expert holding `per` consecutive elements; returns fp64
    [len(rows), n] on the rows' device. Rows are taken one at a time (a generator keeps
    one alive) and widened to fp64 one at a time: the peak stays near three chunks."""
    sums: list[torch.Tensor] = []
    ids: torch.Tensor | None = None
    e0 = lo // per
    for r in rows:
        if ids is None:  # [L] each element's expert, from the chunk's first
            ids = torch.div(torch.arange(lo, lo + r.numel(), device=r.device), per,
                            rounding_mode="floor") - e0  # fmt: skip
        out = torch.zeros(n, dtype=torch.float64, device=r.device)
        if r.numel():
            seg = int(ids[-1]) + 1
            out[e0 : e0 + seg].index_add_(0, ids, r.to(torch.float64))
        sums.append(out)
    return torch.stack(sums)


class ExpertAcc:
    """Running per-expert sums of one fused expert tensor across the diff's chunks."""

    def __init__(
        self,
        n: int,
        numel: int,
        *,
        k: int = 0,
        betas: tuple[float, float] | None = None,
        eps: float = 0.0,
        thr: float = 0.9,
        store_eps: float = 0.0,
    ) -> None:
        self.n, self.per = n, numel // n
        self.k, self.betas, self.eps, self.thr = k, betas, eps, thr
        self.tol = _ROUND_PER_STEP * (k + 4) + (k + 1) * store_eps
        self.w = torch.zeros(len(_W), n, dtype=torch.float64)
        self.m = torch.zeros(len(_M), n, dtype=torch.float64)
        self.moments = False

    def add(self, lo: int, w: Pair, mo: Moments | None) -> None:
        """Fold one chunk (its weights and, where the pair has them, its moments)."""
        fa, d = w.fa, w.d
        self.w += expert_sums(lo, self.per, self.n, (x * x for x in (fa, d))).cpu()
        if mo is None or self.betas is None or self.k <= 0:
            return
        self.moments = True
        b1k, b2k = self.betas[0] ** self.k, self.betas[1] ** self.k
        ma, mb, va, vb = mo.ma, mo.mb, mo.va, mo.vb
        floor = _TINY * (self.k + 4)
        tol, thr, eps = self.tol, self.thr, self.eps

        def rows() -> Iterator[torch.Tensor]:
            yield va
            yield vb
            # Departed: not within rounding of the decay no gradient leaves (a non-finite
            # moment departs too).
            v_dec = va * b2k  # [L]
            yield (~((vb - v_dec).abs() <= v_dec * tol + floor)).float()
            del v_dec
            m_dec = ma * b1k
            yield (~((mb - m_dec).abs() <= m_dec.abs() * tol + floor)).float()
            del m_dec
            yield (mb.abs() > thr * (sqrt32(vb) + eps)).float()
            yield (va > 0).float()

        self.m += expert_sums(lo, self.per, self.n, rows()).cpu()

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
            sva, svb, vdep, mdep, rho, vpos = self.m.tolist()
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
                v_departed=tuple(int(x) for x in vdep),
                m_departed=tuple(int(x) for x in mdep),
                v_positive=tuple(int(x) for x in vpos),
                rho_share_b=tuple(x / per for x in rho),
            )
        return ExpertStats(**out)  # type: ignore[arg-type]
