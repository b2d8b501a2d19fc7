"""A Mixture-of-Experts model's routers across the replayed window (`engine/replay/routers`).

Two signatures, each judged against the same layer's own earlier steps in the window, never
against a fixed balance: a healthy MoE run routes unevenly all the time (Switch Transformer
§2.2 adds its load-balancing loss because it does), and only a departure from its own level is
an incident.

- **Expert collapse** (`expert_collapse`): the k busiest experts of a layer (k = the top-k the
  router picks) take almost every routed slot (`COLLAPSED`), up from where that layer routed
  on the window's first steps by more than `z` robust spreads (floor `SHARE_FLOOR`): the
  router sends most tokens to few experts, the others idle (ST-MoE 2202.08906 §3; a router
  whose logits grow turns its softmax into a hard pick, Muennighoff et al. 2409.02060 §4.2).
- **A dead expert's return** (`expert_return`): an expert that took under `IDLE` of a layer's
  slots on at least two steps in a row takes a balanced share's half again: its gradient was
  zero while idle, Adam's second moment decayed by beta2 a step, and the returning gradient
  meets a stale v, the sign-like, LR-sized updates of Adam's epsilon regime (Molybog et al.
  2023, arXiv 2304.09871; the first-token-dropping return of OLMoE's dead experts).
- **Router logits growing** (`router_logit_growth`): a layer's largest |router logit| rises
  to `GROWTH` x its level on the window's first steps and past `z` robust spreads of it, a jump
  or a climb: what a router z-loss holds down (ST-MoE's z-loss, 1e-3 log^2 Z of the router).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ckptforensics.core.stats import MAD_TO_SIGMA
from ckptforensics.detectors.base import Finding, Thresholds, cap
from ckptforensics.detectors.replay.evidence import ReplayEvidence

__all__ = ["routing", "COLLAPSED", "GROWTH", "SHARE_FLOOR", "LOGIT_FLOOR", "IDLE"]

COLLAPSED = 0.9  # the k busiest experts' share of routed slots that is "almost every"
SHARE_FLOOR = 0.05  # the least spread of a layer's top-k share across steps (5 points)
GROWTH = 4.0  # the least rise of a router's largest logit over the window
IDLE = 0.01  # an expert's share of the slots below which it is idle
LOGIT_FLOOR = math.log(1.25)  # the least spread of its log across steps (a 25% wiggle)
_SOURCE = "docs/signatures.md#moe-routing (Switch 2101.03961; ST-MoE 2202.08906; Muennighoff et al. 2409.02060)"


def routing(ev: ReplayEvidence, th: Thresholds) -> list[Finding]:
    """Expert collapse and growing router logits, per MoE layer of the replayed model."""
    recs = [r for r in ev.rep.records if getattr(r, "router", None) is not None]
    if len(recs) < 3:
        return []
    layers = len(recs[0].router.load)
    out: list[Finding] = []
    for layer in range(layers):
        out += _collapse(recs, layer, th)
        out += _returns(recs, layer)
        out += _logit_growth(recs, layer, th)
    return out


def _departure(
    x: np.ndarray, floor: float, th: Thresholds, far: Callable[[float, float], bool]
) -> tuple[int | None, np.ndarray, float]:
    """The first step past the window's first third where `x` stands more than `z` robust
    spreads (at least `floor`) above that third's median and `far(x, median)` holds: a layer
    judged against its own first steps. Returns (its index or None, every step's z, median)."""
    head = max(2, len(x) // 3)
    base = float(np.median(x[:head]))
    spread = max(float(np.median(np.abs(x[:head] - base))) * MAD_TO_SIGMA, floor)
    z = (x - base) / spread
    hit = next((i for i in range(head, len(x)) if z[i] > th.z and far(float(x[i]), base)), None)
    return hit, z, base


def _top_share(load: tuple[float, ...], k: int) -> float:
    return float(sum(sorted(load, reverse=True)[:k]))


def _collapse(recs: list, layer: int, th: Thresholds) -> list[Finding]:
    loads = [r.router.load[layer] for r in recs]
    experts = len(loads[0])
    k = min(recs[0].router.top_k, experts - 1)
    share = np.array([_top_share(x, k) for x in loads])
    hit, z, base = _departure(share, SHARE_FLOOR, th, lambda x, _: x >= COLLAPSED)
    if hit is None:
        return []
    r = recs[hit]
    busiest = sorted(range(experts), key=lambda e: -loads[hit][e])[:k]
    idle = [e for e in range(experts) if loads[hit][e] < 0.01]
    return [
        Finding(
            "",
            "expert_collapse",
            r.router.modules[layer],
            cap(z[hit] / th.z),
            "warning",
            {
                "layer": layer,
                "step": r.step,
                "top_k": k,
                "top_share": [float(x) for x in share],
                "steps": [x.step for x in recs],
                "busiest": busiest,
                "idle": idle,
                "base_share": base,
                "z": float(z[hit]),
            },
            f"step {r.step}: {r.router.modules[layer]} sends {share[hit]:.0%} of its routed slots to experts "
            f"{', '.join(map(str, busiest))} (its first steps: {base:.0%}; {z[hit]:.1f} spreads up)"
            + (f"; experts {', '.join(map(str, idle))} get none" if idle else ""),
            _SOURCE,
            ("expert_collapse",),
        )
    ]


def _returns(recs: list, layer: int) -> list[Finding]:
    """Experts idle on two or more consecutive steps that take half a balanced share again."""
    loads = np.array([r.router.load[layer] for r in recs])  # [steps, experts]
    experts = loads.shape[1]
    back = 0.5 / experts  # half a balanced share of the slots (the shares sum to 1)
    out = []
    for e in range(experts):
        idle = 0
        for i, share in enumerate(loads[:, e]):
            if share < IDLE:
                idle += 1
                continue
            if idle >= 2 and share >= back:
                r = recs[i]
                out.append(
                    Finding(
                        "",
                        "expert_return",
                        r.router.modules[layer],
                        cap(idle / 2),
                        "warning",
                        {
                            "layer": layer,
                            "expert": e,
                            "step": r.step,
                            "idle_steps": idle,
                            "share": float(share),
                            "shares": [float(x) for x in loads[:, e]],
                        },  # fmt: skip
                        f"step {r.step}: expert {e} of {r.router.modules[layer]} takes {share:.0%} of the slots after "
                        f"{idle} idle steps (under {IDLE:.0%}): its Adam second moment decayed while it had no gradient, "
                        "so its returning updates are sign-like and LR-sized",
                        _SOURCE,
                        ("adam_instability",),
                    )
                )
                break
            idle = 0
    return out


def _logit_growth(recs: list, layer: int, th: Thresholds) -> list[Finding]:
    """The first step past the window's first third whose largest router logit is `GROWTH` x
    that third's median and more than `z` robust spreads (log scale, floor `LOGIT_FLOOR`) above
    it: a jump as well as a climb."""
    mx = np.array([r.router.logit_max[layer] for r in recs])
    if not np.all(np.isfinite(mx)) or np.any(mx <= 0):
        return []
    hit, z, base = _departure(
        np.log(mx), LOGIT_FLOOR, th, lambda x, base: x - base >= math.log(GROWTH)
    )
    if hit is None:
        return []
    r, first = recs[hit], float(np.exp(base))
    ent = [x.router.entropy[layer] for x in recs]
    return [
        Finding(
            "",
            "router_logit_growth",
            r.router.modules[layer],
            cap(z[hit] / th.z),
            "warning",
            {
                "layer": layer,
                "step": r.step,
                "logit_max": [float(x) for x in mx],
                "steps": [x.step for x in recs],
                "growth": float(mx[hit] / first),
                "z": float(z[hit]),
                "entropy": [float(e) for e in ent],
            },  # fmt: skip
            f"step {r.step}: {r.router.modules[layer]}'s largest logit is {mx[hit]:.3g}, {mx[hit] / first:.1f}x its "
            f"{first:.3g} on the window's first steps ({z[hit]:.1f} spreads up); its routing entropy "
            f"{ent[0]:.2f} -> {ent[hit]:.2f} nats: the router's softmax turns into a hard pick, which a router z-loss holds back",
            _SOURCE,
            ("expert_collapse",),
        )
    ]
