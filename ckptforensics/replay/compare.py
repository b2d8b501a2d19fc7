"""Replayed weights and optimizer state against *after*, tensor by tensor: within the
replay's rounding, or past what any replay of the window could reach (a hardware fault)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..formats import bnb
from ..formats.base import Checkpoint
from ..tensors import adam_ratio_bound
from ..updates import replay_bound
from . import distributed
from . import precision as mp
from .records import TensorMatch, local_tensor

if TYPE_CHECKING:
    from .session import Session

__all__ = [
    "compare_after",
    "compare_shard",
    "merge_matches",
    "weight_match",
    "moment_tol",
    "MATCH_SHARE",
]

log = logging.getLogger(__name__)


def compare_after(
    session: Session, b: Checkpoint, lrs: dict[int, list[float]], only: set[str] | None = None
) -> list[TensorMatch]:
    """Replayed weights and moments against *after*, per tensor (those in `only`, if given).

    A weight matches when it is within 1% of one Adam step (k lr) of *after*: a
    different summation order changes gradients in the last bits, and Adam can turn
    that into part of an update, never into more than the update bound. Elements past
    the bound (`impossible`) cannot come from any replay of these steps.
    """
    k = len(lrs)
    out = []
    state = session.opt.state
    ranks = session.shards
    group_of = {id(p): gi for gi, g in enumerate(session.opt.param_groups) for p in g["params"]}
    for key, p in session.model.named_parameters():
        name = session.to_ckpt(key)
        name = b.aliases.get(name, name)
        if (only is not None and name not in only) or not b.has(name):
            continue
        if ranks is not None:
            out.extend(
                compare_shard(
                    ranks,
                    name,
                    p,
                    state.get(p, {}),
                    session.opt.param_groups[group_of.get(id(p), 0)],
                    b,
                    lrs,
                    group_of.get(id(p), 0),
                    session.precision,
                )
            )
            continue
        gi = group_of.get(id(p), 0)
        g = session.opt.param_groups[gi]
        lr = max(v[gi] for v in lrs.values())
        st_p = state.get(p, {})
        ref = b.tensor(name).to(torch.float32).view_as(p)
        mine = p.detach().cpu().to(torch.float32)
        quant = g.get("family") == "adam8bit" and bnb.is_quantised(st_p)
        # The seam to the optimizer's family: its own per-step bound (updates.replay_bound).
        c, wd = replay_bound(
            {**g, "quantised": quant}, st_p, k, lr, tuple(p.shape), float(mine.pow(2).mean().sqrt())
        )
        out.append(
            weight_match(
                name, mine, ref, b.meta(name).dtype, k * lr, c, wd, mp.reach(session.precision)
            )
        )
        st = b.optim_state(name)
        if st_p and g.get("family") == "adam8bit":
            st_p = {
                kk: v for kk, v in bnb.with_moments(st_p).items() if kk in ("step", *bnb.DERIVED)
            }
        if st_p and st:
            pairs = {
                where: (st_p[where].cpu().float(), st[where].float().view_as(st_p[where]))
                for where in _shared_state(st_p, st)
            }
            v = pairs.get("exp_avg_sq")
            for where, (x, y) in pairs.items():
                # Relative rounding per step, floored at the tensor's own scale: elements
                # whose true gradient is zero (a key bias, say) hold pure rounding noise.
                scale = (
                    mp.moment_scale(session.precision, where, x, y, *v)
                    if v is not None
                    else torch.maximum(x.abs(), y.abs())
                )
                tol = moment_tol(
                    scale, float(scale.max()), k, mp.moment_rounding(session.precision)
                )
                if quant:
                    tol = tol + _code_tol(state.get(p, {}), where, x)
                out.append(_match(name, where, x, y, tol, None))
    return out if ranks is None else merge_matches(ranks, out)


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
    (Adam's moments, Adafactor's factored rows and columns, a momentum buffer)."""
    return [
        k for k, v in mine.items()
        if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(after.get(k), torch.Tensor) and after[k].numel() == v.numel()
    ]  # fmt: skip


def compare_shard(
    ranks: distributed.Ranks,
    name: str,
    p: Any,
    st_p: dict,
    g: dict,
    b: Checkpoint,
    lrs: dict[int, list[float]],
    gi: int,
    precision: str = "fp32",
) -> list[TensorMatch]:
    """`compare_after` for one FSDP2-sharded parameter: this rank's rows of the replayed state
    against the same rows of *after* (only those read); the ranks' counts are merged by
    `merge_matches`. The moments' tolerance floor is the whole tensor's scale (one
    all-reduce of the two maxima per parameter)."""
    k = len(lrs)
    lr = max(v[gi] for v in lrs.values())
    beta1, beta2 = g["betas"]
    t_end = int(st_p["step"]) if "step" in st_p else k
    c = adam_ratio_bound(beta1, beta2, max(1, t_end - k + 1), t_end)
    stored = b.meta(name).shape

    def after_rows(
        read: Callable[[int, int], torch.Tensor], full: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        return (
            distributed.local_rows(ranks, p, stored, read, full)
            .float()
            .reshape(local_tensor(p).shape)
        )

    mine = local_tensor(p).detach().cpu().float()
    ref = after_rows(lambda lo, hi: b.rows(name, lo, hi), lambda: b.tensor(name))
    out = [
        weight_match(
            name, mine, ref, b.meta(name).dtype, k * lr, c, g["weight_decay"], mp.reach(precision)
        )
    ]
    st = b.optim_state(name)
    if st_p and st:
        pairs = {}
        for where in ("exp_avg", "exp_avg_sq"):
            x = local_tensor(st_p[where]).cpu().float()
            y = after_rows(
                lambda lo, hi, w=where: b.state_rows(name, w, lo, hi), lambda w=where: st[w]
            )
            pairs[where] = (x, y, torch.maximum(x.abs(), y.abs()))
        vx, vy, _ = pairs["exp_avg_sq"]
        pairs = {
            w: (x, y, mp.moment_scale(precision, w, x, y, vx, vy)) for w, (x, y, _) in pairs.items()
        }
        tops = ranks.max(
            torch.stack([s.max() if s.numel() else s.new_zeros(()) for _, _, s in pairs.values()])
        )
        for (where, (x, y, scale)), top in zip(pairs.items(), tops.tolist(), strict=True):
            out.append(
                _match(
                    name,
                    where,
                    x,
                    y,
                    moment_tol(scale, top, k, mp.moment_rounding(precision)),
                    None,
                )
            )
        b.forget(name)
    return out


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


def merge_matches(ranks: distributed.Ranks, local: list[TensorMatch]) -> list[TensorMatch]:
    """Every rank's per-shard matches as whole-tensor ones (counts summed, maxima taken),
    identical on every rank: one collective."""
    merged: dict[tuple[str, str], TensorMatch] = {}
    for part in ranks.objects(local):
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
