"""One tensor pair's statistics (`diff_tensor`): weights and moments streamed once, the
update bounds of the optimizer that updated it, and the element-level evidence.

Over 400 lines: one pass over a pair is one function's loop (stream, fold each chunk into the
accumulators, check the bounds, keep candidates); its parts are already `chunks` and `bounds`,
and what is left shares that loop's state."""

from __future__ import annotations

import math
from typing import Any

import torch

from ckptforensics import optim
from ckptforensics.core.errors import IncompatibleCheckpoints
from ckptforensics.core.tensors import dtype_limits, dtype_name
from ckptforensics.engine.diff.bounds import (
    bound_check,
    code_flips,
    collect,
    factored_floor,
    isolated_chunk,
    storage_eps,
)
from ckptforensics.engine.diff.chunks import (
    Acc,
    Moments,
    Pair,
    Staging,
    flat_chunks,
    load_kernels,
    moment_stats_fused,
    moment_stats_torch,
    release_all,
    sqrt32,
    weight_stats,
)
from ckptforensics.engine.diff.experts import ExpertAcc, expert_slices
from ckptforensics.engine.diff.records import (
    Candidate,
    DiffConfig,
    PairInfo,
    TensorDiff,
    adam_step,
    tensor_family,
    tensor_role,
    trainer_steps,
    window_lr,
)
from ckptforensics.formats.base import Checkpoint
from ckptforensics.optim import bnb
from ckptforensics.optim.updates import quantised_floor_allowance, raw_ratio_bound

__all__ = ["diff_tensor"]


