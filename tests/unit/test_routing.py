"""The MoE routing detectors (`detectors/replay/routing.py`) on routing figures as the replay
records them: a layer judged against its own first steps, never against perfect balance."""

from __future__ import annotations

from dataclasses import dataclass

from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.replay.evidence import ReplayEvidence
from ckptforensics.detectors.replay.routing import routing
from ckptforensics.engine.replay.routers import RouterFigures


@dataclass
class _Rec:
    step: int
    router: RouterFigures


@dataclass
class _Rep:
    records: list


def _figures(load: list[float], logit: float, entropy: float = 1.3) -> RouterFigures:
    return RouterFigures(
        load=(tuple(load),), logit_max=(logit,), entropy=(entropy,), top_k=2,
        modules=("model.layers.0.mlp.gate",),
    )  # fmt: skip


def _findings(loads: list[list[float]], logits: list[float]) -> list:
    recs = [
        _Rec(10 + i, _figures(x, g)) for i, (x, g) in enumerate(zip(loads, logits, strict=True))
    ]
    return routing(ReplayEvidence(_Rep(recs)), Thresholds())


def test_routine_imbalance_is_quiet() -> None:
    """A router that favours two experts all along (70% of the slots, a wiggle of a few
    points) and whose logits wander: its own level, nothing to report."""
    loads = [
        [0.36 + d, 0.34 - d, 0.18, 0.12] for d in (0.0, 0.02, -0.01, 0.03, -0.02, 0.01, 0.0, 0.02)
    ]
    logits = [3.0, 3.3, 2.9, 3.4, 3.1, 3.6, 3.2, 3.5]
    assert _findings(loads, logits) == []


def test_collapse_and_logit_jump_name_the_router() -> None:
    """Balanced for three steps, then two experts take 97% of the slots while the router's
    largest logit jumps 10x: both findings, at the router, dated where they happen."""
    loads = [[0.26, 0.25, 0.25, 0.24]] * 3 + [[0.49, 0.48, 0.02, 0.01]] * 3
    logits = [1.0, 1.1, 0.9, 10.0, 12.0, 14.0]
    found = {f.kind: f for f in _findings(loads, logits)}
    assert set(found) == {"expert_collapse", "router_logit_growth"}
    assert found["expert_collapse"].subject == "model.layers.0.mlp.gate"
    assert found["expert_collapse"].metrics["step"] == 13
    assert found["expert_collapse"].metrics["busiest"] == [0, 1]
    assert found["router_logit_growth"].metrics["step"] == 13
    assert all(f.supports == ("expert_collapse",) for f in found.values())


def test_a_dead_experts_return() -> None:
    """Expert 3 idles for three steps, then takes a fifth of the slots: its return is named,
    once, at its step; an expert that is merely quiet (5%) is not idle."""
    loads = (
        [[0.30, 0.30, 0.35, 0.05]] * 2
        + [[0.34, 0.33, 0.33, 0.0]] * 3
        + [[0.27, 0.27, 0.26, 0.20]] * 2
    )
    found = [f for f in _findings(loads, [2.0] * len(loads)) if f.kind == "expert_return"]
    assert [(f.metrics["expert"], f.metrics["step"], f.metrics["idle_steps"]) for f in found] == [
        (3, 15, 3)
    ]
    assert found[0].supports == ("adam_instability",)
