"""How far the step moved each tensor: LR changes, update/weight ratios, implied gradient
bursts (a vanished second moment's too) and sign-like updates, each judged among peers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ckptforensics import optim
from ckptforensics.core.tensors import lr_growth_limit, robust_z
from ckptforensics.detectors.base import Finding, Thresholds, cap, module_of
from ckptforensics.engine.diff.pair import DiffResult, TensorDiff

__all__ = [
    "detect_lr",
    "detect_update_ratio",
    "detect_gradient_burst",
    "detect_vanished_burst",
    "detect_sign_like",
]


def _group_members(diff: DiffResult, g: int) -> tuple[list[str], float]:
    """Modules of param group `g` and the group's share of all parameters."""
    total = sum(t.numel for t in diff.tensors) or 1
    mine = [t for t in diff.tensors if t.group == g]
    mods = list(dict.fromkeys(module_of(t.name) for t in mine))
    return mods, sum(t.numel for t in mine) / total


def _lr_supports(share: float) -> tuple[str, ...]:
    """An LR fault confined to a few modules shows as those modules exploding."""
    return ("gradient_explosion", "lr_too_high") if share < 0.5 else ("lr_too_high",)


def detect_lr(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The recorded LR: above the schedule's base, or grown faster than warmup can.

    A group holding a minority of the parameters (a per-module LR multiplier) names
    its modules: they are the ones that blow up.
    """
    p = diff.pair
    out = []
    for g, lb in enumerate(p.lr_b):
        la = p.lr_a[g] if g < len(p.lr_a) else None
        base = p.base_lr[g] if g < len(p.base_lr) else None
        mods, share = _group_members(diff, g)
        who = (
            f" ({', '.join(mods[:3])}{', ...' if len(mods) > 3 else ''}; {share:.0%} of parameters)"
            if share < 0.5
            else ""
        )
        if base and lb > th.lr_over_base * base:
            # The LR stored in *before* is the one its next step uses: already above the
            # schedule there means the window's first step is the first bad one.
            first = (
                (p.step_a + 1)
                if (la and p.step_a is not None and la > th.lr_over_base * base)
                else None
            )
            out.append(
                Finding(
                    "",
                    "lr_above_schedule",
                    f"param_group[{g}]",
                    cap(lb / base / th.lr_over_base),
                    "critical",
                    {
                        "lr_after": lb,
                        "base_lr": base,
                        "factor": lb / base,
                        "limit": th.lr_over_base,
                        "modules": mods,
                        "param_share": share,
                        "first_step": first,
                    },
                    f"param group {g}{who} runs at LR {lb:.3g}, {lb / base:.1f}x the schedule's base {base:.3g}",
                    "docs/signatures.md#update-weight-ratio; schedules never exceed their base LR",
                    _lr_supports(share),
                    primary=True,
                )
            )
        if la and la > 0 and p.step_a and p.step_b and p.step_a > 0:
            # A linear warmup from zero grows LR by step_b/step_a at most.
            allowed = lr_growth_limit(p.step_a, p.step_b, th.lr_growth_margin)
            if lb / la > allowed:
                out.append(
                    Finding(
                        "",
                        "lr_jump",
                        f"param_group[{g}]",
                        cap(lb / la / allowed),
                        "critical",
                        {
                            "lr_before": la,
                            "lr_after": lb,
                            "growth": lb / la,
                            "allowed": allowed,
                            "modules": mods,
                            "param_share": share,
                        },
                        f"param group {g}{who}: LR rose {lb / la:.1f}x between steps {p.step_a} and {p.step_b}, "
                        f"more than any warmup allows ({allowed:.1f}x)",
                        "docs/signatures.md#update-weight-ratio",
                        _lr_supports(share),
                        primary=True,
                    )
                )
    return out


def detect_update_ratio(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """||dw||/||w|| per step, uniformly high across weight matrices: context, not evidence.

    Adam's first updates are sign-like, each element moving by about the LR, so a small
    model near its initialisation moves 0.1-0.5 of its norm per step at a healthy LR
    (tuning draws 1113, 1118, 1186: 0.10-0.15 at steps 5-10). From one pair, a high ratio
    cannot tell an LR too high for the model from a young model: it is reported (info),
    and an LR fault is named by the LR findings, the bounds and the replay."""
    ratios = np.array(
        [
            t.update_ratio
            for t in diff.tensors
            if len(t.shape) >= 2 and math.isfinite(t.update_ratio)
        ]
    )
    if ratios.size == 0:
        return []
    med = float(np.median(ratios))
    if med <= th.update_ratio:
        return []
    return [
        Finding(
            "",
            "update_ratio_high",
            "run",
            cap(med / th.update_ratio),
            "info",
            {
                "median_update_ratio": med,
                "max_update_ratio": float(ratios.max()),
                "threshold": th.update_ratio,
            },
            f"weight matrices move {med:.2g} of their norm per step (median), {med / th.update_ratio:.0f}x the alarm level",
            "docs/signatures.md#update-weight-ratio",
            ("lr_too_high",),
        )
    ]


def _z_by_role(tensors: Sequence[TensorDiff], values: np.ndarray) -> np.ndarray:
    """Robust z of each value among tensors of its role (all tensors if a role has < 4)."""
    z = np.zeros_like(values)
    roles = np.array([t.role for t in tensors])
    overall = robust_z(values, floor=0.05)
    for role in set(roles):
        idx = np.flatnonzero(roles == role)
        z[idx] = robust_z(values[idx], floor=0.05) if idx.size >= 4 else overall[idx]
    return z


def detect_gradient_burst(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """r_v = implied mean g^2 over the window / v_A; a tensor far above its peers exploded."""
    ts = [t for t in diff.tensors if t.has_moments and math.isfinite(t.r_v)]
    if len(ts) < 3:
        return []
    rv = np.array([max(t.r_v, 1e-12) for t in ts])
    logs = np.log10(rv)
    z = _z_by_role(ts, logs)
    out = []
    med = float(np.median(rv))
    if med > th.burst:
        out.append(
            Finding(
                "",
                "gradient_burst_global",
                "run",
                cap(med / th.burst),
                "warning",
                {"median_r_v": med, "threshold": th.burst},
                f"gradient energy over the window is {med:.3g}x its running average in the median tensor",
                "docs/signatures.md#gradient-burst",
                ("gradient_explosion", "lr_too_high", "poison_batch"),
            )
        )
    for t, r, zz in sorted(zip(ts, rv, z, strict=True), key=lambda x: -x[2]):
        if r > th.burst and zz > th.z:
            out.append(
                Finding(
                    "",
                    "gradient_burst",
                    t.name,
                    cap(min(zz / th.z, r / th.burst)),
                    "warning",
                    {
                        "r_v": float(r),
                        "robust_z": float(zz),
                        "role": t.role,
                        "z_threshold": th.z,
                        "burst": th.burst,
                    },
                    f"{module_of(t.name)}: gradient energy {r:.3g}x its running average (robust z {zz:.1f} among {t.role} tensors)",
                    "docs/signatures.md#gradient-burst (OLMo-core 6 sigma)",
                    ("gradient_explosion",),
                )
            )
    return out


def detect_vanished_burst(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """exp_avg_sq collapsed (sqrt(v) < 10 eps) before a gradient burst: Adam's instability.

    With v near zero, Adam turns any returning gradient into an update of size ~lr on
    every element at once (Molybog 2304.09871): the burst is the optimizer's doing,
    so this is direct evidence for adam_instability, not only for a gradient burst.

    Not under an optimizer whose step is scaled to the weight's norm (`Family.weight_scale`:
    LAMB's trust ratio ||w|| / ||update||): a collapsed v cannot make the layer's step near-maximal
    (drawn run 1569: an LR jump under LAMB was dated to the window's first step by it).
    """
    out = []
    for t in diff.tensors:
        if not t.has_moments or not math.isfinite(t.vanished_share_a) or not math.isfinite(t.r_v):
            continue
        fam = optim.find(t.family)
        if fam is not None and fam.weight_scale({}):
            continue  # its step is scaled to the weight's norm (LAMB's trust ratio)
        if t.vanished_share_a > th.rho_share and t.r_v > th.burst:
            out.append(
                Finding(
                    "",
                    "vanished_v_burst",
                    t.name,
                    cap(t.vanished_share_a / th.rho_share * math.log10(t.r_v)),
                    "warning",
                    {
                        "vanished_share_before": t.vanished_share_a,
                        "vanished_share_after": t.vanished_share_b,
                        "r_v": t.r_v,
                        "threshold": th.burst,
                        "eps": t.eps,
                    },
                    f"{module_of(t.name)}: exp_avg_sq had collapsed (sqrt(v) < 10 eps on {t.vanished_share_a:.0%} of elements) "
                    f"before a gradient burst ({t.r_v:.3g}x): Adam turned it into near-maximal updates",
                    "docs/signatures.md#sign-like-updates, sqrt(v) < 10 eps (Molybog 2304.09871)",
                    ("adam_instability",),
                    primary=True,
                )
            )
    return out


def detect_sign_like(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Sign-like Adam updates rising from A to B, far beyond the tensor's peers.

    Early in training small vectors (norm gains, biases) move sign-like as a group;
    that is not the instability, so the rise must also stand out among tensors of
    the same role (robust z), not only cross an absolute share; and only weight
    matrices count, as in the instability's description.
    """
    ts = [
        t
        for t in diff.tensors
        if t.has_moments and len(t.shape) >= 2 and math.isfinite(t.rho_share_b)
    ]
    if len(ts) < 3:
        return []
    z = _z_by_role(ts, np.array([t.rho_share_b - t.rho_share_a for t in ts]))
    out = []
    for t, zz in zip(ts, z, strict=True):
        rise = t.rho_share_b - t.rho_share_a
        if t.rho_share_b > th.rho_share and rise > th.rho_share / 2 and zz > th.z:
            out.append(
                Finding(
                    "",
                    "sign_like_updates",
                    t.name,
                    cap(t.rho_share_b / th.rho_share),
                    "warning",
                    {
                        "rho_share_before": t.rho_share_a,
                        "rho_share_after": t.rho_share_b,
                        "vanished_share_after": t.vanished_share_b,
                    },
                    f"{module_of(t.name)}: {t.rho_share_b:.0%} of updates are sign-like (was {t.rho_share_a:.0%})",
                    "docs/signatures.md#sign-like-updates (Molybog 2304.09871)",
                    ("adam_instability",),
                )
            )
    return out
