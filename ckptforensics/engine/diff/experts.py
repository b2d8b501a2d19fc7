"""Per-expert statistics of a fused Mixture-of-Experts tensor: one slice per expert along its
leading dim ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, gpt-oss's [E, 2I] biases), each
reduced over every other dim while the diff streams the tensor in flat chunks.

transformers 5 keeps a layer's experts in one parameter per projection, so the
tensor's own statistics average one dead or exploding expert away. Per expert: the update/weight
ratio, the step's RMS in units of the LR (1: sign-like), the second moment's level and the
gradient energy it implies (`r_v`), and how many elements of each moment left the decay a window
without gradient leaves exactly (v_B = beta2^k v_A, m_B = beta1^k m_A up to rounding).

Checkpoints that write one tensor per expert (DeepSpeed-MoE's `...deepspeed_experts.{E}.fc1.weight`,
Megatron's SequentialMLP `...local_experts.{E}.linear_fc1.weight`, Mixtral-style
`...experts.{E}.w1.weight`) are diffed tensor by tensor; `split_groups` stacks the records of one
module's parameter across its experts into the same `ExpertStats` (`SplitExperts`), so the
per-expert rules read both layouts alike.

Pure: the accumulator folds the chunks `diff_tensor` has already staged; it reads no file and
adds O(E) memory and a few chunk-sized temporaries, one at a time.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ckptforensics.engine.diff.chunks import Moments, Pair
from ckptforensics.engine.diff.records import ExpertStats, TensorDiff

__all__ = [
    "ExpertAcc",
    "SplitExperts",
    "expert_dim",
    "expert_slices",
    "expert_sums",
    "split_groups",
    "split_key",
]

# One tensor per expert: `<module>.<container>.<E>.<param>`, the container `experts` or
# `<word>_experts` (`local_experts`, and DeepSpeed-MoE's); greedy: the last container wins.
SPLIT = re.compile(r"(.*\.(?:\w+_)?experts)\.(\d+)\.(.+)")

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


def split_key(name: str) -> tuple[str, int, str] | None:
    """(module, expert id, parameter) of a tensor written one per expert
    (`h.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts.2.fc1.weight` ->
    (`h.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts`, 2, `fc1.weight`)); None otherwise
    (a fused `...experts.gate_up_proj`, a router, a dense MLP)."""
    m = SPLIT.fullmatch(name)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def expert_slices(name: str, shape: tuple[int, ...], n_experts: int | None) -> int | None:
    """How many expert slices `ExpertAcc` reads a tensor as: E for a fused expert tensor
    (`expert_dim`), 1 for one expert's own tensor (`split_key`), None otherwise. A diff that
    runs the accumulator on both gives `split_groups` the exact moment statistics to stack."""
    if split_key(name) is not None:
        return 1
    return expert_dim(name, shape, n_experts)


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


@dataclass(frozen=True, slots=True)
class SplitExperts:
    """One module's parameter written one tensor per expert, its records stacked.

    Attributes:
        module: the experts' container (`...deepspeed_experts`, `...local_experts`, `...experts`).
        param: the parameter under each expert (`fc1.weight`, `linear_fc1.weight`, `w1.weight`).
        ids: the experts' ids as named, ascending; position e of `record.experts` is `ids[e]`.
        tensors: each expert's own record, in the same order.
        record: a record named `<module>.*.<param>` whose `experts` holds the group's
            statistics per expert (the other fields summarise the members).
    """

    module: str
    param: str
    ids: tuple[int, ...]
    tensors: tuple[TensorDiff, ...]
    record: TensorDiff

    @property
    def members(self) -> tuple[str, ...]:
        """Each expert's tensor name, in the order of `ids`."""
        return tuple(t.name for t in self.tensors)

    def expert(self, e: int) -> str:
        """The name of the expert at position `e` (`...deepspeed_experts.2`)."""
        return f"{self.module}.{self.ids[e]}"


