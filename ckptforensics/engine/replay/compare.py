"""Replayed weights and optimizer state against *after*, tensor by tensor: within the
replay's rounding, or past what any replay of the window could reach (a hardware fault).

One process is a world of one rank (`distributed.OneProcess`): every parameter is compared
by one path, each rank against its own rows of *after* (one process: every row, read
whole), and the ranks meet only at the reductions: one gather per parameter (the weight's
sum of squares, for its RMS, and each moment's largest scale, for its tolerance floor),
then one to merge the counts (`merge_matches`). The gathers stay per parameter: a
moment's tolerance needs its whole tensor's scale before any element is counted, so one
gather for every parameter would hold every parameter's rows of *after* at once, or read
them twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ckptforensics import optim
from ckptforensics.engine.replay import distributed
from ckptforensics.engine.replay import precision as mp
from ckptforensics.engine.replay.records import TensorMatch, local_tensor
from ckptforensics.formats.base import Checkpoint
from ckptforensics.optim import bnb

if TYPE_CHECKING:
    from ckptforensics.engine.replay.session import Session

__all__ = [
    "compare_after",
    "merge_matches",
    "weight_match",
    "moment_tol",
    "MATCH_SHARE",
]

log = logging.getLogger(__name__)

# Adam's moments: what a rank of several compares, row for row (sharded like their
# parameter; `optimizer.build_optimizer` builds no other family under torchrun).
_MOMENTS = ("exp_avg", "exp_avg_sq")


def compare_after(
    session: Session, b: Checkpoint, lrs: dict[int, list[float]], only: set[str] | None = None
) -> list[TensorMatch]:
    """Replayed weights and moments against *after*, per tensor (those in `only`, if given).

    A weight matches when it is within 1% of one Adam step (k lr) of *after*: a
    different summation order changes gradients in the last bits, and Adam can turn
    that into part of an update, never into more than the update bound. Elements past
    the bound (`impossible`) cannot come from any replay of these steps. Under torchrun
    each rank compares its shards, and the ranks' counts are merged (`merge_matches`).
    """
    out = []
    group_of = {id(p): gi for gi, g in enumerate(session.opt.param_groups) for p in g["params"]}
    for key, p in session.model.named_parameters():
        name = session.to_ckpt(key)
        name = b.aliases.get(name, name)
        if (only is not None and name not in only) or not b.has(name):
            continue
        gi = group_of.get(id(p), 0)
        out.extend(
            _compare_param(
                session.ranks,
                name,
                p,
                session.opt.state.get(p, {}),
                session.opt.param_groups[gi],
                b,
                [v[gi] for v in lrs.values()],
                session.precision,
            )
        )
    return merge_matches(session.ranks, out)


def _compare_param(
    world: distributed.World,
    name: str,
    p: torch.Tensor,
    raw: dict[str, Any],
    g: dict[str, Any],
    b: Checkpoint,
    lrs: list[float],
    precision: str = "fp32",
) -> list[TensorMatch]:
    """One parameter's replayed weight and optimizer state (`raw`, its group `g`; `lrs`: the
    group's LR at each of the window's steps) against *after*'s: this rank's rows of each
    (one process: all of them). The weight's RMS (`optim.replay_bound`) and each
    moment's tolerance floor are the whole tensor's, from one gather over the ranks."""
    k, lr = len(lrs), max(lrs)
    stored = b.meta(name).shape

    def after_rows(
        t: torch.Tensor, read: Callable[[int, int], torch.Tensor], full: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        return (
            distributed.local_rows(world, t, stored, read, full)
            .float()
            .reshape(local_tensor(t).shape)
        )

    mine = local_tensor(p).detach().cpu().float()
    ref = after_rows(p, lambda lo, hi: b.rows(name, lo, hi), lambda: b.tensor(name))
    # 8-bit state (bitsandbytes): the moments compared are the dequantised codes.
    fam = optim.find(g.get("family"))
    eight_bit = fam is not None and fam.bnb_state
    quant = eight_bit and bnb.is_quantised(raw)
    st_p = raw
    if st_p and eight_bit:
        st_p = {kk: v for kk, v in bnb.with_moments(st_p).items() if kk in ("step", *bnb.DERIVED)}
    st = b.optim_state(name)
    pairs = {}
    if st_p and st:
        for where in _shared_state(st_p, st):
            pairs[where] = (
                local_tensor(st_p[where]).cpu().float(),
                after_rows(
                    st_p[where],
                    lambda lo, hi, w=where: b.state_rows(name, w, lo, hi),
                    lambda w=where: st[w],
                ),
            )
    v = pairs.get("exp_avg_sq")
    # Relative rounding per step, floored at the tensor's own scale: elements whose true
    # gradient is zero (a key bias, say) hold pure rounding noise.
    scales = [
        mp.moment_scale(precision, where, x, y, *v)
        if v is not None
        else torch.maximum(x.abs(), y.abs())
        for where, (x, y) in pairs.items()
    ]
    every = world.gather(
        torch.stack(
            [mine.pow(2).sum(), *(s.max() if s.numel() else s.new_zeros(()) for s in scales)]
        )
    )
    tops = every[:, 1:].amax(0).tolist()
    # The seam to the optimizer's family: its own per-step bound (optim.replay_bound).
    c, wd = optim.replay_bound(
        {**g, "quantised": quant},
        raw,
        k,
        lr,
        tuple(p.shape),
        float(every[:, 0].sum().div(p.numel()).sqrt()),
    )
    out = [weight_match(name, mine, ref, b.meta(name).dtype, k * lr, c, wd, mp.reach(precision))]
    rel = mp.moment_rounding(precision)
    own = fam.state_rounding if fam is not None else None
    if own is not None:
        # The family's own rounding (Muon's bf16 Newton-Schulz), relative to each state
        # tensor's RMS too. (One process: a torchrun replay rebuilds Adam alone.)
        rel = max(rel, own)
        scales = [
            torch.maximum(s, y.pow(2).mean().sqrt())
            for s, (_, y) in zip(scales, pairs.values(), strict=True)
        ]
    for (where, (x, y)), scale, top in zip(pairs.items(), scales, tops, strict=True):
        tol = moment_tol(scale, top, k, rel)
        if quant:
            tol = tol + _code_tol(raw, where, x)
        out.append(_match(name, where, x, y, tol, None))
    b.forget(name)
    return out


def _code_tol(raw: dict[str, Any], where: str, like: torch.Tensor) -> torch.Tensor:
    """An 8-bit moment's extra tolerance: a gradient that differs in its last bits can round
    the replayed value to the neighbouring code, one code gap of its block's absmax away."""
    parts = bnb.quant_parts(raw, 1 if where == "exp_avg" else 2)
    if parts is None:
        return torch.zeros_like(like)
    _, qmap, scale = parts
    return (bnb.per_element(scale.cpu(), like.numel()) * bnb.code_gap(qmap)).view_as(like)


