"""A replayed step's gradient evidence, gathered over the ranks in one collective, then
clipping by torch's rule.

Every rank (one process is a world of one, `distributed.OneProcess`) packs what it measured
into one flat row (`Layout`): its share of the loss and its logit figures, its rows'
per-sample figures, and per parameter the sums of its shard of the gradient
(`probes.param_grad_sums`). One gather brings every rank's row to every rank, and one host
read; the whole step's figures follow from the ranks' rows (`Gathered.evidence`), the total
norm among them, which clips the gradients as `torch.nn.utils.clip_grad_norm_` does.
One process on CPU hands its figures over as they are (`Gathered.one`): the same numbers.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptforensics.engine.replay.distributed import World
from ckptforensics.engine.replay.records import GradEvidence

__all__ = ["HEAD", "ROW", "PARAM", "Layout", "Gathered", "gather", "grad_norm", "clip_grads"]

# One figure each per rank: its share of the step's loss, its largest |logit|, the mean and
# count of its logits' log Z, its rows, whether it has per-sample gradient norms, and the
# norm of its shards of the gradients (`grad_norm`).
HEAD = ("loss", "logit_absmax", "log_z", "logit_rows", "rows", "has_grad_sq", "norm")
# One figure per row of the rank's block (padded to the largest block): its mean token
# loss, its squared gradient norm (`samples.PerSampleGrad`), its target tokens.
ROW = ("loss", "grad_sq", "tokens")
# One figure per parameter with a gradient: `probes.param_grad_sums` of the rank's shard,
# and whether that shard is finite.
PARAM = ("sum_g2", "sum_g2_over_v", "spikes", "finite")


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a rank's figures sit in its packed row: HEAD, then ROW figure by figure
    (`pad` slots each), then PARAM parameter by parameter (`params` of them)."""

    pad: int
    params: int

    def pack(
        self,
        head: dict[str, torch.Tensor | float],
        rows: dict[str, torch.Tensor],
        params: torch.Tensor,
    ) -> torch.Tensor:
        """One rank's row (float64, on its device): `head` (tensors or numbers) and `rows`
        by name (HEAD, ROW), `params` [params, len(PARAM)]."""
        dev = params.device
        top = _head_row([head[k] for k in HEAD], dev)
        got = [rows[k].detach() for k in ROW]
        if all(r.shape[0] == self.pad for r in got):  # no padding (one process): one op
            block = torch.cat(got).to(dev, torch.float64)
        else:
            block = torch.zeros(len(ROW), self.pad, dtype=torch.float64, device=dev)
            for i, r in enumerate(got):
                block[i, : r.shape[0]] = r.to(torch.float64)
        return torch.cat([top, block.reshape(-1), params.to(torch.float64).reshape(-1)])

    def unpack(self, every: torch.Tensor) -> Gathered:
        """Every rank's row [world, width] (on the host) read back by name."""
        h, r, p = len(HEAD), len(ROW), len(PARAM)
        cut = h + r * self.pad
        ranks = every.tolist()
        return Gathered(
            head=[x[:h] for x in ranks],
            rows=[[x[h + i * self.pad : h + (i + 1) * self.pad] for i in range(r)] for x in ranks],
            params=[
                [x[cut + k * p : cut + (k + 1) * p] for k in range(self.params)] for x in ranks
            ],
        )


def _head_row(head: list[torch.Tensor | float], dev: torch.device) -> torch.Tensor:
    """The HEAD figures as one float64 row on `dev`. On CPU, from the figures read as
    Python numbers (an fp32 or integer scalar is exact in float64): one tensor made instead
    of three small ops a figure; elsewhere on the device, with no host read."""
    if dev.type == "cpu" and all(
        not isinstance(x, torch.Tensor) or x.device.type == "cpu" for x in head
    ):
        return torch.tensor(_numbers(head), dtype=torch.float64)
    return torch.stack(
        [torch.as_tensor(x).detach().to(dev, torch.float64).reshape(()) for x in head]
    )


def _numbers(xs: list[torch.Tensor | float]) -> list[float]:
    """Scalars (tensors on the host, or numbers) as Python floats: an fp32 or integer
    scalar is exact in float64."""
    return [float(x.detach()) if isinstance(x, torch.Tensor) else float(x) for x in xs]