def split_groups(tensors: Iterable[TensorDiff]) -> list[SplitExperts]:
    """The diff's one-tensor-per-expert records grouped per module and parameter: names that
    differ only in the expert id (`split_key`), two experts or more, every shape equal."""
    groups: dict[tuple[str, str], list[tuple[int, TensorDiff]]] = defaultdict(list)
    for t in tensors:
        key = split_key(t.name)
        if key is not None:
            groups[(key[0], key[2])].append((key[1], t))
    out = []
    for (module, param), members in groups.items():
        members.sort(key=lambda x: x[0])
        ids = tuple(e for e, _ in members)
        ts = [t for _, t in members]
        if len(ts) < 2 or len(set(ids)) < len(ids) or len({t.shape for t in ts}) > 1:
            continue
        out.append(SplitExperts(module, param, ids, tuple(ts), _group_record(module, param, ts)))
    return out


def _stack(ts: list[TensorDiff]) -> ExpertStats:
    """The members' statistics as one `ExpertStats`: their own single-expert accumulators
    where the diff ran them (`expert_slices`), else what each record holds (weights, r_v)."""
    own = [t.experts for t in ts]
    if all(s is not None and s.experts == 1 for s in own):
        st = [s for s in own if s is not None]
        moments = all(s.has_moments for s in st)
        return ExpertStats(
            experts=len(st),
            numel=st[0].numel,
            w_norm_a=tuple(s.w_norm_a[0] for s in st),
            dw_norm=tuple(s.dw_norm[0] for s in st),
            update_ratio=tuple(s.update_ratio[0] for s in st),
            step_rms=tuple(s.step_rms[0] for s in st),
            mean_v_a=tuple(s.mean_v_a[0] for s in st) if moments else (),
            mean_v_b=tuple(s.mean_v_b[0] for s in st) if moments else (),
            r_v=tuple(s.r_v[0] for s in st) if moments else (),
            decayed=tuple(s.decayed[0] for s in st) if moments else (),
        )
    per = max(ts[0].numel, 1)

    def step_rms(t: TensorDiff) -> float:
        # RMS(dw) per step in LR units, as `ExpertAcc.result` (the record's own step count).
        if not (math.isfinite(t.lr) and t.lr > 0):
            return math.nan
        if t.w_norm_a > 0 and math.isfinite(t.update_ratio):
            per_step = t.update_ratio * t.w_norm_a
        else:
            per_step = t.dw_norm / max(t.k, 1)
        return per_step / math.sqrt(per) / t.lr

    # The mean second moments and the exact decay test need the moments themselves: left out
    # (the rules that read them skip the group), r_v is the record's own.
    return ExpertStats(
        experts=len(ts),
        numel=ts[0].numel,
        w_norm_a=tuple(t.w_norm_a for t in ts),
        dw_norm=tuple(t.dw_norm for t in ts),
        update_ratio=tuple(t.update_ratio for t in ts),
        step_rms=tuple(step_rms(t) for t in ts),
        r_v=tuple(t.r_v for t in ts) if all(t.has_moments for t in ts) else (),
    )


def _group_record(module: str, param: str, ts: list[TensorDiff]) -> TensorDiff:
    w = math.sqrt(sum(t.w_norm_a**2 for t in ts))
    d = math.sqrt(sum(t.dw_norm**2 for t in ts))
    k = max(t.k for t in ts)
    ratios = [t.update_ratio * t.w_norm_a for t in ts if math.isfinite(t.update_ratio)]
    return TensorDiff(
        name=f"{module}.*.{param}",
        role=ts[0].role,
        shape=(len(ts), *ts[0].shape),
        dtype=ts[0].dtype,
        numel=sum(t.numel for t in ts),
        w_norm_a=w,
        dw_norm=d,
        dw_max_abs=max(t.dw_max_abs for t in ts),
        update_ratio=math.sqrt(sum(x * x for x in ratios)) / w if w > 0 and ratios else math.nan,
        max_abs_b=max(t.max_abs_b for t in ts),
        headroom_b=min(t.headroom_b for t in ts),
        nonfinite_a=sum(t.nonfinite_a for t in ts),
        nonfinite_b=sum(t.nonfinite_b for t in ts),
        has_moments=all(t.has_moments for t in ts),
        k=k,
        lr=max((t.lr for t in ts if math.isfinite(t.lr)), default=math.nan),
        family=ts[0].family,
        experts=_stack(ts),
    )