def diff_tensor(
    a: Checkpoint, b: Checkpoint, name: str, pair: PairInfo, cfg: DiffConfig
) -> TensorDiff:
    meta = a.meta(name)
    wa_full, wb_full = a.tensor(name), b.tensor(name)
    role = tensor_role(name, meta.shape)
    lim = dtype_limits(meta.dtype)
    sa, sb = a.optim_state(name), b.optim_state(name)
    ha, hb = a.hyper(name), b.hyper(name)
    family = tensor_family(hb, sb) if hb is not None and not pair.weights_only else ""
    # The family's own record (None: weights only, no family, or one the tool does not know).
    fam = optim.find(family)
    g_steps = trainer_steps(pair)
    moments = (
        not pair.weights_only
        and lim is not None
        and fam is not None
        and fam.moments
        and isinstance(sa.get("exp_avg"), torch.Tensor)
        and isinstance(sb.get("exp_avg"), torch.Tensor)
        and isinstance(sa.get("exp_avg_sq"), torch.Tensor)
        and isinstance(sb.get("exp_avg_sq"), torch.Tensor)
        and hb is not None
        and hb.betas is not None
    )
    k = 0
    step_a = step_b = 0
    restart = False  # both ends hold Adam's moments but the counter did not advance: a reset
    if moments:
        step_a, step_b = adam_step(sa) or 0, adam_step(sb) or 0
        k = step_b - step_a
        restart = k <= 0 and g_steps is not None
        moments = k > 0
    # Families other than Adam's: a per-step bound on the weight, and (Adafactor) a floor
    # on the factored second moment; steps from the optimizer's counter, else the trainer's.
    other = (
        not pair.weights_only
        and lim is not None
        and hb is not None
        and fam is not None
        and not fam.moments
        and bool(sb)
    )
    obound = None
    o_k = 0
    o_floor: float | None = None
    o_restart_floor: float | None = None
    o_lr = math.nan
    if other:
        assert hb is not None and fam is not None
        ca, cb = adam_step(sa), adam_step(sb)
        if ca is not None and cb is not None:
            o_k, step_a, step_b = cb - ca, ca, cb
        elif g_steps is not None:
            o_k = g_steps
            step_a, step_b = pair.step_a or 0, pair.step_b or 0
        o_lr = window_lr(ha, hb, pair, step_a, step_b)
        rms_w = 0.0
        if fam.weight_scale(hb.options):
            rms_w = max(_rms(wa_full), _rms(wb_full))
        if o_k > 0:
            obound = fam.update_bound(
                lr=o_lr if math.isfinite(o_lr) else 1.0, weight_decay=hb.weight_decay, betas=hb.betas, options=hb.options,
                t_first=step_a + 1, t_last=step_b, shape=meta.shape, rms_w=rms_w,
            )  # fmt: skip
            if not math.isfinite(o_lr) and not fam.own_step_size(hb.options):
                obound = None  # no LR recorded: nothing to bound against
            o_floor = fam.second_moment_floor(hb.betas, hb.options, step_a + 1, step_b)
        elif ca is not None and cb is not None and cb <= ca and g_steps is not None:
            o_restart_floor = fam.second_moment_floor(hb.betas, hb.options, ca + 1, ca + g_steps)
    # SGD's step is lr times its momentum buffer: an element's move its buffers account for.
    sgd_bufs = None
    buf = fam.update_buffer if other and fam is not None else None
    if buf is not None and o_k > 0 and math.isfinite(o_lr):
        ba_, bb_ = sa.get(buf), sb.get(buf)
        if (
            isinstance(ba_, torch.Tensor)
            and isinstance(bb_, torch.Tensor)
            and ba_.shape == bb_.shape
            and ba_.numel() == meta.numel
        ):
            sgd_bufs = (ba_, bb_)
    acc = Acc()
    cands: list[Candidate] = []
    counts = {"bound": 0, "vfloor": 0, "mbound": 0, "outlier": 0, "norm": 0}
    lr = math.nan
    restart_floor = None
    restart_allow: torch.Tensor | None = None
    if restart:
        assert hb is not None and hb.betas is not None and g_steps is not None and fam is not None
        restart_floor = hb.betas[1] ** g_steps
        q = bnb.quant_parts(sb, 2) if fam.bnb_state else None
        if q is not None:
            restart_allow = bnb.per_element(q[2], meta.numel) * quantised_floor_allowance(
                g_steps, bnb.code_gap(q[1])
            )
    if moments:
        assert hb is not None and hb.betas is not None and fam is not None
        beta1, beta2 = hb.betas
        lr = window_lr(ha, hb, pair, step_a, step_b)
        eps, wd = hb.eps, hb.weight_decay
        # 8-bit state (bitsandbytes): the moments are the dequantised codes (`optim.bnb`).
        quant = bnb.quant_parts(sb, 2) if fam.bnb_state else None
        rms_w = max(_rms(wa_full), _rms(wb_full)) if fam.weight_scale(hb.options) else 0.0
        mbound_ = fam.update_bound(
            lr=lr, weight_decay=wd, betas=hb.betas, options={**hb.options, "quantised": quant is not None},
            t_first=step_a + 1, t_last=step_b, shape=meta.shape, rms_w=rms_w,
        ) if math.isfinite(lr) else None  # fmt: skip
        if mbound_ is not None and mbound_.rms is not None:
            obound, o_k = mbound_, k  # the tensor's norm bound (LAMB's trust ratio), checked below
        c_raw_b = raw_ratio_bound(beta1, beta2, step_b)
        # |m| <= C_raw sqrt(v) needs both EMAs of one history: not through 8-bit rounding,
        # nor for an EMA without its (1 - b1) (apex LAMB's grad_averaging=False).
        check_m = quant is None and hb.options.get("grad_averaging") is not False
        v_allow: torch.Tensor | None = None
        if quant is not None:
            codes, qmap, scale = quant
            v_allow = bnb.per_element(scale, meta.numel) * quantised_floor_allowance(
                k, bnb.code_gap(qmap)
            )
        decay_k = beta2**k
        # Moments stored in a narrow dtype (torchtitan's bf16 optimizer states, Megatron's
        # --exp-avg-dtype) are rounded once per save: their bounds widen by that rounding.
        store_eps = max(
            storage_eps(sa["exp_avg_sq"]),
            storage_eps(sb["exp_avg_sq"]),
            storage_eps(sb["exp_avg"]),
        )
    if moments or restart:
        streams = [sa["exp_avg"], sb["exp_avg"], sa["exp_avg_sq"], sb["exp_avg_sq"]]
        for t in streams:
            if tuple(t.shape) != meta.shape:
                raise IncompatibleCheckpoints(
                    f"{name}: optimizer moment of shape {list(t.shape)} for a parameter of shape {list(meta.shape)}"
                )
    is_float = lim is not None
    # A fused MoE tensor ([E, ...]): its statistics per expert too, from the same chunks; one
    # expert's own tensor (`experts.3.w1`) as one slice, stacked with its peers' afterwards.
    n_exp = expert_slices(name, meta.shape, pair.n_experts) if is_float else None
    eacc = None
    if n_exp is not None:
        eacc = ExpertAcc(n_exp, meta.numel)
        if moments:
            assert hb is not None and hb.betas is not None
            eacc = ExpertAcc(n_exp, meta.numel, k=k, betas=hb.betas, store_eps=store_eps)
    kern = load_kernels(cfg)
    stage = Staging(cfg.device)
    moment_streams = [t.reshape(-1) for t in streams] if moments or restart else []
    for lo, wa in flat_chunks(wa_full, cfg.chunk_elems):
        hi = lo + wa.numel()
        wb = wb_full.reshape(-1)[lo:hi]
        if not is_float:
            acc.add(changed=(stage(wa, 0) != stage(wb, 1)).sum())
            release_all(a, b, wa, wb)
            continue
        w = Pair(wa, wb, stage)
        dmax = weight_stats(w, kern, acc)  # max |dw| of the chunk where every dw is finite
        if restart:
            assert restart_floor is not None
            va, vb = (stage(t[lo:hi], 4 + i).float() for i, t in enumerate(moment_streams[2:]))
            allow = restart_allow[lo:hi] if restart_allow is not None else 0.0
            acc.add(
                restart_low=torch.count_nonzero((vb < va * restart_floor - allow) & (va > 0)),
                restart_n=torch.count_nonzero(va > 0),
            )
            release_all(a, b, *(t[lo:hi] for t in moment_streams))
        if moments:
            raw = [t[lo:hi] for t in moment_streams]
            st = cfg.share_stride if wa.numel() >= 1 << 16 else 1
            thr = cfg.rho_threshold
            slack = 1 + cfg.bound_slack + 2 * store_eps
            # v floor: v_B >= beta2^k v_A; fp32 rounding allows a few ulps per step, a
            # narrow storage dtype its rounding at every step (Megatron's precision-aware
            # optimizer and pure-bf16 AdamW store the moment in bf16 after each update),
            # 8-bit codes k code gaps of the block's absmax (`quantised_floor_allowance`).
            floor_k = decay_k * (1 - 1e-6 * (k + 4)) * (1 - (k + 1) * store_eps)
            c_mb = c_raw_b * slack
            ms = (
                kern.moments(*raw, stride=st, thr=thr, eps=eps, floor_k=floor_k, c_mb=c_mb)
                if kern is not None
                else None
            )
            mo = Moments(raw, stage)
            if ms is None:
                moment_stats_torch(mo, acc, st, thr, eps)
            else:
                moment_stats_fused(ms, mo, acc)
            if mbound_ is not None and mbound_.sharp:
                # Update bound: |dw| <= k (per_step + decay |w|), plus one storage ulp each
                # side. Only elements past the weight-free part need the full bound.
                bound_check(
                    w,
                    dmax,
                    k * mbound_.per_step * slack,
                    k * mbound_.decay * slack,
                    lim.eps,
                    lo,
                    meta.shape,
                    cands,
                    counts,
                    cfg,
                )
            elif mbound_ is not None:
                isolated_chunk(w, dmax, lim.eps, None, 0.0, lo, meta.shape, cands, counts, cfg)
            # The kernel's count of v_B < floor_k v_A is a superset of the elements under
            # the floor less the 8-bit allowance: torch reruns the exact test, and keeps
            # the evidence, only on a chunk where it is not 0.
            if ms is None or ms.low:
                va, vb = mo.va, mo.vb
                allow = v_allow[lo:hi] if v_allow is not None else 0.0
                low = vb < va * floor_k - allow
                if bool(low.any()):
                    idx = torch.nonzero(low).flatten()
                    limits = va[idx] * floor_k - (
                        allow[idx] if isinstance(allow, torch.Tensor) else 0.0
                    )
                    collect(
                        cands, counts, "vfloor", "exp_avg_sq", idx, va, vb, "at_least", limits, lo, meta.shape, sb["exp_avg_sq"].dtype, cfg,
                        explain=code_flips(quant, lo) if quant is not None else None,
                    )  # fmt: skip
            # |m_B| <= C_raw sqrt(v_B): the raw EMAs obey Cauchy-Schwarz at every step.
            if check_m and (ms is None or ms.big):
                ma, mb, sq_b = mo.ma, mo.mb, sqrt32(mo.vb)
                big = mb.abs() > sq_b * c_mb
                if bool(big.any()):
                    idx = torch.nonzero(big).flatten()
                    collect(
                        cands,
                        counts,
                        "mbound",
                        "exp_avg",
                        idx,
                        ma,
                        mb,
                        "abs_within",
                        sq_b[idx] * c_mb,
                        lo,
                        meta.shape,
                        sb["exp_avg"].dtype,
                        cfg,
                    )
            if eacc is not None:
                eacc.add(lo, w, mo)
            release_all(a, b, *raw)
        elif obound is not None and math.isfinite(obound.per_step) and obound.sharp:
            # The family's own per-element bound (Lion's exact lr, Muon's spectral norm).
            slack = 1 + cfg.bound_slack
            bound_check(
                w,
                dmax,
                o_k * obound.per_step * slack,
                o_k * obound.decay * slack,
                lim.eps,
                lo,
                meta.shape,
                cands,
                counts,
                cfg,
            )
        else:
            bufs = (
                tuple(
                    stage(x.reshape(-1)[lo:hi], 2 + i).float().abs() for i, x in enumerate(sgd_bufs)
                )
                if sgd_bufs is not None
                else None
            )
            isolated_chunk(w, dmax, lim.eps, bufs, o_k * o_lr, lo, meta.shape, cands, counts, cfg)  # type: ignore[arg-type]
        if eacc is not None and not moments:
            eacc.add(lo, w, None)
        release_all(a, b, wa, wb)

    if other and (o_floor is not None or o_restart_floor is not None):
        assert fam is not None
        factored_floor(
            sa, sb, fam.second_moments, o_floor, o_restart_floor, acc, cands, counts, cfg
        )
    a.forget(name)
    b.forget(name)
    s, m = acc.sums, acc.maxes
    kk = k if k > 0 else o_k
    steps = (
        kk
        if kk > 0
        else max(1, (pair.step_b or 1) - (pair.step_a or 0))
        if pair.step_a is not None
        else 1
    )
    w_norm = math.sqrt(s.get("wa2", 0.0))
    dw_norm = math.sqrt(s.get("d2", 0.0))
    bmax = m.get("bmax", 0.0)
    if obound is not None and obound.rms is not None and meta.numel > 0:
        # The tensor as a whole: RMS(dw) <= k (rms + decay RMS(w)) (Adafactor's update clipping).
        rms_w = max(w_norm / math.sqrt(meta.numel), _rms(wb_full))
        allowed = (
            o_k * (obound.rms + obound.decay * rms_w) * (1 + cfg.bound_slack) + 2 * lim.eps * rms_w
            if lim
            else math.inf
        )
        if dw_norm / math.sqrt(meta.numel) > allowed:
            counts["norm"] += 1
    out: dict[str, Any] = dict(
        name=name,
        role=role,
        shape=meta.shape,
        dtype=dtype_name(meta.dtype),
        numel=meta.numel,
        w_norm_a=w_norm,
        dw_norm=dw_norm,
        dw_max_abs=m.get("dmax", 0.0),
        update_ratio=dw_norm / w_norm / steps if w_norm > 0 else math.nan,
        max_abs_b=bmax,
        headroom_b=(lim.max / bmax) if lim and bmax > 0 else math.inf,
        nonfinite_a=int(s.get("nfa", 0)),
        nonfinite_b=int(s.get("nfb", 0)),
        bound_violations=counts["bound"],
        vfloor_violations=counts["vfloor"],
        mbound_violations=counts["mbound"],
        outlier_changes=counts["outlier"],
        norm_violations=counts["norm"],
        candidates=tuple(cands),
        group=hb.index if hb is not None else None,
        eps=hb.eps if hb is not None else math.nan,
        family=family,
        k=kk if kk > 0 else 0,
        lr=o_lr if other else math.nan,
    )
    if eacc is not None:
        out["experts"] = eacc.result(steps=steps, lr=lr if moments else o_lr, step_a=step_a)
    if restart and s.get("restart_n", 0) > 0:
        out["restart_share"] = s["restart_low"] / s["restart_n"]
    if other and "restart_n" in s and s["restart_n"] > 0:
        out["restart_share"] = s["restart_low"] / s["restart_n"]
    if moments:
        # r_v = sum(v_B - b2^k v_A) / sum((1 - b2^k) v_hat_A): the mean g^2 the window
        # implies over the running average before it; v_A is bias-corrected, as it is
        # (1 - b2^t) times too small early in training.
        den = (1 - decay_k) * s["sum_va"] / (1 - beta2**step_a) if step_a > 0 else math.inf
        out.update(
            has_moments=True,
            k=k,
            lr=lr,
            r_v=(s["sum_vb"] - decay_k * s["sum_va"]) / den if den > 0 else math.inf,
            rho_share_a=s["rho_a"] / s["sampled"],
            rho_share_b=s["rho_b"] / s["sampled"],
            vanished_share_a=s["van_a"] / s["sampled"],
            vanished_share_b=s["van_b"] / s["sampled"],
            nonfinite_m_b=int(s.get("nfm", 0)),
            nonfinite_v_b=int(s.get("nfv", 0)),
            max_abs_m_b=m["mmax"],
            max_v_b=m["vmax"],
            moment_headroom_b=torch.finfo(torch.float32).max / m["vmax"]
            if m["vmax"] > 0
            else math.inf,
        )
        if g_steps is not None and g_steps == k and s.get("v_n", 0) > 0:
            out["restart_share"] = counts["vfloor"] / s["v_n"]
    return TensorDiff(**out)


def _rms(t: torch.Tensor) -> float:
    n = t.numel()
    return float(torch.linalg.vector_norm(t.float())) / math.sqrt(n) if n else 0.0
