"""History's rules on trajectories written by hand: the layer that passed the attention cap
first leads, a departure off the climb to the cap dates nothing (docs/signatures.md#history-
attention), Adam's steps named only when they climb for good past a sign-like step
(#history-adam), and a later cause's findings are context to the first one's."""

from __future__ import annotations

import math

from ckptforensics.detectors import Thresholds
from ckptforensics.detectors.history import HistoryEvidence, Trajectory, history_findings

STEPS = tuple(range(10, 130, 10))  # 12 checkpoints


def _ev(attn: dict[str, list[float]], steps_lr: dict[str, list[float]]) -> HistoryEvidence:
    trs = [Trajectory(m, "attn_max_logit", STEPS, tuple(v)) for m, v in attn.items()]
    trs += [Trajectory(m, "max_step", STEPS, (math.nan, *v)) for m, v in steps_lr.items()]
    return HistoryEvidence(
        steps=STEPS, attn_modules=tuple(attn), head=None, trajectories=tuple(trs)
    )


def test_the_layer_past_the_cap_first_leads_and_a_late_turn_is_no_onset() -> None:
    # h.0 rises in early learning (a departure at 50) but reaches 50 only at step 110;
    # h.1 climbs from 10 at step 40 past 50 for good at step 70, then turns up again at 110
    h0 = [0.1, 0.1, 0.2, 0.2, 3.0, 6.0, 12.0, 20.0, 30.0, 45.0, 55.0, 60.0]
    h1 = [1.0, 2.0, 4.0, 10.0, 20.0, 35.0, 60.0, 70.0, 75.0, 80.0, 300.0, 400.0]
    found = history_findings(_ev({"h.0.attn": h0, "h.1.attn": h1}, {}))
    assert [f.subject for f in found] == ["h.1.attn", "h.0.attn"]
    # the turn at 110 comes after h.1 passed the cap: its onset is where it passed it for good
    assert found[0].metrics["onset_step"] == 70


def test_adams_steps_named_when_they_climb_for_good_past_a_sign_like_step() -> None:
    flat = [0.8, 0.9, 0.85, 0.8, 0.9, 0.85, 0.8, 0.9, 0.85, 0.8, 0.9]
    creep = [1.1, 1.2, 1.0, 1.1, 0.9, 1.4, 2.0, 3.0, 4.5, 7.0, 11.0]
    # a tensor past 2 that does not keep climbing (a plateau) is no creep
    plateau = [1.0, 1.5, 2.2, 2.4, 2.3, 2.5, 2.6, 2.4, 2.5, 2.6, 2.7]
    found = history_findings(
        _ev({}, {"wte.weight": creep, "h.0.w": flat, "lm_head.weight": plateau})
    )
    (f,) = found
    assert f.subject == "wte" and f.metrics["tensor"] == "wte.weight"
    assert f.supports == ("adam_instability",) and f.primary
    # the climb starts at the checkpoint after its last low (0.9 at step 60)
    assert f.metrics["onset_step"] == 70 and f.metrics["growth"] > 4


def test_a_later_cause_is_context_to_the_first() -> None:
    creep = [1.1, 1.2, 1.0, 1.1, 0.9, 1.4, 2.0, 3.0, 4.5, 7.0, 11.0]  # climbs from step 70
    late = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 40.0, 60.0, 80.0]  # passes 50 at 110
    found = history_findings(_ev({"h.0.attn": late}, {"wte.weight": creep}), Thresholds())
    by = {f.kind: f for f in found}
    assert by["adam_step_growth"].primary and by["adam_step_growth"].severity == "warning"
    ctx = by["attention_logit_growth"]
    assert ctx.severity == "info" and not ctx.primary
    assert ctx.message.endswith("(after adam_instability from step 70: its effect, context)")
