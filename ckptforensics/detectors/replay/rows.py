"""The examination stage's rows: the batch rows that carry the spike, by loss, gradient share
and data."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ckptforensics.core.tensors import (
    robust_z,
)
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.replay.evidence import ReplayEvidence

__all__ = ["DATA_MARGIN", "samples", "confirmed"]


# longest run or repeat is half again the longest of every row of the window's other steps
# (tuning draws: natural rows come within 1-20% of the window's longest; junk rows 3x).
DATA_MARGIN = 1.5


def samples(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Rows of the spiking batch that carry it: gradient share, loss, data statistics."""
    rep, s = ev.rep, ev.step
    if not ev.bad:
        return []
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
    others = sorted(
        (x for x in rep.records if x.step != s), key=lambda x: (abs(x.step - s), x.step)
    )
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
        zw[fin] = robust_z(
            loss[fin], floor=0.05 * abs(float(np.median(ref_loss))) + 1e-12, reference=ref_loss
        )
    share = np.zeros(b)
    zs = np.zeros(b)
    if (
        r.sample_grad_sq is not None
        and math.isfinite(sum(r.sample_grad_sq))
        and sum(r.sample_grad_sq) > 0
    ):
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
            why.append(
                f"loss {loss[i]:.3g} (robust z {zw[i]:.1f} against the window's other steps' rows)"
            )
        numeric = bool(why)
        evidence |= numeric
        st = stats[i] if i < len(stats) else None
        if st is not None:
            data, decisive = [], False
            if st.longest_run > run_cap and st.longest_run >= st.length / 2:
                data.append(
                    f"one token repeated {st.longest_run} times (other steps' rows: at most {run_cap})"
                )
                decisive = st.longest_run >= DATA_MARGIN * run_cap
            elif st.periodic_repeat > rep_cap and st.periodic_repeat >= st.length / 2:
                data.append(
                    f"a pattern of period <= 13 repeated over {st.periodic_repeat} tokens (other steps' rows: at most {rep_cap})"
                )
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
            rows.append(
                {
                    "index": i,
                    "sample_id": sid,
                    "score": float(max(zs[i], zl[i], 0.0)),
                    "why": "; ".join(why),
                }
            )
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
    return [
        Finding(
            "",
            "anomalous_samples",
            f"step {s}",
            cap(carried / 0.5 * 2),
            "critical" if carried >= 0.5 else "warning",
            {
                "step": s,
                "rows": [x["index"] for x in rows],
                "grad_share": carried,
                "batch_size": b,
                "samples": rows,
            },
            f"step {s}: rows {[x['index'] for x in rows]} carry {carried:.0%} of the gradient norm^2 of a spiking batch",
            "docs/signatures.md#per-sample-share, #data-stats (OLMo-core instance filter)",
            ("poison_batch",),
            primary=carried >= 0.5,
        )
    ]


def confirmed(f: Finding, check: Any) -> Finding:
    """The anomalous rows put to the test (`engine.bisect.confirm_rows`): where removing them
    removes the spike, the culprits are the minimal set that does (a row is one only when
    removing it changes the spike), replayed evidence that the data carried it, whatever
    layer it went through (poison_batch, primary); the rows it does not need are listed
    apart as unusual. Where removing them leaves the spike, the finding stays as it was and
    says so (the spike does not need these rows: the state or the update carried it)."""
    trials = list(check.trials)
    if not check.removes_spike:
        return dataclasses.replace(
            f,
            metrics={**f.metrics, "ablation": {"removes_spike": False, "trials": trials}},
            message=f"{f.message}; removing them leaves the spike (replayed from the state before it)",
        )
    keep = set(check.culprits)
    rows = [x for x in f.metrics["samples"] if x["index"] in keep]
    unusual = [x for x in f.metrics["samples"] if x["index"] not in keep]
    for x in rows:
        x["why"] += "; removing it removes the spike"
    s = f.metrics["step"]
    apart = (
        f"; rows {[x['index'] for x in unusual]} are unusual, but the spike does not need them"
        if unusual
        else ""
    )
    return dataclasses.replace(
        f,
        score=10.0,
        severity="critical",
        primary=True,
        metrics={
            **f.metrics,
            "rows": sorted(keep),
            "samples": rows,
            "unusual": unusual,
            "ablation": {"removes_spike": True, "trials": trials},
        },
        message=f"step {s}: removing rows {sorted(keep)} removes the spike (replayed from the state before it, "
        f"the rows replaced by rows of the step before){apart}",
    )
