"""Detectors: pure functions from statistics to Findings, each citing its signature (docs/signatures.md).

No detector opens a file, logs or prints. Thresholds are the catalogue's, named here
once; robust z-scores compare a tensor with tensors of the same role.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .diff import DiffResult, TensorDiff, tensor_role
from .tensors import (
    CURVE_FLOOR,
    CURVE_MIN_HISTORY,
    LR_GROWTH_MARGIN,
    log_curve,
    loss_follows,
    lr_growth_limit,
    robust_z,
    trend_z,
)

__all__ = ["Finding", "Thresholds", "diff_findings", "replay_findings", "first_steps_from_state", "SEVERITIES", "module_of"]

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True, slots=True)
class Finding:
    """One piece of evidence, traceable to the statistic and threshold that raised it.

    Attributes:
        id: stable within a report ('F1', 'F2', ...; assigned by `diff_findings`).
        kind: the signature ('adam_bound_violation', 'lr_jump', ...).
        subject: tensor, module or 'run'.
        score: how far past its threshold (1 = at the threshold; dimensionless).
        severity: 'info', 'warning' or 'critical'.
        metrics: the statistic(s) and the threshold used.
        message: one sentence for people.
        source: the catalogue row / paper it implements.
        supports: causes this evidence points to, strongest first.
        primary: direct evidence of a cause (a recorded LR, a flipped bit) rather than
            an effect that several causes share (a gradient burst).
    """

    id: str
    kind: str
    subject: str
    score: float
    severity: str
    metrics: dict[str, Any]
    message: str
    source: str
    supports: tuple[str, ...]
    primary: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """Detector thresholds, each with its source.

    Attributes:
        z: robust z that marks a tensor as an outlier among its peers (OLMo-core 6 sigma).
        burst: implied gradient energy r_v that counts as a burst (r_v >> 1; docs/signatures.md#gradient-burst).
        update_ratio: ||dw||/||w|| per step; healthy pre-training sits near 1e-3
            (Karpathy's update:data rule), 100x that moves a weight 10% a step.
        lr_over_base: LR above the schedule's own base/peak LR by this factor.
        lr_growth_margin: LR growth beyond what a linear warmup from zero allows, times this.
        confined_tensors: corruption touches at most this many tensors ...
        confined_share: ... and at most this share (or 8 elements) of each.
        headroom_warn: max|x| within this factor of the dtype's max.
        rho_share: share of sign-like updates (|m|/sqrt(v) > 0.9) (Molybog 2304.09871).
        routine_backoffs: loss-scale halvings between two checkpoints that dynamic loss
            scaling makes in normal operation (one per growth_interval; a window of a few
            hundred steps meets one or two with torch's default interval of 2000).
        routine_overflow: a scaled gradient within this factor of fp16's limit is the
            scaler probing its ceiling (two halvings undo it), not an overflow incident.
    """

    z: float = 6.0
    burst: float = 10.0
    update_ratio: float = 0.1
    lr_over_base: float = 1.5
    logit_max: float = 30.0
    lr_growth_margin: float = LR_GROWTH_MARGIN
    confined_tensors: int = 4
    confined_share: float = 1e-5
    headroom_warn: float = 2.0
    rho_share: float = 0.5
    routine_backoffs: int = 2
    routine_overflow: float = 4.0


def module_of(name: str) -> str:
    """'transformer.h.3.attn.c_proj.weight' -> 'transformer.h.3.attn.c_proj'."""
    return name.rsplit(".", 1)[0] if "." in name else name


def _cap(x: float, hi: float = 1e6) -> float:
    return float(min(x, hi)) if math.isfinite(x) else hi


def diff_findings(diff: DiffResult, th: Thresholds | None = None) -> list[Finding]:
    """Every detector that needs no replay, over one diff; ids assigned in order."""
    th = th or Thresholds()
    raw: list[Finding] = []
    for det in (
        detect_corruption,
        detect_nonfinite,
        detect_dtype_range,
        detect_skipped_steps,
        detect_lr,
        detect_update_ratio,
        detect_gradient_burst,
        detect_vanished_burst,
        detect_sign_like,
    ):
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
    return [_with_id(f, i + 1) for i, f in enumerate(raw)]


def _with_id(f: Finding, i: int) -> Finding:
    return Finding(f"F{i}", f.kind, f.subject, f.score, f.severity, f.metrics, f.message, f.source, f.supports, f.primary)


def _violations(t: TensorDiff) -> int:
    return t.bound_violations + t.vfloor_violations + t.mbound_violations + t.outlier_changes


def detect_corruption(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Adam update bound, v floor and |m| <= C sqrt(v): no gradient can break them.

    Violations confined to a few elements are the silent-corruption signature (a bit
    flip cannot hide there); violations everywhere mean the recorded LR or optimizer
    is not what ran, which is a different finding.
    """
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
                _cap(len(bad) / th.confined_tensors),
                "warning",
                {"tensors": len(bad), "elements": total, "confined_tensors": th.confined_tensors},
                f"{total} elements in {len(bad)} tensors moved further than Adam allows at the recorded LR: "
                "the LR that ran was higher than recorded, or the optimizer is not the recorded Adam",
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
        worst = max((abs(c.after - c.before) / c.bound for c in t.candidates if c.bound and c.bound > 0), default=1.0)
        what = (
            f"one stored bit ({flips[0].bit_field} bit {flips[0].bit}) away from a value Adam could reach"
            if flips
            else "beyond any Adam step"
        )
        out.append(
            Finding(
                "",
                "adam_bound_violation" if not t.outlier_changes else "isolated_change",
                t.name,
                _cap(worst) if flips else _cap(worst) / 2,
                "critical",
                {
                    "violations": _violations(t),
                    "bound_violations": t.bound_violations,
                    "vfloor_violations": t.vfloor_violations,
                    "mbound_violations": t.mbound_violations,
                    "outlier_changes": t.outlier_changes,
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
    return {"fp16": ("fp16_overflow", "gradient_explosion"), "bf16": ("bf16_overflow", "gradient_explosion")}.get(
        dtype, ("gradient_explosion",)
    )


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
                _cap(max(new_w, t.nonfinite_m_b, t.nonfinite_v_b) / max(1, t.numel) * 100 + 1),
                "critical",
                {"weights": t.nonfinite_b, "weights_before": t.nonfinite_a, "exp_avg": t.nonfinite_m_b, "exp_avg_sq": t.nonfinite_v_b},
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
        for where, head, mx in (("weight", t.headroom_b, t.max_abs_b), ("exp_avg_sq", t.moment_headroom_b, t.max_v_b)):
            if not math.isfinite(head) or head >= th.headroom_warn:
                continue
            dtype = t.dtype if where == "weight" else "fp32"
            over = head <= 1.0
            out.append(
                Finding(
                    "",
                    "dtype_overflow" if over else "dtype_headroom",
                    t.name,
                    _cap(th.headroom_warn / max(head, 1e-30)),
                    "critical" if over else "warning",
                    {"where": where, "dtype": dtype, "max_abs": mx, "headroom": head, "warn_below": th.headroom_warn},
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
        if 0 <= k < g:
            # One skipped step per backoff (a single one even where the scaler state was not
            # saved, as nanoGPT does not) is the scaler's routine.
            normal = routine and g - k <= max(1, round(drops))
            out.append(
                Finding(
                    "",
                    "skipped_steps",
                    "run",
                    _cap((g - k) / max(1, g) * 10),
                    "info" if normal else "warning",
                    {"trainer_steps": g, "optimizer_steps": k},
                    f"{g - k} of {g} steps skipped the optimizer update (overflowing gradients under a loss scaler)"
                    + (": one per loss-scale backoff, dynamic loss scaling's normal operation" if normal else ""),
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
                _cap(drops),
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
                _cap(drops),
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
        who = f" ({', '.join(mods[:3])}{', ...' if len(mods) > 3 else ''}; {share:.0%} of parameters)" if share < 0.5 else ""
        if base and lb > th.lr_over_base * base:
            # The LR stored in *before* is the one its next step uses: already above the
            # schedule there means the window's first step is the first bad one.
            first = (p.step_a + 1) if (la and p.step_a is not None and la > th.lr_over_base * base) else None
            out.append(
                Finding(
                    "",
                    "lr_above_schedule",
                    f"param_group[{g}]",
                    _cap(lb / base / th.lr_over_base),
                    "critical",
                    {"lr_after": lb, "base_lr": base, "factor": lb / base, "limit": th.lr_over_base, "modules": mods, "param_share": share, "first_step": first},
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
                        _cap(lb / la / allowed),
                        "critical",
                        {"lr_before": la, "lr_after": lb, "growth": lb / la, "allowed": allowed, "modules": mods, "param_share": share},
                        f"param group {g}{who}: LR rose {lb / la:.1f}x between steps {p.step_a} and {p.step_b}, "
                        f"more than any warmup allows ({allowed:.1f}x)",
                        "docs/signatures.md#update-weight-ratio",
                        _lr_supports(share),
                        primary=True,
                    )
                )
    return out


def detect_update_ratio(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """||dw||/||w|| per step, uniformly high across weight matrices -> LR too high."""
    ratios = np.array([t.update_ratio for t in diff.tensors if len(t.shape) >= 2 and math.isfinite(t.update_ratio)])
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
            _cap(med / th.update_ratio),
            "warning",
            {"median_update_ratio": med, "max_update_ratio": float(ratios.max()), "threshold": th.update_ratio},
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
                _cap(med / th.burst),
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
                    _cap(min(zz / th.z, r / th.burst)),
                    "warning",
                    {"r_v": float(r), "robust_z": float(zz), "role": t.role, "z_threshold": th.z, "burst": th.burst},
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
                    _cap(t.vanished_share_a / th.rho_share * math.log10(t.r_v)),
                    "warning",
                    {"vanished_share_before": t.vanished_share_a, "vanished_share_after": t.vanished_share_b, "r_v": t.r_v, "threshold": th.burst, "eps": t.eps},
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
    ts = [t for t in diff.tensors if t.has_moments and len(t.shape) >= 2 and math.isfinite(t.rho_share_b)]
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
                    _cap(t.rho_share_b / th.rho_share),
                    "warning",
                    {"rho_share_before": t.rho_share_a, "rho_share_after": t.rho_share_b, "vanished_share_after": t.vanished_share_b},
                    f"{module_of(t.name)}: {t.rho_share_b:.0%} of updates are sign-like (was {t.rho_share_a:.0%})",
                    "docs/signatures.md#sign-like-updates (Molybog 2304.09871)",
                    ("adam_instability",),
                )
            )
    return out


# ------------------------------------------------------------------ replay detectors
def _z_steps(values: Sequence[float], baseline: Sequence[float] = ()) -> np.ndarray:
    """Robust z of per-step values (log scale) against the run's own trend: the logged
    history before the window leads into the window (`tensors.trend_z`, as triage judges
    the log); lacking that history, against the window itself. Non-finite = +inf."""
    if len(baseline) >= CURVE_MIN_HISTORY:
        return trend_z([*baseline, *values], judge_from=len(baseline))[0][len(baseline) :]
    x = log_curve(values)
    return np.where(np.isfinite(x), robust_z(x, floor=CURVE_FLOOR), np.inf)


def replay_findings(rep: Any, th: Thresholds | None = None) -> tuple[list[Finding], dict[str, Any]]:
    """Findings from a replay (replay.ReplayResult) and the verdict fields it settles.

    Returns:
        (findings without ids, verdict fields: first_bad_step, first_anomalous_module,
        exploding_layers, overflowing_tensors, anomalous_samples, reproducible).
    """
    th = th or Thresholds()
    out: list[Finding] = []
    fields: dict[str, Any] = {}
    recs = rep.records
    steps = [r.step for r in recs]
    base = list(rep.baseline.values())
    zg = _z_steps([r.grad_norm for r in recs], [b["grad_norm"] for b in base if "grad_norm" in b])
    zl = _z_steps([r.loss for r in recs], [b["loss"] for b in base if "loss" in b])
    out += _lr_steps(rep, fields, th)
    # A grad-norm outlier the loss ignores is a blip (as triage judges the log), not a spike.
    bad = [
        i
        for i, r in enumerate(recs)
        if r.skipped or not math.isfinite(r.loss) or zl[i] > th.z or (zg[i] > th.z and (not math.isfinite(zg[i]) or loss_follows(zl, i, th.z, z_grad=zg)))
    ]
    if bad and (len(recs) > 1 or len(base) >= 5):
        i = bad[0]
        fields["first_bad_step"] = min(steps[i], fields.get("first_bad_step", steps[i]))
        r = recs[i]
        out.append(
            Finding(
                "",
                "replay_spike",
                f"step {r.step}",
                _cap(max(zg[i], zl[i]) / th.z) if math.isfinite(max(zg[i], zl[i])) else 10.0,
                "warning",
                {"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm, "grad_z": float(zg[i]), "loss_z": float(zl[i]), "skipped": r.skipped},
                f"replayed step {r.step} spikes: loss {r.loss:.3g}, grad norm {r.grad_norm:.3g} (robust z {float(max(zg[i], zl[i])):.1f} over the window)"
                + (", optimizer step skipped" if r.skipped else ""),
                "docs/signatures.md#spike-onset",
                ("gradient_explosion", "poison_batch", "lr_too_high"),
            )
        )
    suspect = fields.get("first_bad_step", steps[int(np.argmax(np.where(np.isfinite(zg), zg, 1e9)))] if recs else None)
    if suspect is not None:
        # A module "leaving its range" means something only on a step that went bad: on a
        # healthy window the step with the largest grad norm always has a largest module.
        if "first_bad_step" in fields:
            out += _localise(rep, suspect, fields, th)
        out += _overflow(rep, suspect, fields, th)
        if "first_bad_step" in fields:
            out += _samples(rep, suspect, fields, th)
    out += _logits(rep, th)
    rms = _rms_t(rep, th)
    for f in rms:
        if f.primary:  # a second moment two orders of magnitude stale: that step goes bad
            fields["first_bad_step"] = min(f.metrics["step"], fields.get("first_bad_step", f.metrics["step"]))
            fields.setdefault("first_anomalous_module", module_of(f.subject))
    out += rms
    out += _reproduction(rep, fields, th)
    return out, fields


def _rms_t(rep: Any, th: Thresholds) -> list[Finding]:
    """A parameter whose gradient outgrew Adam's second moment: RMS_t = sqrt(mean(g^2/v_hat))
    is ~1 in steady state; > 1 and a robust outlier (log scale) among the step's
    parameters means its updates turn sign-like and lr-sized (StableAdamW). Embeddings
    are left out: their gradients are row-sparse, so rows idle for a while always have a
    stale v (SPAM's observation), which is normal for them."""
    for r in rep.records:
        names = [n for n in r.param_rms_t if tensor_role(n, (2, 2)) != "embedding" and r.param_rms_t[n] > 0]
        if len(names) < 4:
            continue
        vals = np.array([r.param_rms_t[n] for n in names])
        z = robust_z(np.log10(vals), floor=0.1)
        hits = [i for i in np.argsort(-vals) if vals[i] > 1.0 and z[i] > th.z]
        if not hits:
            continue
        i = int(hits[0])
        name, v = names[i], float(vals[i])
        spikes = r.param_spikes.get(name, 0)
        return [
            Finding(
                "",
                "rms_t",
                name,
                _cap(float(z[i]) / th.z),
                "warning",
                {"step": r.step, "rms_t": v, "robust_z": float(z[i]), "spam_spikes": spikes, "flagged": [names[int(j)] for j in hits[:8]]},
                f"step {r.step}: {name}'s gradient is {v:.3g}x what Adam's second moment expects (RMS_t; robust z {float(z[i]):.1f} "
                f"among the step's parameters){f', {spikes} elements with g^2 > 5000 v' if spikes else ''}: its updates go sign-like",
                "docs/signatures.md#rms-t (StableAdamW 2304.13013), per-element spike (SPAM 2501.06842)",
                ("adam_instability", "gradient_explosion"),
                primary=v > 100,
            )
        ]
    return []


def first_steps_from_state(dfind: list[Finding], rep: Any) -> list[int]:
    """First bad steps that the *before* state plus the replay pin down.

    An LR already above the schedule in *before* makes the window's first step bad; a
    tensor whose exp_avg_sq had collapsed goes bad at the first replayed step whose
    gradient RMS clears the collapse level (100 eps, ten times the 10 eps floor).
    """
    out = []
    first = rep.records[0].step if rep.records else None
    for f in dfind:
        if f.kind == "lr_above_schedule" and f.metrics.get("first_step") is not None:
            out.append(int(f.metrics["first_step"]))
        if f.kind == "vanished_v_burst" and first is not None:
            level = 100 * float(f.metrics.get("eps") or 1e-8)
            hit = next((r.step for r in rep.records if r.param_grad_rms.get(f.subject, 0.0) > level), None)
            if hit is not None:
                out.append(hit)
    return out


def _logits(rep: Any, th: Thresholds) -> list[Finding]:
    """Output logits past the soft-cap level and growing across the window (log Z drift)."""
    recs = [r for r in rep.records if math.isfinite(r.logit_absmax)]
    if len(recs) < 2:
        return []
    first, peak = recs[0], max(recs, key=lambda r: r.logit_absmax)
    if peak.logit_absmax > th.logit_max and peak.logit_absmax > 2 * first.logit_absmax:
        return [
            Finding(
                "",
                "output_logit_growth",
                f"step {peak.step}",
                _cap(peak.logit_absmax / th.logit_max),
                "warning",
                {"max_abs_logit": peak.logit_absmax, "first_max_abs_logit": first.logit_absmax, "log_z": peak.log_z, "first_log_z": first.log_z, "limit": th.logit_max},
                f"max |logit| grows from {first.logit_absmax:.3g} to {peak.logit_absmax:.3g} by step {peak.step} "
                f"(log Z {first.log_z:.3g} -> {peak.log_z:.3g}); past {th.logit_max:g} softmax saturates",
                "docs/signatures.md#output-logits (PaLM z-loss; Gemma 2 soft-cap)",
                ("output_logit_divergence",),
            )
        ]
    return []


def _lr_steps(rep: Any, fields: dict[str, Any], th: Thresholds) -> list[Finding]:
    """A step whose LR (as replayed) jumps past what any warmup allows: the first bad step."""
    from .triage import group_lrs

    plan = dict((rep.config.get("lr") or {}).get("value") or {})
    steps = sorted(plan)
    # The window's first step against the last logged step before it (a jump on the very
    # first replayed step has no replayed predecessor).
    if steps and rep.baseline:
        last = max(rep.baseline)
        n = len(plan[steps[0]])
        prev_lr = group_lrs(rep.baseline[last], n) or ([rep.baseline[last]["lr"]] * n if "lr" in rep.baseline[last] else None)
        if prev_lr is not None and last < steps[0]:
            plan[last] = list(prev_lr)
            steps = [last, *steps]
    for prev, s in zip(steps, steps[1:], strict=False):
        allowed = lr_growth_limit(prev, s, th.lr_growth_margin)
        jumped = [g for g, (la, lb) in enumerate(zip(plan[prev], plan[s], strict=False)) if la > 0 and lb / la > allowed]
        if not jumped:
            continue
        g = jumped[0]
        la, lb = plan[prev][g], plan[s][g]
        fields["first_bad_step"] = s
        # Only some groups jumping is a per-module LR fault: those modules explode.
        confined = len(jumped) < len(plan[s])
        return [
            Finding(
                "",
                "lr_step_jump",
                f"step {s}",
                _cap(lb / la / allowed),
                "critical",
                {"step": s, "group": g, "groups": jumped, "lr_before": la, "lr": lb, "source": rep.config["lr"]["source"]},
                f"step {s} runs param group {g} at LR {lb:.3g}, {lb / la:.0f}x step {prev}'s"
                + (f" ({len(jumped)} of {len(plan[s])} groups)" if confined else ""),
                "docs/signatures.md#update-weight-ratio",
                ("gradient_explosion", "lr_too_high") if confined else ("lr_too_high",),
                primary=True,
            )
        ]
    return []


def _localise(rep: Any, s: int, fields: dict[str, Any], th: Thresholds) -> list[Finding]:
    """First module, in forward and in backward order, far outside its own range on other steps."""
    from .replay.probes import BWD_STATS, FWD_STATS

    p = rep.passes[s]
    others = [rep.passes[t] for t in rep.passes if t != s]
    if not others:
        return []
    ia, ig = FWD_STATS.index("absmax"), BWD_STATS.index("grad_norm")

    def z_of(table: str, col: int) -> np.ndarray:
        cur = getattr(p, table)[:, col].double().numpy()
        ref = np.stack([getattr(o, table)[:, col].double().numpy() for o in others])
        with np.errstate(divide="ignore", invalid="ignore"):
            lc, lr = np.log10(np.maximum(cur, 1e-30)), np.log10(np.maximum(ref, 1e-30))
            # per module across the other steps; floor 0.05 in log10 (12%): a module's own
            # step-to-step spread on a quiet window
            return robust_z(lc, floor=0.05, reference=lr, axis=0)

    zf, zb = z_of("fwd", ia), z_of("bwd", ig)
    nf_f = p.fwd[:, FWD_STATS.index("nonfinite")].numpy()
    nf_b = p.bwd[:, BWD_STATS.index("grad_nonfinite")].numpy()
    out = []
    fwd_first = next((i for i in p.fwd_order if nf_f[i] > 0 or zf[i] > th.z), None)
    bwd_first = next((i for i in p.bwd_order if nf_b[i] > 0 or zb[i] > th.z), None)
    if fwd_first is not None:
        fields.setdefault("first_anomalous_module", p.modules[fwd_first])
        out.append(
            _first_anomaly(
                "forward", s, p.modules[fwd_first], float(zf[fwd_first]), float(nf_f[fwd_first]), th,
                ("absmax", float(p.fwd[fwd_first, ia]), "output", "max |x|"),
            )
        )
    ranked = sorted((i for i in range(len(p.modules)) if math.isfinite(zb[i]) and zb[i] > th.z), key=lambda i: -zb[i])
    fields["replay_layers"] = [p.modules[i] for i in ranked[:8]]
    if bwd_first is not None:
        out.append(
            _first_anomaly(
                "backward", s, p.modules[bwd_first], float(zb[bwd_first]), float(nf_b[bwd_first]), th,
                ("grad_norm", float(p.bwd[bwd_first, ig]), "output gradient", "norm"),
            )
        )
    return out


def _first_anomaly(order: str, s: int, name: str, z: float, nonfinite: float, th: Thresholds, stat: tuple[str, float, str, str]) -> Finding:
    """The first module, in forward or backward order, whose statistic leaves its range."""
    key, value, what, label = stat
    extra = " on the window's other steps" if order == "forward" else ""
    return Finding(
        "",
        f"first_{order}_anomaly",
        name,
        _cap(z / th.z) if math.isfinite(z) else 10.0,
        "warning",
        {"step": s, "robust_z": z, "nonfinite": nonfinite, key: value},
        f"step {s}: {name} is the first module in {order} order whose {what} leaves its range{extra} ({label} {value:.3g}, robust z {z:.1f})",
        "docs/signatures.md#first-anomaly (OLMo-core 6 sigma)",
        ("gradient_explosion",),
    )


def _overflow(rep: Any, s: int, fields: dict[str, Any], th: Thresholds) -> list[Finding]:
    """Non-finite values in the run's precision that the fp32 replay does not have."""
    from .replay.probes import BWD_STATS, FWD_STATS

    if rep.precision == "fp32":
        return []
    out = []
    for r in rep.records:
        p, ref = rep.passes[r.step], rep.fp32_passes.get(r.step)
        # Non-finite outputs only: under autocast, fp32 tensors (the residual stream,
        # norms) may legitimately exceed the low-precision range; a low-precision
        # tensor that overflows holds inf.
        nf_f = p.fwd[:, FWD_STATS.index("nonfinite")].numpy()
        nf_b = p.bwd[:, BWD_STATS.index("grad_nonfinite")].numpy()
        mods_param = {n.rsplit(".", 1)[0] for n in r.param_grad_nonfinite}
        pos = {i: k for k, i in enumerate(p.bwd_order)}
        cands = [i for i in range(len(p.modules)) if nf_b[i] > 0 or p.modules[i] in mods_param]
        fwd_over = [i for i in p.fwd_order if nf_f[i] > 0]
        if not cands and not fwd_over:
            continue
        fp32_ok = ref is not None and not bool((ref.fwd[:, FWD_STATS.index("nonfinite")] > 0).any()) and not bool((ref.bwd[:, BWD_STATS.index("grad_nonfinite")] > 0).any())
        if fwd_over:
            first, where = p.modules[fwd_over[0]], "output"
        else:
            first, where = p.modules[min(cands, key=lambda i: pos.get(i, len(pos)))], "gradient"
        limit = 65504.0 if rep.precision == "fp16" else 3.39e38
        # What the value would have been: the fp32 replay of the same step, same module.
        true_max = math.nan
        if ref is not None and first in ref.modules:
            j = ref.modules.index(first)
            true_max = float(ref.fwd[j, FWD_STATS.index("absmax")] if where == "output" else ref.bwd[j, BWD_STATS.index("grad_absmax")] * (r.loss_scale or 1.0))
        # Dynamic loss scaling grows the scale until a scaled gradient overflows, then halves
        # it: an overflow that one or two halvings (x4) undo is its normal operation.
        if where == "gradient" and (r.loss_scale or 0) > 1 and fp32_ok and math.isfinite(true_max) and true_max < th.routine_overflow * limit:
            out.append(
                Finding(
                    "",
                    "routine_scale_overflow",
                    first,
                    1.0,
                    "info",
                    {"step": r.step, "loss_scale": r.loss_scale, "scaled_max_abs": true_max, "limit": limit},
                    f"step {r.step}: the scaled gradient of {first} reaches {true_max:.4g} under loss scale {r.loss_scale:g} "
                    f"({true_max / limit:.2f}x fp16's limit): the scaler's routine backoff, not an incident",
                    "docs/signatures.md#skipped-steps; torch.amp.GradScaler growth/backoff",
                    (),
                )
            )
            continue
        fields.setdefault("first_anomalous_module", first)
        fields.setdefault("first_bad_step", r.step)
        fields.setdefault("overflowing_tensors", []).append(
            {"name": first, "dtype": rep.precision, "max_abs": true_max if math.isfinite(true_max) else math.inf, "limit": limit, "where": f"{where} at step {r.step}"}
        )
        reach = f" (in fp32 it reaches {true_max:.4g}, {true_max / limit:.2f}x the limit)" if math.isfinite(true_max) and true_max > 0 else ""
        cause = ("fp16_overflow",) if rep.precision == "fp16" else ("bf16_overflow",)
        out.append(
            Finding(
                "",
                "replay_overflow",
                first,
                10.0,
                "critical",
                {"step": r.step, "where": where, "precision": rep.precision, "fp32_finite": fp32_ok, "loss_scale": r.loss_scale, "skipped": r.skipped, "fp32_max_abs": true_max},
                f"step {r.step}: the {where} of {first} overflows {rep.precision}{reach}"
                + (f" under loss scale {r.loss_scale:g}" if r.loss_scale and where == "gradient" else "")
                + ("; the fp32 replay of the same step stays finite" if fp32_ok else "; fp32 overflows too"),
                "docs/signatures.md#dtype-range",
                cause if fp32_ok else ("gradient_explosion", *cause),
                primary=True,
            )
        )
        break
    return out


# A row whose loss and gradient share are ordinary is flagged on its data alone only when its
# longest run or repeat is half again the longest of every row of the window's other steps
# (tuning draws: natural rows come within 1-20% of the window's longest; junk rows 3x).
DATA_MARGIN = 1.5


def _samples(rep: Any, s: int, fields: dict[str, Any], th: Thresholds) -> list[Finding]:
    """Rows of the spiking batch that carry it: gradient share, loss, data statistics."""
    r = next(x for x in rep.records if x.step == s)
    stats = rep.row_stats.get(s, [])
    b = len(r.sample_loss)
    if b < 2:
        return []
    loss = np.array(r.sample_loss)
    fin = np.isfinite(loss)
    # Rows are judged against the window's other steps' rows first (a batch that is mostly
    # junk has junk for its median), then against their own batch. The nearest steps are
    # the reference, whole steps until they hold 3 batches of rows: a loss still falling
    # across the window would otherwise widen the reference's spread by its own descent.
    others = sorted((x for x in rep.records if x.step != s), key=lambda x: (abs(x.step - s), x.step))
    ref: list[float] = []
    for x in others:
        if len(ref) >= 3 * b:
            break
        ref += [v for v in x.sample_loss if math.isfinite(v)]
    ref_loss = np.array(ref)
    zl = np.zeros(b)
    if fin.sum() >= 2:
        zl[fin] = robust_z(loss[fin], floor=0.05 * float(np.median(np.abs(loss[fin]))) + 1e-12)
    zw = np.zeros(b)
    if ref_loss.size >= 3 * b and fin.any():
        zw[fin] = robust_z(loss[fin], floor=0.05 * abs(float(np.median(ref_loss))) + 1e-12, reference=ref_loss)
    share = np.zeros(b)
    zs = np.zeros(b)
    if r.sample_grad_sq is not None and math.isfinite(sum(r.sample_grad_sq)) and sum(r.sample_grad_sq) > 0:
        sq = np.array(r.sample_grad_sq)
        share = sq / sq.sum()
        zs = robust_z(share, floor=0.05 / b)
    # Natural data has long runs and repeats too (indentation, tables): a row's are
    # anomalous only past every other row of the window's other steps, and over half the row.
    ref_stats = [st for t, v in rep.row_stats.items() if t != s for st in v]
    run_cap = max((st.longest_run for st in ref_stats), default=0)
    rep_cap = max((st.periodic_repeat for st in ref_stats), default=0)
    rows = []
    evidence = False  # finite, data-level evidence (a non-finite loss alone is a numerics symptom)
    for i in range(b):
        why = []
        if share[i] > max(0.2, 2.0 / b) and zs[i] > th.z:
            why.append(f"{share[i]:.0%} of the gradient norm^2")
        if zl[i] > th.z:
            why.append(f"loss {loss[i]:.3g} (robust z {zl[i]:.1f} in its batch)")
        elif zw[i] > th.z:
            why.append(f"loss {loss[i]:.3g} (robust z {zw[i]:.1f} against the window's other steps' rows)")
        numeric = bool(why)
        evidence |= numeric
        st = stats[i] if i < len(stats) else None
        if st is not None:
            data, decisive = [], False
            if st.longest_run > run_cap and st.longest_run >= st.length / 2:
                data.append(f"one token repeated {st.longest_run} times (other steps' rows: at most {run_cap})")
                decisive = st.longest_run >= DATA_MARGIN * run_cap
            elif st.periodic_repeat > rep_cap and st.periodic_repeat >= st.length / 2:
                data.append(f"a pattern of period <= 13 repeated over {st.periodic_repeat} tokens (other steps' rows: at most {rep_cap})")
                decisive = st.periodic_repeat >= DATA_MARGIN * rep_cap
            # A few rare tokens are normal in any window; a quarter of the row is not.
            if st.unseen >= max(1, 0.25 * st.length):
                data.append(f"{st.unseen} of {st.length} tokens seen nowhere else in the window")
                decisive = True
            # Data explains a row whose loss or gradient stands out; alone, it must stand
            # clear of every other row of the window, not just past the longest.
            if numeric or decisive:
                evidence |= bool(data)
                why += data
        if not fin[i] and fin.any():
            why.append("its loss is not finite while other rows' are")
        if why:
            sid = r.sample_ids[i] if r.sample_ids else None
            rows.append({"index": i, "sample_id": sid, "score": float(max(zs[i], zl[i], 0.0)), "why": "; ".join(why)})
    if not rows:
        return []
    carried = float(sum(share[x["index"]] for x in rows))
    idx = [x["index"] for x in rows]
    if not evidence:
        # Rows that only overflowed: they triggered the numerics, they are not bad data.
        return [
            Finding(
                "",
                "overflowing_samples",
                f"step {s}",
                1.0,
                "info",
                {"step": s, "rows": idx, "batch_size": b},
                f"step {s}: rows {idx} have a non-finite loss while the others' are finite; their data is unremarkable",
                "docs/signatures.md#per-sample-share, #data-stats",
                ("fp16_overflow", "bf16_overflow", "gradient_explosion"),
            )
        ]
    fields["anomalous_samples"] = rows
    return [
        Finding(
            "",
            "anomalous_samples",
            f"step {s}",
            _cap(carried / 0.5 * 2),
            "critical" if carried >= 0.5 else "warning",
            {"step": s, "rows": [x["index"] for x in rows], "grad_share": carried, "batch_size": b},
            f"step {s}: rows {[x['index'] for x in rows]} carry {carried:.0%} of the gradient norm^2 of a spiking batch",
            "docs/signatures.md#per-sample-share, #data-stats (OLMo-core instance filter)",
            ("poison_batch",),
            primary=carried >= 0.5,
        )
    ]


def _reproduction(rep: Any, fields: dict[str, Any], th: Thresholds) -> list[Finding]:
    """Replayed state vs *after*: impossible elements confined -> corruption; match -> reproduces."""
    if rep.matches is None:
        return []
    total = sum(m.numel for m in rep.matches) or 1
    mis = sum(m.mismatched for m in rep.matches)
    imp = [m for m in rep.matches if m.impossible]
    confined = 0 < len(imp) <= th.confined_tensors and all(m.impossible <= max(8, th.confined_share * m.numel) for m in imp)
    if confined:
        fields["reproducible"] = False
        return [
            Finding(
                "",
                "replay_mismatch_confined",
                imp[0].name,
                10.0,
                "critical",
                {"tensors": [m.name for m in imp], "elements": sum(m.impossible for m in imp), "where": [m.where for m in imp]},
                f"the replay reproduces every tensor except {sum(m.impossible for m in imp)} element(s) of "
                f"{', '.join(sorted({m.name for m in imp}))}, which no replay of these steps can reach: a hardware fault",
                "docs/signatures.md#reproducibility",
                ("silent_corruption",),
                primary=True,
            )
        ]
    if not imp and mis / total <= 0.01:
        fields["reproducible"] = True
        return [
            Finding(
                "",
                "replay_reproduces",
                "run",
                1.0,
                "info",
                {"mismatched_share": mis / total},
                f"the replay reproduces the after checkpoint ({1 - mis / total:.2%} of elements within tolerance): numerics or data, not hardware",
                "docs/signatures.md#reproducibility",
                (),
            )
        ]
    fields["reproducible"] = None
    worst = max(rep.matches, key=lambda m: m.mismatched / max(m.numel, 1))
    return [
        Finding(
            "",
            "replay_config_mismatch",
            worst.name,
            1.0,
            "info",
            {"mismatched_share": mis / total, "impossible_tensors": len(imp), "worst": worst.name},
            f"the replay deviates from after on {mis / total:.1%} of elements (worst: {worst.name} {worst.where}): "
            "the replay configuration (LR, clipping, precision, loss averaging) differs from the trainer's; see replay.config",
            "docs/signatures.md#reproducibility",
            (),
        )
    ]
