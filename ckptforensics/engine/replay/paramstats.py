"""Per-parameter gradient figures of a replayed step: RMS(g), Adam's normalised RMS_t and
SPAM's spike count (elements with g^2 > 5000 v_hat), one parameter at a time or every
parameter at once in whole-block ops over gradients of one size (`param_grad_table`, what
the step uses), or as sums a rank's shard contributes (`param_grad_sums`).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from ckptforensics.core import fused

__all__ = ["StepCounts", "host_sums", "param_grad_stats", "param_grad_sums", "param_grad_table"]


def param_grad_stats(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """[RMS(g), RMS_t, SPAM spike count] of one parameter's gradient, on its device.

    RMS_t = sqrt(mean(g^2 / v_hat)) against Adam's second moment *before* this step
    (StableAdamW, Wortsman 2304.13013): ~1 in steady state, >> 1 when v is stale.
    Spikes: elements with g^2 > 5000 v (SPAM 2501.06842; v floored by Adam's eps^2 / c).
    NaN / 0 without Adam state.
    """
    sums = param_grad_sums(grad, state, group)
    n = max(grad.numel(), 1)
    return torch.stack([(sums[0] / n).sqrt(), (sums[1] / n).sqrt(), sums[2]])


def param_grad_sums(grad: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """[sum g^2, sum g^2 / v_hat, SPAM spike count] of a gradient (or a rank's shard of it
    with the matching shard of v): sums, so that ranks' shares add up (`param_grad_stats`).

    One ratio tensor serves both: with v_hat = c v (c the bias correction),
    g^2 / (v_hat + eps^2) = (g^2 / (v + eps^2 / c)) / c. NaN / 0 without Adam state.
    """
    g2 = grad.detach().float().pow(2)
    v = state.get("exp_avg_sq")
    if v is None or float(state.get("step", 0)) <= 0 or "betas" not in group:
        return torch.stack([g2.sum(), g2.new_tensor(math.nan), g2.new_zeros(())])
    v = v.to_local() if hasattr(v, "to_local") else v
    beta2, eps = group["betas"][1], group["eps"]
    c = 1.0 / (1 - beta2 ** float(state["step"]))  # v_hat = c v
    total = g2.sum()
    r = g2.div_(
        v.float().add(eps * eps / c)
    )  # g2 is our own temporary; r = c g^2 / (v_hat + eps^2)
    return torch.stack([total, r.sum() / c, (r > 5000).sum().float()])


# Elements of gradient one `param_grad_table` block stacks at most (fp32: 4 MiB): blocks
# save the dispatch of small gradients' ops; a gradient this large is measured alone, in
# place, where the stacking copy would cost more than the ops it saves.
_BLOCK = 1 << 20


def param_grad_table(
    grads: list[torch.Tensor], states: list[dict], groups: list[dict], sums: bool = False
) -> torch.Tensor:
    """`param_grad_stats` of every parameter at once, and whether its gradient is finite:
    [P, 4] = [RMS(g), RMS_t, SPAM spike count, finite (1 / 0)] on the gradients' device
    (`sums`: `param_grad_sums`' [sum g^2, sum g^2 / v_hat, spikes] instead of the first
    three, for ranks to add up). The same figures as one call per parameter, within float
    rounding, and no host read: gradients of one size (a model's layers repeat a handful
    of shapes) are stacked into blocks [n, size] and measured with a dozen whole-block ops
    each (`_block_sums`), so the op count follows the distinct sizes, not the parameters
    (at 64 wide one op per parameter is dispatch, not arithmetic; on CPU `_foreach_*` ops
    loop over their tensors one op at a time, and comparisons and `isfinite` are several
    times slower than arithmetic reductions, hence the sign and min/max forms below).
    """
    if not grads:
        return torch.zeros(0, 4)
    host = host_sums(grads, states, groups)
    if host is not None:
        table = torch.tensor(host, dtype=torch.float64).reshape(-1, 4).float()
        return table if sums else _rms(table, grads)
    dev = grads[0].device
    g = [_local(x.detach()) for x in grads]
    adam: dict[int, tuple[torch.Tensor, float, float]] = {}  # index -> (v, eps^2 / c, c)
    for k, (st, grp) in enumerate(zip(states, groups, strict=True)):
        v = st.get("exp_avg_sq")
        if v is None or "betas" not in grp:
            continue
        t = float(st.get("step", 0))
        if t <= 0:
            continue
        c = 1.0 / (1 - grp["betas"][1] ** t)
        adam[k] = (_local(v), grp["eps"] * grp["eps"] / c, c)
    # [sum g^2, sum g^2 / v_hat, spikes, finite] per parameter: NaN / 0 without Adam
    # state; an empty gradient: zeros, finite.
    table = _torch_table(g, adam, dev)
    return table if sums else _rms(table, g)


def _rms(table: torch.Tensor, g: list[torch.Tensor]) -> torch.Tensor:
    """The sums' first two columns as RMS(g) and RMS_t (in place)."""
    n = torch.tensor([float(max(x.numel(), 1)) for x in g], device=table.device)
    table[:, 0] = (table[:, 0] / n).sqrt()
    table[:, 1] = (table[:, 1] / n).sqrt()
    return table


class StepCounts:
    """Reads optimizer states' Adam step counts as floats (0 where none), step after step.

    A count is in most optimizers one 0-dim CPU tensor per parameter, made once and bumped
    in place: it is read through a ctypes scalar at its address, kept (with the tensor, so
    that its id stays its own and its memory alive) while the state holds that tensor.
    `item` per count, or one `stack`, cost 2-3 µs a count between a replayed step's other
    ops; the scalar's `value`, a tenth of that."""

    def __init__(self) -> None:
        self._views: dict[int, tuple[torch.Tensor, Any]] = {}

    def __call__(self, states: list[dict]) -> list[float]:
        out = [0.0] * len(states)
        views = self._views
        for k, st in enumerate(states):
            t = st.get("step", 0)
            if type(t) is not torch.Tensor:
                out[k] = float(t)
                continue
            held = views.get(id(t))
            if held is None or held[0] is not t:
                kind = _SCALARS.get(t.dtype)
                if t.dim() or not t.is_cpu or kind is None:
                    out[k] = float(t.item())
                    continue
                held = views[id(t)] = (t, kind.from_address(t.data_ptr()))
            out[k] = float(held[1].value)
        if len(views) > 2 * len(states) + 64:  # counts no state holds now: let them go
            live = {id(st.get("step")) for st in states}
            self._views = {i: v for i, v in views.items() if i in live}
        return out


# the ctypes scalar that reads a count of each dtype as torch stores it
_SCALARS = {
    torch.float32: ctypes.c_float,
    torch.float64: ctypes.c_double,
    torch.int64: ctypes.c_int64,
    torch.int32: ctypes.c_int32,
}


def host_sums(
    grads: list[torch.Tensor],
    states: list[dict],
    groups: list[dict],
    counts: StepCounts | None = None,
) -> list[list[float]] | None:
    """`param_grad_table`'s sums [P][4] (float64, Python numbers) by the C kernel
    (`fused.Kernels.param_sums`: one call, a pass per parameter), for plain fp32 CPU
    gradients and moments; None otherwise. One loop over the parameters: at 64 wide this
    Python, not the kernel, is most of the stage (three or four times its tight-loop cost
    between a replayed step's other work). `counts`: the caller's reader of the step counts,
    kept from step to step."""
    kernels = fused.load()
    if kernels is None:
        return None
    n = len(grads)
    steps = (counts or StepCounts())(states)
    gp, vp, numels = [0] * n, [0] * n, [0] * n
    e, c = [0.0] * n, [1.0] * n
    empty: list[int] = []  # Adam's parameters without elements: their ratio sum is 0
    for k, (x, st, grp, t) in enumerate(zip(grads, states, groups, steps, strict=True)):
        if not (_plain_f32(x) and x.is_cpu):
            return None
        m = x.numel()
        gp[k], numels[k] = x.data_ptr(), m
        v = st.get("exp_avg_sq")
        if v is None or t <= 0 or "betas" not in grp:
            continue
        if not (_plain_f32(v) and v.is_cpu and v.numel() == m):
            return None
        ck = 1.0 / (1 - grp["betas"][1] ** t)
        # an empty tensor's pointer may be 0, read as no state: its sum is set to 0 below
        vp[k], e[k], c[k] = v.data_ptr(), grp["eps"] * grp["eps"] / ck, ck
        if not m:
            empty.append(k)
    out = kernels.param_sums(gp, vp, numels, e)
    if out is None:
        return None
    for k, row in enumerate(out):  # the ratio's sum over c (1 without Adam state: NaN stays)
        row[1] /= c[k]
    for k in empty:
        out[k][1] = 0.0
    return out


def _local(x: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return x if type(x) is torch.Tensor else x.to_local() if hasattr(x, "to_local") else x


def _plain_f32(x: torch.Tensor) -> bool:
    return type(x) is torch.Tensor and x.dtype == torch.float32 and x.is_contiguous()


def _torch_table(
    g: list[torch.Tensor], adam: dict[int, tuple[torch.Tensor, float, float]], dev: torch.device
) -> torch.Tensor:
    """`param_grad_table`'s sums in whole-block torch ops (`_block_sums`)."""
    blocks: dict[tuple, list[int]] = {}
    for k, x in enumerate(g):
        if x.numel():
            key = (x.numel(), x.dtype, k in adam, adam[k][0].dtype if k in adam else None)
            blocks.setdefault(key, []).append(k)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for (n, *_), ks in blocks.items():
        step = max(1, _BLOCK // n)
        for i in range(0, len(ks), step):
            part = ks[i : i + step]
            parts.append(_block_sums([g[k] for k in part], [adam[k] for k in part if k in adam]))
            order += part
    table = torch.zeros(len(g), 4, device=dev)
    table[:, 1] = math.nan
    table[list(adam), 1] = 0.0
    table[:, 3] = 1.0
    if parts:
        table[order] = torch.cat(parts).to(dev)
    return table


def _block_sums(
    g: list[torch.Tensor], adam: list[tuple[torch.Tensor, float, float]]
) -> torch.Tensor:
    """[n, 4] = [sum g^2, sum g^2 / v_hat, spikes, finite] of n gradients of one size and
    dtype, stacked (`adam`: each one's (v, eps^2 / c, c), or empty: NaN / 0 / finite only),
    in about ten passes over the block. Finite: the fp64 sum of g is (an inf or NaN
    element makes it inf or NaN; fp32 elements cannot overflow it). Spikes: r > 5000 as
    sign(clamp(r - 5000, min=0)) summed by `nansum` (r - 5000 is exact near 5000; clamp keeps
    a NaN, which nansum skips, as the comparison does not count it; an inf counts), in
    place on r: `fmax`, which drops the NaN itself, is several times slower on CPU."""
    x = (torch.stack([t.reshape(-1) for t in g]) if len(g) > 1 else g[0].reshape(1, -1)).float()
    finite = torch.isfinite(x.sum(1, dtype=torch.float64)).float()
    g2 = x * x
    sq = g2.sum(1)
    if not adam:
        return torch.stack([sq, torch.full_like(sq, math.nan), torch.zeros_like(sq), finite], 1)
    dev = x.device
    eps = torch.tensor([a[1] for a in adam], device=dev).unsqueeze(1)
    if len(adam) > 1:
        v = torch.stack([a[0].reshape(-1) for a in adam]).float().add_(eps)  # our own copy
    else:
        v = adam[0][0].reshape(1, -1).float() + eps
    r = g2.div_(v)  # c g^2 / (v_hat + eps^2)
    rs = r.sum(1) / torch.tensor([a[2] for a in adam], device=dev)
    r.sub_(5000.0)
    spikes = r.clamp_(min=0.0).sign_().nansum(1)
    return torch.stack([sq, rs, spikes, finite], 1)
