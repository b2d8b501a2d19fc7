"""Per-expert evidence of Mixture-of-Experts tensors: fused ones (`TensorDiff.experts`), and those
written one tensor per expert, stacked per module and parameter (`engine.diff.experts.split_groups`:
a finding then names the expert's own tensor, `...deepspeed_experts.2.fc1.weight`): experts no
gradient reached over the pair (dead), one expert's update standing out among the experts of its
tensor, and a dead expert's return into Adam's sign-like regime.

Every rule is relative to the tensor's own experts (their median) or exact (a decay no gradient
leaves): a healthy MoE routes unevenly all along, and Adam's per-element normalisation keeps its
experts' updates within a small factor of each other whatever their load."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from statistics import median

from ckptforensics.detectors.base import Finding, Thresholds, cap, module_of
from ckptforensics.engine.diff.experts import SplitExperts, split_groups
from ckptforensics.engine.diff.pair import DiffResult, TensorDiff

__all__ = [
    "DEAD_MIN_STEPS",
    "OUTLIER_FACTOR",
    "ENERGY_FACTOR",
    "RETURN_V_LEVEL",
    "RETURN_STEP",
    "detect_dead_experts",
    "detect_expert_update_outlier",
    "detect_expert_return",
]

# An expert idle for one step is routine load imbalance (a small batch, top-k routing): info.
# Idle over two steps and more is the replay's idle run (`detectors/replay/routing.py`): warning.
DEAD_MIN_STEPS = 2
# Adam moves each element by ~lr·|m̂|/√v̂, between ~0.23 lr for a noisy stationary gradient
# (√((1−β1)/(1+β1)) at β1 0.9) and lr when sign-like: a load difference alone moves an expert's
# update/weight ratio by less than that 4.3x span (healthy tiny Qwen3-MoE, Mixtral, gpt-oss runs:
# max/median 1.1-1.3x); 3x the median is an expert in the sign-like regime while its peers are not,
# or one whose weights collapsed.
OUTLIER_FACTOR = 3.0
# Gradient energy over the window against the expert's own running average (r_v): an expert's
# load swings between windows (healthy tiny gpt-oss: one expert at 15x its tensor's median r_v,
# 8.2 against 0.55); 30x, twice that, and past the diff's own burst level (`Thresholds.burst`).
ENERGY_FACTOR = 30.0
# A second moment two decades under its tensor's experts (√v 10x under): a gradient back at the
# others' scale makes |m̂|/√v̂ ~ 1 on every element (Molybog et al. 2023, arXiv 2304.09871).
RETURN_V_LEVEL = 1e-2
# ... and the expert's step RMS at half the LR or more (over 2x the noisy regime's 0.23 lr).
RETURN_STEP = 0.5

_SOURCE = "docs/signatures.md"
_LAYER = re.compile(r"\.(\d+)\.")


def _experts(diff: DiffResult, moments: bool) -> list[tuple[TensorDiff, SplitExperts | None]]:
    """The fused expert tensors, then the one-tensor-per-expert groups (with their group)."""
    split = split_groups(diff.tensors)
    return [
        (t, g)
        for t, g in [*((t, None) for t in diff.tensors), *((g.record, g) for g in split)]
        if t.experts is not None
        and t.experts.experts >= 3  # a median of two is their mean: nothing stands out
        and (not moments or (t.experts.has_moments and t.k > 0))
    ]


def _id(g: SplitExperts | None, e: int) -> int:
    """The expert's id as named: its position in a fused tensor, its index in a split group."""
    return g.ids[e] if g is not None else e


def _layer(module: str) -> int | None:
    m = _LAYER.findall(module)
    return int(m[-1]) if m else None


