"""A replayed step's gradient evidence, gathered over the ranks in one collective, then
clipping by torch's rule.

Every rank (one process is a world of one, `distributed.OneProcess`) packs what it measured
into one flat row (`Layout`): its share of the loss and its logit figures, its rows'
per-sample figures, and per parameter the sums of its shard of the gradient
(`probes.param_grad_sums`). One gather brings every rank's row to every rank, and one host
read; the whole step's figures follow from the ranks' rows (`Gathered.evidence`), the total
norm among them, which clips the gradients as `torch.nn.utils.clip_grad_norm_` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .distributed import World
from .records import GradEvidence

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
        w, h, r = every.shape[0], len(HEAD), len(ROW) * self.pad
        every = every.numpy()
        return Gathered(
            head=every[:, :h],
            rows=every[:, h : h + r].reshape(w, len(ROW), self.pad),
            params=every[:, h + r :].reshape(w, self.params, len(PARAM)),
        )


def _head_row(head: list[torch.Tensor | float], dev: torch.device) -> torch.Tensor:
    """The HEAD figures as one float64 row on `dev`. On CPU, from the figures read as
    Python numbers (an fp32 or integer scalar is exact in float64): one tensor made instead
    of three small ops a figure; elsewhere on the device, with no host read."""
    if dev.type == "cpu" and all(
        not isinstance(x, torch.Tensor) or x.device.type == "cpu" for x in head
    ):
        return torch.tensor(
            [float(x.detach()) if isinstance(x, torch.Tensor) else float(x) for x in head],
            dtype=torch.float64,
        )
    return torch.stack(
        [torch.as_tensor(x).detach().to(dev, torch.float64).reshape(()) for x in head]
    )


@dataclass(frozen=True, slots=True)
class Gathered:
    """Every rank's packed figures (`Layout`), rank order, on the host (float64)."""

    head: np.ndarray  # [world, len(HEAD)]
    rows: np.ndarray  # [world, len(ROW), pad]
    params: np.ndarray  # [world, params, len(PARAM)]

    @classmethod
    def one(
        cls,
        head: dict[str, torch.Tensor | float],
        rows: dict[str, torch.Tensor],
        params: np.ndarray,
    ) -> Gathered:
        """One process's figures on the host, as `Layout.pack` and `gather` would hand them
        back (the same float64 values), without the packing: its ops, between a replayed
        step's others, cost more than the evidence they carry (`head`, `rows` by name as
        `Layout.pack` takes them, `params` [P, len(PARAM)])."""
        # fp32 or integer scalars: exact in float64
        top = [
            float(x.detach()) if isinstance(x, torch.Tensor) else float(x)
            for x in (head[k] for k in HEAD)
        ]
        block = torch.stack([rows[k].detach() for k in ROW]).to(torch.float64).numpy()
        return cls(
            head=np.array([top], np.float64),
            rows=block[None],
            params=np.asarray(params, np.float64)[None],
        )

    def evidence(
        self, names: Sequence[str], numel: Sequence[int], ckpt: Sequence[str]
    ) -> GradEvidence:
        """The step's evidence (`names`: the parameters' model names, `numel`: their sizes,
        `ckpt`: their checkpoint names, looked up once per session rather than per step).

        RMS and RMS_t are computed in float32 from the summed sums, as
        `probes.param_grad_stats` computes them for a whole gradient. The rows are on the
        host already: numpy's ops on them, a microsecond each, not torch's several."""
        head, params, w = self.head, self.params, self.head.shape[0]
        n = np.maximum(np.asarray(numel, np.float32), np.float32(1))
        # PARAM of the whole gradient [P, 4]: the ranks' sums, finite where every shard is
        # (one rank: its own row, as it is)
        p = (
            params[0]
            if w == 1
            else np.concatenate([params[..., :3].sum(0), params[..., 3:].min(0)], 1)
        )
        # [2, P]: RMS and RMS_t, each from its summed sums (columns 0, 1 of PARAM)
        rms, rms_t = np.sqrt(p[:, :2].astype(np.float32).T / n).tolist()
        spikes, finite = p[:, 2].tolist(), p[:, 3].tolist()
        if w == 1:  # one rank's head is the step's: Python numbers, no reductions
            h = dict(zip(HEAD, head[0].tolist(), strict=True))
            r = h["logit_rows"]
            loss, sq_norm, absmax = h["loss"], h["norm"] * h["norm"], h["logit_absmax"]
            lse, counted = (h["log_z"] * r if r > 0 else 0.0), r
        else:
            of = {k: head[:, i] for i, k in enumerate(HEAD)}
            r = of["logit_rows"]
            loss, absmax = float(of["loss"].sum()), float(of["logit_absmax"].max())
            sq_norm = float(np.square(of["norm"]).sum())
            lse, counted = float(np.where(r > 0, of["log_z"] * r, 0.0).sum()), float(r.sum())
        log_z = lse / counted if counted else math.nan  # no logits: NaN, as torch's
        rows = self.rows
        counts = [int(x) for x in head[:, HEAD.index("rows")].tolist()]

        def per_row(name: str) -> list[float]:
            """A ROW figure of the whole batch: each rank's rows, rank 0's first (the order
            in which `Ranks.my_rows` hands them out)."""
            c = rows[:, ROW.index(name)]
            return [x for i, k in enumerate(counts) for x in c[i, :k].tolist()]

        # (the usual step has every gradient finite, no spike and every RMS_t a number:
        # each filter below is skipped whole then)
        return GradEvidence(
            loss=loss,
            total=math.sqrt(sq_norm),  # one process: its norm
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
            sample_grad_sq=tuple(per_row("grad_sq"))
            if all(head[:, HEAD.index("has_grad_sq")].tolist())
            else None,
            logit_absmax=absmax,
            log_z=log_z,
            sample_tokens=tuple(int(x) for x in per_row("tokens")),
        )


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
