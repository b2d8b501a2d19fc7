"""Detectors over a checkpoint diff (weights and Adam moments of a pair): each a pure
function `(DiffResult, Thresholds) -> list[Finding]`, registered in `DIFF_DETECTORS`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from ..diff import DiffResult, TensorDiff
from ..tensors import lr_growth_limit, robust_z
from .base import Finding, Thresholds, cap, module_of, with_id

__all__ = ["DIFF_DETECTORS", "diff_findings"]


def diff_findings(diff: DiffResult, th: Thresholds | None = None) -> list[Finding]:
    """Every detector that needs no replay, over one diff; ids assigned in order."""
    th = th or Thresholds()
    raw: list[Finding] = []
    for det in DIFF_DETECTORS:
        raw.extend(det(diff, th))
    if diff.pair.weights_only:
        raw.append(
            Finding(
                "",
                "weights_only",
                "run",
                1.0,
                "info",
                {},
                "no optimizer state in the pair: weights compared among peers only, no update checked against Adam's bounds",
                "docs/signatures.md#adam-update-bound",
                (),
            )
        )
    return [with_id(f, i + 1) for i, f in enumerate(raw)]


def _violations(t: TensorDiff) -> int:
    return (
        t.bound_violations
        + t.vfloor_violations
        + t.mbound_violations
        + t.outlier_changes
        + t.norm_violations
    )


# How messages name the optimizer family whose bound a tensor broke.
_FAMILY_NAMES = {
    "adam": "Adam",
    "lamb": "LAMB",
    "lion": "Lion",
    "adafactor": "Adafactor",
    "muon": "Muon",
    "sgd": "SGD",
    "adam8bit": "8-bit Adam",
}


def detect_corruption(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Adam update bound, v floor and |m| <= C sqrt(v): no gradient can break them.

    Violations confined to a few elements are the silent-corruption signature (a bit
    flip cannot hide there); violations everywhere mean the recorded LR or optimizer
    is not what ran, which is a different finding.
    """
    if _moments_restarted(diff):
        # Second moments under their floor almost everywhere are a restart of the optimizer
        # (detect_optimizer_state_lost), not elements any fault flipped: judge the rest.
        diff = DiffResult(
            pair=diff.pair,
            tensors=[dataclasses.replace(t, vfloor_violations=0) for t in diff.tensors],
        )
    bad = [t for t in diff.tensors if _violations(t) > 0]
    if not bad:
        return []
    confined = len(bad) <= th.confined_tensors and all(
        _violations(t) <= max(8, th.confined_share * t.numel) for t in bad
    )
    if not confined:
        total = sum(_violations(t) for t in bad)
        return [
            Finding(
                "",
                "update_bound_exceeded_widely",
                "run",
                cap(len(bad) / th.confined_tensors),
                "warning",
                {"tensors": len(bad), "elements": total, "confined_tensors": th.confined_tensors},
                f"{total} elements in {len(bad)} tensors moved further than {_FAMILY_NAMES.get(bad[0].family, 'Adam')} allows at the recorded LR: "
                "the LR that ran was higher than recorded, or the optimizer is not the recorded one",
                "docs/signatures.md#adam-update-bound",
                ("lr_too_high",),
            )
        ]
    out = []
    for t in bad:
        flips = [c for c in t.candidates if c.kind == "bit_flip"]
        elems = [
            {
                "where": c.where,
                "index": list(c.index),
                "before": c.before,
                "after": c.after,
                "bound": c.bound,
                "kind": c.kind,
                "bit": c.bit,
                "bit_field": c.bit_field,
            }
            for c in t.candidates
        ]
        worst = max(
            (abs(c.after - c.before) / c.bound for c in t.candidates if c.bound and c.bound > 0),
            default=1.0,
        )
        opt = _FAMILY_NAMES.get(t.family, "Adam")
        what = (
            f"one stored bit ({flips[0].bit_field} bit {flips[0].bit}) away from a value {opt} could reach"
            if flips
            else f"beyond any {opt} step"
        )
        out.append(
            Finding(
                "",
                "adam_bound_violation" if not t.outlier_changes else "isolated_change",
                t.name,
                cap(worst) if flips else cap(worst) / 2,
                "critical",
                {
                    "violations": _violations(t),
                    "bound_violations": t.bound_violations,
                    "vfloor_violations": t.vfloor_violations,
                    "mbound_violations": t.mbound_violations,
                    "outlier_changes": t.outlier_changes,
                    "norm_violations": t.norm_violations,
                    "family": t.family,
                    "elements": elems,
                },
                f"{_violations(t)} element(s) of {t.name} changed {what}: the silent-corruption signature",
                "docs/signatures.md#adam-update-bound, #v-floor, #power-of-two-jump",
                ("silent_corruption",),
                primary=True,
            )
        )
    return out


