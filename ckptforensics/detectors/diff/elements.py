"""Elements the optimizer cannot explain: values moved past its bound (hardware corruption,
located to the element and bit), non-finite values, values at their dtype's range."""

from __future__ import annotations

import dataclasses
import math

from ckptforensics import optim
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.diff.state import moments_restarted
from ckptforensics.engine.diff.pair import DiffResult, TensorDiff
from ckptforensics.trainers.fused import part_of

__all__ = ["detect_corruption", "detect_nonfinite", "detect_dtype_range"]


def _violations(t: TensorDiff) -> int:
    return (
        t.bound_violations
        + t.vfloor_violations
        + t.mbound_violations
        + t.outlier_changes
        + t.norm_violations
    )


def _title(family: str) -> str:
    """How messages name the optimizer family whose bound a tensor broke (Adam's name where
    the family is not one the tool knows)."""
    return (optim.find(family) or optim.DEFAULT).title


def detect_corruption(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Adam update bound, v floor and |m| <= C sqrt(v): no gradient can break them.

    Violations confined to a few elements are the silent-corruption signature (a bit
    flip cannot hide there); violations everywhere mean the recorded LR or optimizer
    is not what ran, which is a different finding.
    """
    if moments_restarted(diff):
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
                f"{total} elements in {len(bad)} tensors moved further than {_title(bad[0].family)} allows at the recorded LR: "
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
                "part": part_of(t.name, c.index, t.shape, diff.pair.heads),
            }
            for c in t.candidates
        ]
        worst = max(
            (abs(c.after - c.before) / c.bound for c in t.candidates if c.bound and c.bound > 0),
            default=1.0,
        )
        opt = _title(t.family)
        what = (
            f"one stored bit ({flips[0].bit_field} bit {flips[0].bit}) away from a value {opt} could reach"
            if flips
            else f"beyond any {opt} step"
        )
        parts = sorted({e["part"] for e in elems if e["part"]})
        named = f" ({', '.join(parts)})" if parts else ""
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
                f"{_violations(t)} element(s) of {t.name}{named} changed {what}: the silent-corruption signature",
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