def detect_dead_experts(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """Experts whose moments decayed over the pair exactly as no gradient leaves them
    (v_B = β2^k v_A, m_B = β1^k m_A on every element of every fused tensor of the layer):
    no token was routed to them in the window. A layer whose experts all decayed had no
    gradient at all (frozen, or cut off upstream): not an expert's evidence."""
    mods: dict[tuple[str, tuple[int, ...]], list[tuple[TensorDiff, SplitExperts | None]]]
    mods = defaultdict(list)
    for t, g in _experts(diff, moments=True):
        mods[(module_of(t.name), ()) if g is None else (g.module, g.ids)].append((t, g))
    out = []
    for (mod, _ids), tgs in mods.items():
        ts = [t for t, _ in tgs]
        g0 = tgs[0][1]
        n = min(t.experts.experts for t in ts)  # type: ignore[union-attr]
        st = [t.experts for t in ts]
        dead = [
            e
            for e in range(n)
            if all(s.decayed[e] for s in st)  # type: ignore[union-attr]
        ]
        if not dead or len(dead) == n:
            continue
        never = [e for e in dead if all(s.mean_v_a[e] == 0 for s in st)]  # type: ignore[union-attr]
        k = max(t.k for t in ts)
        # The dead experts' second moment against the layer's others (median over tensors).
        level = {
            e: median(
                s.mean_v_b[e] / m if (m := median(s.mean_v_b)) > 0 else math.nan  # type: ignore[union-attr]
                for s in st
            )
            for e in dead
        }
        named = [_id(g0, e) for e in dead]
        # Split experts: the dead expert's own tensors (and the expert as subject when one is).
        tensors = (
            [t.name for t in ts] if g0 is None else [g.members[e] for _, g in tgs for e in dead]  # type: ignore[union-attr]
        )
        subject = g0.expert(dead[0]) if g0 is not None and len(dead) == 1 else mod
        out.append(
            Finding(
                "",
                "dead_expert",
                subject,
                cap(float(len(dead))),
                "warning" if k >= DEAD_MIN_STEPS else "info",
                {
                    "layer": _layer(mod),
                    "experts": named,
                    "never_trained": [_id(g0, e) for e in never],
                    "n_experts": n,
                    "steps": k,
                    "min_steps": DEAD_MIN_STEPS,
                    "v_level": {str(_id(g0, e)): level[e] for e in dead},
                    "tensors": tensors,
                },
                f"{mod}: expert{'s' if len(dead) > 1 else ''} {', '.join(map(str, named))} of {n} got no gradient over the "
                f"{k} step{'s' if k != 1 else ''}: "
                "both Adam moments decayed exactly by beta^k on every element (no token routed to "
                f"{'them' if len(dead) > 1 else 'it'})",
                f"{_SOURCE}#dead-expert",
                ("expert_collapse",),
            )
        )
    return out


def _median(xs: tuple[float, ...]) -> float:
    fin = [x for x in xs if math.isfinite(x)]
    return median(fin) if len(fin) >= 3 else math.nan


def detect_expert_update_outlier(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """One expert standing out among its tensor's experts: its update/weight ratio past
    `OUTLIER_FACTOR` times their median, or its gradient energy r_v past `burst` and
    `ENERGY_FACTOR` times theirs (Adam normalises the update, so an expert's gradient growing
    shows in its moments first). That expert, not the layer, moved: its tensor leads the diff's
    exploding layers."""
    out = []
    for t, g in _experts(diff, moments=False):
        s = t.experts
        assert s is not None
        med = _median(s.update_ratio)
        # r_v with or without the moments' levels (a split group stacks its records' own r_v).
        has_rv = len(s.r_v) == s.experts
        med_rv = _median(s.r_v) if has_rv else math.nan
        by_ratio = {
            e: x / med for e, x in enumerate(s.update_ratio) if med > 0 and x > OUTLIER_FACTOR * med
        }
        by_energy = {
            e: x / med_rv
            for e, x in enumerate(s.r_v)
            if med_rv > 0 and x > th.burst and x > ENERGY_FACTOR * med_rv
        }
        if not by_ratio and not by_energy:
            continue
        # The expert furthest past its threshold, in either statistic.
        score = {e: f / OUTLIER_FACTOR for e, f in by_ratio.items()}
        for e, f in by_energy.items():
            score[e] = max(score.get(e, 0.0), f / ENERGY_FACTOR)
        hot = sorted(score, key=lambda e: -score[e])
        e = hot[0]
        what = []
        if e in by_ratio:
            what.append(
                f"moved {by_ratio[e]:.1f}x the median update/weight of its {s.experts} experts"
            )
        if e in by_energy:
            what.append(f"took {by_energy[e]:.3g}x their gradient energy (r_v {s.r_v[e]:.3g})")
        mod, subject = (module_of(t.name), t.name) if g is None else (g.module, g.members[e])
        # An expert of its own tensor past Adam's update bound at its recorded LR moved at a
        # higher LR than recorded (`#adam-update-bound`), not on a larger gradient: Adam's
        # step does not grow with it. A fused tensor's bound count is not one expert's.
        past = g.tensors[e].bound_violations if g is not None else 0
        if past:
            what.append(f"broke Adam's update bound at its recorded LR on {past} elements")
        out.append(
            Finding(
                "",
                "expert_update_outlier",
                subject,
                cap(score[e]),
                "warning",
                {
                    "expert": _id(g, e),
                    "experts": [_id(g, x) for x in hot],
                    "layer": _layer(t.name if g is None else f"{mod}."),
                    "update_ratio": s.update_ratio[e],
                    "median_update_ratio": med,
                    "ratio_factor": by_ratio.get(e),
                    "ratio_threshold": OUTLIER_FACTOR,
                    "r_v": s.r_v[e] if has_rv else None,
                    "median_r_v": med_rv,
                    "energy_factor": by_energy.get(e),
                    "energy_threshold": ENERGY_FACTOR,
                    "burst": th.burst,
                    "step_rms": s.step_rms[e],
                    **({"group": t.name, "bound_violations": past} if g is not None else {}),
                },
                f"{mod}: expert {_id(g, e)}{f' ({g.param})' if g is not None else ''} "
                + " and ".join(what),
                f"{_SOURCE}#expert-update-outlier",
                ("lr_too_high",) if past else ("gradient_explosion",),
            )
        )
    return out


def detect_expert_return(diff: DiffResult, th: Thresholds) -> list[Finding]:
    """An expert back from idling: its second moment at *before* `RETURN_V_LEVEL` under its
    tensor's experts (decayed while it had no gradient), gradient reaching it in the window,
    and its step sign-like (RMS ≥ `RETURN_STEP` lr, above its peers'): Adam's instability
    on a single expert."""
    out = []
    for t, g in _experts(diff, moments=True):
        s = t.experts
        assert s is not None
        va = [x for x in s.mean_v_a if math.isfinite(x)]
        steps = [x for x in s.step_rms if math.isfinite(x)]
        if len(va) < 3 or len(steps) < 3 or (med_v := median(va)) <= 0:
            continue
        med_step = median(steps)
        back = [
            e
            for e in range(s.experts)
            if not s.decayed[e]
            and s.mean_v_a[e] < RETURN_V_LEVEL * med_v
            and s.step_rms[e] >= RETURN_STEP
            and s.step_rms[e] > med_step
        ]
        if not back:
            continue
        e = min(back, key=lambda x: s.mean_v_a[x])
        level = s.mean_v_a[e] / med_v
        mod, subject = (module_of(t.name), t.name) if g is None else (g.module, g.members[e])
        out.append(
            Finding(
                "",
                "expert_return_sign_like",
                subject,
                cap(s.step_rms[e] / RETURN_STEP),
                "warning",
                {
                    "expert": _id(g, e),
                    "experts": [_id(g, x) for x in back],
                    "layer": _layer(t.name if g is None else f"{mod}."),
                    "v_level_before": level,
                    "v_level_threshold": RETURN_V_LEVEL,
                    "step_rms": s.step_rms[e],
                    "step_threshold": RETURN_STEP,
                    "median_step_rms": med_step,
                    "r_v": s.r_v[e],
                    **({"group": t.name} if g is not None else {}),
                },
                f"{mod}: expert {_id(g, e)}{f' ({g.param})' if g is not None else ''} came back to a second moment {level:.2g}x its peers' "
                f"and moved sign-like ({s.step_rms[e]:.2f} lr per element per step, peers {med_step:.2f})",
                f"{_SOURCE}#expert-return",
                ("adam_instability",),
                primary=True,
            )
        )
    return out