def _shared_state(mine: dict, after: dict) -> list[str]:
    """The state tensors of a replayed parameter that *after* holds too, shape for shape
    (Adam's moments, Adafactor's factored rows and columns, a momentum buffer). A rank of
    several looks only for Adam's moments, without reading *after*'s whole to check them."""
    return [
        k for k, v in mine.items()
        if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0 and (
            k in _MOMENTS and k in after if hasattr(v, "to_local")
            else isinstance(after.get(k), torch.Tensor) and after[k].numel() == v.numel()
        )
    ]  # fmt: skip


def weight_match(
    name: str,
    mine: torch.Tensor,
    ref: torch.Tensor,
    dtype: torch.dtype,
    klr: float,
    c: float,
    wd: float,
    reach: float = 1.0,
) -> TensorMatch:
    """A replayed weight against *after*'s: within 1% of the window's Adam steps (k lr) plus
    rounding of the stored dtype; past the bound no Adam step reaches (`impossible`)."""
    ulp = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    wscale = torch.maximum(mine.abs(), ref.abs())
    return _match(
        name,
        "weight",
        mine,
        ref,
        0.01 * klr + 4 * ulp * wscale,
        reach * klr * (c + wd * wscale) * 1.001 + 2 * ulp * wscale,
    )


def moment_tol(scale: torch.Tensor, top: float, k: int, rel: float = 1e-3) -> torch.Tensor:
    """A moment's tolerance: relative rounding `rel` per step (`precision.moment_rounding`),
    floored at the whole tensor's scale `top` (elements whose true gradient is zero hold
    pure rounding noise)."""
    return rel * k * scale + 1e-4 * top + 1e-30


def merge_matches(world: distributed.World, local: list[TensorMatch]) -> list[TensorMatch]:
    """Every rank's per-shard matches as whole-tensor ones (counts summed, maxima taken),
    identical on every rank: one collective (a world of one: its own, as they are)."""
    parts = world.objects(local)
    if len(parts) == 1:
        return local
    merged: dict[tuple[str, str], TensorMatch] = {}
    for part in parts:
        for m in part:
            o = merged.get((m.name, m.where))
            merged[(m.name, m.where)] = (
                m
                if o is None
                else TensorMatch(
                    name=m.name,
                    where=m.where,
                    max_abs_diff=max(o.max_abs_diff, m.max_abs_diff),
                    mismatched=o.mismatched + m.mismatched,
                    numel=o.numel + m.numel,
                    tolerance=max(o.tolerance, m.tolerance),
                    impossible=o.impossible + m.impossible,
                    worst=max(o.worst, m.worst),
                )
            )
    return [merged[(m.name, m.where)] for m in local]


def _match(
    name: str,
    where: str,
    x: torch.Tensor,
    y: torch.Tensor,
    tol: torch.Tensor | float,
    bound: torch.Tensor | None,
) -> TensorMatch:
    # (trained parameters and tolerances made from them: no graph, no warning)
    x, y = x.detach(), y.detach()
    tol = tol.detach() if isinstance(tol, torch.Tensor) else tol
    bound = bound.detach() if bound is not None else None
    diff = (x - y).abs()
    bad = ~(diff <= tol)
    impossible = int((~(diff <= bound)).sum()) if bound is not None else 0
    ratio = torch.where(
        diff == 0,
        0.0,
        torch.nan_to_num(diff / torch.as_tensor(tol, dtype=diff.dtype), nan=float("inf")),
    )
    return TensorMatch(
        name=name,
        where=where,
        max_abs_diff=float(torch.nan_to_num(diff, nan=float("inf")).max()) if diff.numel() else 0.0,
        mismatched=int(bad.sum()),
        numel=x.numel(),
        tolerance=float(torch.as_tensor(tol).max()),
        impossible=impossible,
        worst=float(ratio.max()) if ratio.numel() else 0.0,
    )


# A replay reproduces *after* when at most this share of elements is off (docs/signatures.md#reproducibility).
MATCH_SHARE = 0.01