@dataclass(frozen=True, slots=True)
class Gathered:
    """Every rank's packed figures (`Layout`), rank order, as Python numbers (the float64
    values): the evidence is a few figures per parameter and row, and between a replayed
    step's other work each numpy or torch op on them costs tens of microseconds, a Python
    operation a fraction of one."""

    head: list[list[float]]  # [world][len(HEAD)]
    rows: list[list[list[float]]]  # [world][len(ROW)][pad]
    params: list[list[list[float]]]  # [world][params][len(PARAM)]

    @classmethod
    def one(
        cls,
        head: dict[str, torch.Tensor | float],
        rows: dict[str, torch.Tensor],
        params: list[list[float]],
    ) -> Gathered:
        """One process's figures, as `Layout.pack` and `gather` would hand them back (the
        same float64 values), without the packing (`head`, `rows` by name as `Layout.pack`
        takes them, `params` [P][len(PARAM)])."""
        top = _numbers([head[k] for k in HEAD])
        return cls(head=[top], rows=[[rows[k].detach().tolist() for k in ROW]], params=[params])

    def evidence(
        self, names: Sequence[str], numel: Sequence[int], ckpt: Sequence[str]
    ) -> GradEvidence:
        """The step's evidence (`names`: the parameters' model names, `numel`: their sizes,
        `ckpt`: their checkpoint names, looked up once per session rather than per step).

        RMS and RMS_t are computed in float32 from the summed sums, as
        `probes.param_grad_stats` computes them for a whole gradient: each quotient and
        root taken in float64 and rounded to float32 once (`_f32`), which is the float32
        operation's result (float64 has more than twice float32's digits, and two)."""
        head, w = self.head, len(self.head)
        if w == 1:  # one rank's figures are the step's
            p = self.params[0]
        else:  # the ranks' sums, finite where every shard is
            p = [
                [_sum([x[c] for x in per]) for c in range(3)] + [min(x[3] for x in per)]
                for per in zip(*self.params, strict=True)
            ]
        n = _f32([max(m, 1) for m in numel])
        rms, rms_t = (
            _f32([_sqrt(q) for q in _f32([a / b for a, b in zip(_f32(col), n, strict=True)])])
            for col in ([x[0] for x in p], [x[1] for x in p])
        )
        spikes, finite = [x[2] for x in p], [x[3] for x in p]
        of = {k: [h[i] for h in head] for i, k in enumerate(HEAD)}  # each HEAD figure by rank
        tops = of["logit_absmax"]
        lse = _sum(
            [z * r if r > 0 else 0.0 for z, r in zip(of["log_z"], of["logit_rows"], strict=True)]
        )
        counted = _sum(of["logit_rows"])
        log_z = lse / counted if counted else math.nan  # no logits: NaN, as torch's
        counts = [int(x) for x in of["rows"]]

        def per_row(name: str) -> list[float]:
            """A ROW figure of the whole batch: each rank's rows, rank 0's first (the order
            in which `Ranks.my_rows` hands them out)."""
            i = ROW.index(name)
            return [x for rank, k in zip(self.rows, counts, strict=True) for x in rank[i][:k]]

        # (the usual step has every gradient finite, no spike and every RMS_t a number:
        # each filter below is skipped whole then)
        return GradEvidence(
            loss=_sum(of["loss"]),
            total=math.sqrt(_sum([x * x for x in of["norm"]])),  # one process: its norm
            nonfinite=()
            if all(finite)
            else tuple(nm for nm, ok in zip(names, finite, strict=True) if not ok),
            rms=dict(zip(ckpt, rms, strict=True)),
            rms_t=dict(zip(ckpt, rms_t, strict=True))
            if all(map(math.isfinite, rms_t))
            else {nm: r for nm, r in zip(ckpt, rms_t, strict=True) if math.isfinite(r)},
            spikes={nm: int(k) for nm, k in zip(ckpt, spikes, strict=True) if k > 0}
            if any(spikes)
            else {},
            sample_loss=tuple(per_row("loss")),
            sample_grad_sq=tuple(per_row("grad_sq")) if all(of["has_grad_sq"]) else None,
            logit_absmax=math.nan if any(map(math.isnan, tops)) else max(tops),  # NaN wins
            log_z=log_z,
            sample_tokens=tuple(int(x) for x in per_row("tokens")),
        )


def _sum(xs: list[float]) -> float:
    """The ranks' figures added in rank order from the first (one rank: its own, as it is;
    a few ranks: numpy's order)."""
    return sum(xs[1:], xs[0])


def _f32(xs: list[float]) -> list[float]:
    """Each number rounded to float32 (as numpy's astype: out of range to inf)."""
    return array("f", xs).tolist()


def _sqrt(x: float) -> float:
    """sqrt as numpy takes it: NaN for a negative number or NaN (no warning), -0.0 for -0.0."""
    return math.sqrt(x) if x >= 0 else math.nan


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm of these gradients (a rank's shards of them), as `clip_grad_norm_` takes it:
    where they are one group (`_one_group`), torch's own ops for one group without its
    grouping (a tenth of a millisecond a step at 64 wide), else `get_total_norm` itself."""
    if _one_group(grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    return torch.nn.utils.get_total_norm(grads)


def _one_group(ts: list[torch.Tensor]) -> bool:
    """Plain tensors of one device and dtype that torch's foreach ops take: what
    `torch.nn.utils`' clipping groups into one group and hands to `_foreach_*` whole."""
    if not ts or ts[0].device.type not in ("cpu", "cuda"):
        return False
    dev, dt = ts[0].device, ts[0].dtype
    return all(type(t) is torch.Tensor and t.device == dev and t.dtype == dt for t in ts)


def clip_grads(
    params: list[torch.nn.Parameter], clip: float | None, total: float, like: torch.Tensor
) -> None:
    """Clip the gradients of `params` to `clip` (None: no limit) by their whole norm `total`
    (`like`: the dtype and device `grad_norm` gave it), by torch's own rule: what
    `torch.nn.utils.clip_grad_norm_` does once it has the norm."""
    norm = torch.tensor(total, dtype=like.dtype, device=like.device)
    grads = [p.grad for p in params if p.grad is not None]
    if _one_group(grads):  # `clip_grads_with_norm_`'s ops for one group
        coef = torch.clamp((clip if clip else math.inf) / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
        return
    torch.nn.utils.clip_grads_with_norm_(params, clip if clip else math.inf, norm)


def gather(world: World, layout: Layout, flat: torch.Tensor) -> Gathered:
    """Every rank's `flat` row, read back on the host: the step's one collective and its
    one host read."""
    return layout.unpack(world.gather(flat).cpu())
