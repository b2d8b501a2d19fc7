"""Per-parameter gradient figures of a replayed step: RMS(g), Adam's normalised RMS_t and
SPAM's spike count (elements with g^2 > 5000 v_hat), one parameter at a time or every
parameter at once in foreach ops (`param_grad_table`, what the step uses), or as sums a
rank's shard contributes (`param_grad_sums`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["param_grad_stats", "param_grad_sums", "param_grad_table"]


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


# Elements of gradient one `param_grad_table` chunk converts to fp32 temporaries at a time
# (two of them: 512 MiB), so the foreach pass never holds a second copy of every gradient.
_PARAM_CHUNK = 1 << 26


def param_grad_table(
    grads: list[torch.Tensor], states: list[dict], groups: list[dict], sums: bool = False
) -> torch.Tensor:
    """`param_grad_stats` of every parameter at once, and whether its gradient is finite:
    [P, 4] = [RMS(g), RMS_t, SPAM spike count, finite (1 / 0)] on the gradients' device
    (`sums`: `param_grad_sums`' [sum g^2, sum g^2 / v_hat, spikes] instead of the first
    three, for ranks to add up). The same figures as one call per parameter, within float
    rounding, in a dozen `torch._foreach_*` ops over chunks of the parameters instead of a
    dozen ops per parameter; one host read screens for the rare gradient that holds a
    NaN or an overflow, whose parameters are then counted one by one.
    """
    if not grads:
        return torch.zeros(0, 4)
    dev = grads[0].device
    g = [x.detach() for x in grads]
    g = [x.to_local() if hasattr(x, "to_local") else x for x in g]
    adam: dict[int, tuple[torch.Tensor, float, float]] = {}  # index -> (v, eps^2 / c, c)
    for k, (st, grp) in enumerate(zip(states, groups, strict=True)):
        v = st.get("exp_avg_sq")
        if v is None or float(st.get("step", 0)) <= 0 or "betas" not in grp:
            continue
        v = v.to_local() if hasattr(v, "to_local") else v
        c = 1.0 / (1 - grp["betas"][1] ** float(st["step"]))
        adam[k] = (v, grp["eps"] * grp["eps"] / c, c)
    # [sum g^2, sum g^2 / v_hat, spikes] per parameter: NaN / 0 without Adam state, zeros
    # for an empty gradient; filled a chunk of parameters at a time.
    table = torch.zeros(len(g), 4, device=dev)
    table[:, 1] = math.nan
    table[list(adam), 1] = 0.0
    plain = [k for k in range(len(g)) if k not in adam and g[k].numel()]
    for part in _chunked(plain, g):
        gf = [g[k].float() for k in part]
        table[part, 0] = torch.stack(torch._foreach_norm(torch._foreach_mul(gf, gf), 1))
    for part in _chunked([k for k in adam if g[k].numel()], g):
        gf = [g[k].float() for k in part]
        g2 = torch._foreach_mul(gf, gf)
        sq = torch._foreach_norm(g2, 1)
        denom = torch._foreach_add([adam[k][0].float() for k in part], [adam[k][1] for k in part])
        torch._foreach_div_(g2, denom)  # r = c g^2 / (v_hat + eps^2)
        rs = torch._foreach_norm(g2, 1)
        # Spikes: sign(max(r - 5000, 0)) is 1 where r > 5000, else 0 (r - 5000 is exact
        # near 5000), NaN where r is: such a count is redone below.
        torch._foreach_sub_(g2, 5000.0)
        torch._foreach_clamp_min_(g2, 0.0)
        torch._foreach_sign_(g2)
        count = torch._foreach_norm(g2, 1)
        cs = torch.tensor([adam[k][2] for k in part], device=dev)
        table[part, :3] = torch.stack(
            [torch.stack(sq), torch.stack(rs) / cs, torch.stack(count)], 1
        )
    # One read: a NaN spike count (an element of r is NaN) is counted again, and a sum of
    # g^2 that is not finite (a non-finite element, or a finite one whose square
    # overflows) is checked element by element; every other gradient is finite.
    table[:, 3] = 1.0
    screen = table[:, [2, 0]].cpu().tolist()
    for k, (count, total) in enumerate(screen):
        if math.isnan(count):
            table[k, 2] = param_grad_sums(g[k], states[k], groups[k])[2]
        if not math.isfinite(total):
            table[k, 3] = torch.isfinite(g[k]).all().float()
    if not sums:
        n = torch.tensor([float(max(x.numel(), 1)) for x in g], device=dev)
        table[:, 0] = (table[:, 0] / n).sqrt()
        table[:, 1] = (table[:, 1] / n).sqrt()
    return table


def _chunked(ks: list[int], g: list[torch.Tensor]) -> list[list[int]]:
    """`ks` in runs of at most `_PARAM_CHUNK` elements of gradient (a larger one alone)."""
    out: list[list[int]] = []
    size = 0
    for k in ks:
        if not out or size + g[k].numel() > _PARAM_CHUNK:
            out.append([])
            size = 0
        out[-1].append(k)
        size += g[k].numel()
    return out