def _overflow_cause(dtype: str) -> tuple[str, ...]:
    return {
        "fp16": ("fp16_overflow", "gradient_explosion"),
        "bf16": ("bf16_overflow", "gradient_explosion"),
    }.get(dtype, ("gradient_explosion",))


def detect_nonfinite(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Non-finite weights or moments in *after* that *before* did not have."""
    out = []
    for t in diff.tensors:
        new_w = t.nonfinite_b - t.nonfinite_a
        if new_w <= 0 and t.nonfinite_m_b == 0 and t.nonfinite_v_b == 0:
            continue
        out.append(
            Finding(
                "",
                "nonfinite",
                t.name,
                cap(max(new_w, t.nonfinite_m_b, t.nonfinite_v_b) / max(1, t.numel) * 100 + 1),
                "critical",
                {
                    "weights": t.nonfinite_b,
                    "weights_before": t.nonfinite_a,
                    "exp_avg": t.nonfinite_m_b,
                    "exp_avg_sq": t.nonfinite_v_b,
                },
                f"{t.name}: {max(new_w, 0)} non-finite weights, {t.nonfinite_m_b} in exp_avg, {t.nonfinite_v_b} in exp_avg_sq after the window",
                "docs/signatures.md#dtype-range",
                _overflow_cause(t.dtype),
                primary=t.dtype in ("fp16", "bf16"),
            )
        )
    return out


def detect_dtype_range(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """max|x| against the storage dtype's max (fp16 65504, bf16 3.39e38)."""
    out = []
    for t in diff.tensors:
        for where, head, mx in (
            ("weight", t.headroom_b, t.max_abs_b),
            ("exp_avg_sq", t.moment_headroom_b, t.max_v_b),
        ):
            if not math.isfinite(head) or head >= th.headroom_warn:
                continue
            dtype = t.dtype if where == "weight" else "fp32"
            over = head <= 1.0
            out.append(
                Finding(
                    "",
                    "dtype_overflow" if over else "dtype_headroom",
                    t.name,
                    cap(th.headroom_warn / max(head, 1e-30)),
                    "critical" if over else "warning",
                    {
                        "where": where,
                        "dtype": dtype,
                        "max_abs": mx,
                        "headroom": head,
                        "warn_below": th.headroom_warn,
                    },
                    f"{t.name} ({where}, {dtype}) reaches {mx:.3g}, {'at' if over else 'within 2x of'} the dtype's limit",
                    "docs/signatures.md#dtype-range",
                    _overflow_cause(dtype),
                    primary=dtype in ("fp16", "bf16"),
                )
            )
    return out


def detect_skipped_steps(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Optimizer steps vs trainer steps, and the loss scaler's backoff.

    Dynamic loss scaling backs off (and skips that step) by design whenever the scale has
    grown into an overflow, once per growth_interval (torch GradScaler, DeepSpeed, Megatron):
    up to `th.routine_backoffs` halvings, each with its one skipped step, is normal
    operation (info, no cause). More, or a scale driven to 1 / by 8 halvings, is evidence.
    """
    p = diff.pair
    out = []
    drops = 0.0
    collapse = False
    if p.loss_scale_a and p.loss_scale_b is not None and p.loss_scale_b < p.loss_scale_a:
        drops = math.log2(p.loss_scale_a / max(p.loss_scale_b, 1e-30))
        collapse = p.loss_scale_b <= 1.0 or drops >= 8
    routine = not collapse and drops <= th.routine_backoffs
    if None not in (p.step_a, p.step_b, p.adam_step_a, p.adam_step_b):
        g = p.step_b - p.step_a  # type: ignore[operator]
        k = p.adam_step_b - p.adam_step_a  # type: ignore[operator]
        if 0 <= k < g and p.skip_optimizer and not p.loss_scale_a:
            # OLMo-core's SkipStep optimizers skip a step whose loss or grad norm is an
            # outlier of the last steps (replay/skipstep.py): the optimizer's own guard,
            # not an overflow; the replay finds the steps and judges their spikes.
            out.append(
                Finding(
                    "",
                    "skipped_steps",
                    "run",
                    cap((g - k) / max(1, g) * 10),
                    "info",
                    {"trainer_steps": g, "optimizer_steps": k, "optimizer": p.skip_optimizer},
                    f"{g - k} of {g} steps skipped the optimizer update: {p.skip_optimizer} skips a step whose loss or grad norm is an outlier of the last steps",
                    "docs/signatures.md#skipped-steps",
                    (),
                )
            )
        elif 0 <= k < g:
            # One skipped step per backoff (a single one even where the scaler state was not
            # saved, as nanoGPT does not) is the scaler's routine.
            # Each backoff skips one step and the scale regrows in between, so skips, not
            # the net halvings, are what is counted against the routine allowance.
            normal = routine and g - k <= max(1, th.routine_backoffs)
            out.append(
                Finding(
                    "",
                    "skipped_steps",
                    "run",
                    cap((g - k) / max(1, g) * 10),
                    "info" if normal else "warning",
                    {"trainer_steps": g, "optimizer_steps": k},
                    f"{g - k} of {g} steps skipped the optimizer update (overflowing gradients under a loss scaler)"
                    + (
                        ": one per loss-scale backoff, dynamic loss scaling's normal operation"
                        if normal
                        else ""
                    ),
                    "docs/signatures.md#skipped-steps",
                    () if normal else ("fp16_overflow", "loss_scale_collapse"),
                    primary=not normal,
                )
            )
    if drops > 0 and routine:
        out.append(
            Finding(
                "",
                "loss_scale_backoff",
                "run",
                cap(drops),
                "info",
                {"scale_before": p.loss_scale_a, "scale_after": p.loss_scale_b, "halvings": drops},
                f"loss scale fell from {p.loss_scale_a:g} to {p.loss_scale_b:g} ({drops:.0f} halvings): routine under dynamic loss scaling",
                "docs/signatures.md#skipped-steps; torch.amp.GradScaler backoff_factor 0.5 per overflow",
                (),
            )
        )
    elif drops > 0:
        out.append(
            Finding(
                "",
                "loss_scale_collapse" if collapse else "loss_scale_backoff",
                "run",
                cap(drops),
                "critical" if collapse else "warning",
                {"scale_before": p.loss_scale_a, "scale_after": p.loss_scale_b, "halvings": drops},
                f"loss scale fell from {p.loss_scale_a:g} to {p.loss_scale_b:g} ({drops:.0f} halvings)",
                "docs/signatures.md#skipped-steps",
                ("loss_scale_collapse", "fp16_overflow") if collapse else ("fp16_overflow",),
                primary=True,
            )
        )
    return out


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
    """
    out = []
    for t in diff.tensors:
        if not t.has_moments or not math.isfinite(t.vanished_share_a) or not math.isfinite(t.r_v):
            continue
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


# The optimizer's state restarts at a resume (docs/signatures.md#optimizer-state-lost): a step
# counter never runs backwards, and a second moment never falls under its decay floor; a
# share of elements under it beyond RESTART_SHARE in most tensors is a restart, not a flip.
RESTART_SHARE = 0.5


def _restart_shares(diff: DiffResult) -> np.ndarray:
    return np.array([t.restart_share for t in diff.tensors if math.isfinite(t.restart_share)])


def _moments_restarted(diff: DiffResult) -> bool:
    """Over half the tensors (3 at least) hold most second-moment elements under the floor."""
    shares = _restart_shares(diff)
    return shares.size >= 3 and float(np.mean(shares > RESTART_SHARE)) > 0.5


def detect_optimizer_state_lost(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The optimizer's state restarted between the pair: its step counter behind where
    *before* left it, or its second moments under their decay floor almost everywhere.

    The counter of a fresh optimizer counts from the resume, so the trainer step it
    restarted at is step_B - counter_B (at or before it, if steps were skipped since).
    """
    p = diff.pair
    shares = _restart_shares(diff)
    restarted = float(np.mean(shares > RESTART_SHARE)) if shares.size else 0.0
    med = float(np.median(shares)) if shares.size else math.nan
    counter_back = (
        p.adam_step_a is not None and p.adam_step_b is not None and p.adam_step_b < p.adam_step_a
    )
    moments_restart = _moments_restarted(diff)
    if not (counter_back or moments_restart):
        return []
    resume = None
    if (
        p.step_b is not None
        and p.adam_step_b is not None
        and (p.step_a is None or p.step_b - p.adam_step_b >= p.step_a)
    ):
        resume = p.step_b - p.adam_step_b
        # Skipped steps since the resume (loss-scale backoffs) make the counter trail by
        # them: a resume starts from a checkpoint, and *before* is the one within them.
        if p.step_a is not None and resume - p.step_a <= max(th.routine_backoffs, 1):
            resume = p.step_a
    why = []
    if counter_back:
        why.append(
            f"the optimizer's step counter went back from {p.adam_step_a} to {p.adam_step_b} while the trainer went from step {p.step_a} to {p.step_b}"
        )
    if shares.size:
        why.append(
            f"{restarted:.0%} of tensors hold second moments under their decay floor on over half their elements (median share {med:.0%})"
        )
    at = f"; the fresh optimizer started at step {resume}" if resume is not None else ""
    return [
        Finding(
            "",
            "optimizer_state_lost",
            "run",
            cap(10.0 * (1.0 + restarted)),
            "critical",
            {
                "resume_step": resume,
                "optimizer_step_before": p.adam_step_a,
                "optimizer_step_after": p.adam_step_b,
                "trainer_step_before": p.step_a,
                "trainer_step_after": p.step_b,
                "tensors_restarted": restarted,
                "median_restart_share": med,
                "restart_share_threshold": RESTART_SHARE,
            },
            f"the optimizer state was lost at a resume{at}: " + "; ".join(why),
            "docs/signatures.md#optimizer-state-lost",
            ("optimizer_state_lost",),
            primary=True,
        )
    ]


def _int(d: dict | None, key: str) -> int | None:
    v = (d or {}).get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def detect_scheduler_restart(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The LR scheduler's `last_epoch` (the number of its `step()` calls) ran backwards
    between the pair: it was rebuilt at a resume without its state, and re-runs its warm-up."""
    p = diff.pair
    ea, eb = _int(p.scheduler_a, "last_epoch"), _int(p.scheduler_b, "last_epoch")
    if ea is None or eb is None or eb >= ea:
        return []
    resume = (
        p.step_b - eb
        if p.step_b is not None and (p.step_a is None or p.step_b - eb >= p.step_a)
        else None
    )
    lrs = f" (LR {p.lr_a[0]:.3g} -> {p.lr_b[0]:.3g})" if p.lr_a and p.lr_b else ""
    return [
        Finding(
            "",
            "lr_scheduler_restarted",
            "run",
            cap(ea / max(eb, 1)),
            "critical",
            {
                "last_epoch_before": ea,
                "last_epoch_after": eb,
                "resume_step": resume,
                "trainer_step_before": p.step_a,
                "trainer_step_after": p.step_b,
            },
            f"the LR scheduler restarted{f' at step {resume}' if resume is not None else ''}: its last_epoch went back from {ea} to {eb}{lrs}, so the LR re-runs its schedule from the start",
            "docs/signatures.md#lr-scheduler-restarted",
            ("lr_scheduler_restarted",),
            primary=True,
        )
    ]


def detect_scaler_reset(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """The loss scaler's state does not follow from *before*'s by any run of its own rule
    (torch.amp.GradScaler.update: x growth_factor after growth_interval clean steps, x
    backoff_factor and a skipped step on an overflow): it was rebuilt at a resume.

    Impossible: a scale grown more than the clean steps allow; a scale that fell with no
    skipped step; a scale unchanged whose growth tracker did not advance by the clean steps.
    """
    p = diff.pair
    sa, sb = p.scaler_a or {}, p.scaler_b or {}
    la, lb = p.loss_scale_a, p.loss_scale_b
    if not la or not lb or p.step_a is None or p.step_b is None or p.step_b <= p.step_a:
        return []
    g = p.step_b - p.step_a
    interval = _int(sa, "growth_interval") or 2000
    factor = float(sa.get("growth_factor") or 2.0)
    ta, tb = _int(sa, "_growth_tracker"), _int(sb, "_growth_tracker")
    k = (
        p.adam_step_b - p.adam_step_a
        if p.adam_step_a is not None and p.adam_step_b is not None
        else None
    )
    counter_ok = k is not None and 0 <= k <= g
    why = None
    # At most one growth per growth_interval clean steps, counted from before's tracker.
    max_growth = factor ** (((ta if ta is not None else interval - 1) + g) // interval)
    if lb > la * max_growth * (1 + 1e-6):
        why = f"the scale grew from {la:g} to {lb:g} in {g} steps, more than growth_interval {interval} allows (x{max_growth:g})"
    elif counter_ok and k == g and lb < la:
        why = f"the scale fell from {la:g} to {lb:g} though no optimizer step was skipped (every backoff skips one)"
    elif (
        counter_ok
        and k == g
        and lb == la
        and ta is not None
        and tb is not None
        and g < interval - ta
        and tb != ta + g
    ):
        why = f"the scale stayed {lb:g} but its growth tracker went from {ta} to {tb} over {g} clean steps (it counts them)"
    if why is None:
        return []
    resume = p.step_b - tb if tb is not None and p.step_b - tb >= p.step_a else None
    return [
        Finding(
            "",
            "loss_scaler_reset",
            "run",
            5.0,
            "critical",
            {
                "scale_before": la,
                "scale_after": lb,
                "tracker_before": ta,
                "tracker_after": tb,
                "growth_interval": interval,
                "resume_step": resume,
            },
            f"the loss scaler was rebuilt at a resume{f' (at step {resume} or before)' if resume is not None else ''}: {why}",
            "docs/signatures.md#loss-scaler-reset",
            ("loss_scaler_reset",),
            primary=True,
        )
    ]


DiffDetector = Callable[[DiffResult, Thresholds], list[Finding]]
# Every detector over a diff, in the order its findings are numbered.
DIFF_DETECTORS: tuple[DiffDetector, ...] = (
    detect_corruption,
    detect_nonfinite,
    detect_dtype_range,
    detect_skipped_steps,
    detect_lr,
    detect_update_ratio,
    detect_gradient_burst,
    detect_vanished_burst,
    detect_sign_like,
    detect_optimizer_state_lost,
    detect_scheduler_restart,
    detect_scaler_reset,
)
