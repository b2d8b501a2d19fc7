"""The creep draws (`fixtures/creep_draws.py`): each planted mechanism really happened in
training by the fixture's own measurement, each twin stayed under its danger level, a seed's
twin shares its incident's data, and the onset rule reads as written. `history` names the
Adam draw at its tensor and onset (docs/signatures.md#history-adam) and its twin nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import ckptforensics as cf
from fixtures.creep_draws import (
    CREEP_TUNING,
    DANGER,
    GROW_FROM,
    build_creep,
    draw_creep,
    onset_range,
)

# One tuning draw of each kind, the Adam draw's own twin (forced: same seed and data, a safe
# eps) and a drawn QK-norm twin; about 10 s of training on one CPU thread.
ATTENTION, OUTPUT, ADAM, ATTENTION_TWIN = 1512, 1504, 1502, 1509


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("creep")
    return {
        "attention": build_creep(ATTENTION, root),
        "output": build_creep(OUTPUT, root),
        "adam": build_creep(ADAM, root),
        "adam-twin": build_creep(ADAM, root, twin=True),
        "attention-twin": build_creep(ATTENTION_TWIN, root),
    }


def _truth(run: Path) -> dict[str, Any]:
    return json.loads((run / "truth.json").read_text())


def _series(truth: dict[str, Any], key: str) -> dict[int, Any]:
    return {int(s): v for s, v in truth["measured"][key].items()}


def _holds_the_rule(q: dict[int, float], truth: dict[str, Any], danger: float) -> None:
    """The written rule, checked on the fixture's own per-step figures."""
    creep = truth["creep"]
    s_grow, s_danger = creep["s_grow"], creep["s_danger"]
    assert all(v > danger for s, v in q.items() if s >= s_danger)
    assert q[s_danger - 1] <= danger
    assert q[s_grow] <= GROW_FROM * danger
    assert all(v > GROW_FROM * danger for s, v in q.items() if s_grow < s < s_danger)
    lo, hi = creep["onset_range"]
    every = truth["draw"]["save_every"]
    assert (
        lo % every == 0 and hi % every == 0 and lo <= s_grow and s_danger <= hi < s_danger + every
    )
    assert truth["first_bad_step"] == s_danger


def test_attention_logits_of_the_drawn_layer_grew_past_the_cap_first(
    built: dict[str, Path],
) -> None:
    truth = _truth(built["attention"])
    d = draw_creep(ATTENTION)
    assert truth["cause"] == "attention_logit_growth" and not d.twin
    assert truth["layers"] == [f"transformer.h.{d.layer}.attn"]
    logits = _series(truth, "max_logit")  # step -> [layer][head]
    danger = DANGER["attention_logit_growth"]
    culprit = {s: max(v[d.layer]) for s, v in logits.items()}
    _holds_the_rule(culprit, truth, danger)
    s_danger = truth["creep"]["s_danger"]
    # no other layer was past the cap when the drawn one passed it for good
    others = [max(logits[s_danger][i]) for i in range(d.n_layer) if i != d.layer]
    assert all(v < danger for v in others), others
    assert logits[s_danger][d.layer][truth["head"]] == culprit[s_danger]
    assert culprit[d.steps] > 4 * culprit[truth["creep"]["s_grow"]]  # a growth, not a level


def test_output_log_z_drifted_past_the_cap(built: dict[str, Path]) -> None:
    truth = _truth(built["output"])
    assert truth["cause"] == "output_logit_divergence" and truth["layers"] == ["lm_head"]
    log_z = _series(truth, "log_z")
    _holds_the_rule(log_z, truth, DANGER["output_logit_divergence"])
    assert log_z[1] < 5  # it started near log(vocab) = 4.16 and crept up from there


def test_adam_rows_outgrew_a_sign_like_step_and_the_safe_eps_twin_did_not(
    built: dict[str, Path],
) -> None:
    truth, twin = _truth(built["adam"]), _truth(built["adam-twin"])
    d = draw_creep(ADAM)
    assert truth["cause"] == "adam_instability" and truth["tensors"] == ["transformer.wte.weight"]
    ratio = {s: v for s, v in _series(truth, "rare_update_over_lr").items() if s > d.rare_step}
    _holds_the_rule(ratio, truth, DANGER["adam_instability"])
    # before their only batch the rare rows had no moments: Adam left them where they were
    assert all(v == 0 for s, v in _series(truth, "rare_update_over_lr").items() if s < d.rare_step)
    assert twin["cause"] == "none" and twin["draw"]["eps"] == 1e-3
    calm = [v for s, v in _series(twin, "rare_update_over_lr").items() if s > d.rare_step]
    assert max(calm) < DANGER["adam_instability"]


def test_a_seeds_twin_differs_in_the_fix_only(built: dict[str, Path]) -> None:
    a, b = _truth(built["adam"])["draw"], _truth(built["adam-twin"])["draw"]
    assert {k for k in a if a[k] != b[k]} == {"twin", "eps", "forced"}
    with (
        h5py.File(built["adam"] / "batches.h5") as x,
        h5py.File(built["adam-twin"] / "batches.h5") as y,
    ):
        assert np.array_equal(x["input_ids"][()], y["input_ids"][()])


def test_the_qk_norm_twin_stayed_under_the_cap(built: dict[str, Path]) -> None:
    truth = _truth(built["attention-twin"])
    assert truth["cause"] == "none" and truth["draw"]["twin"]
    peak = max(max(map(max, v)) for v in truth["measured"]["max_logit"].values())
    assert peak < DANGER["attention_logit_growth"]


def test_a_draw_is_deterministic(built: dict[str, Path], tmp_path: Path) -> None:
    again = build_creep(ADAM, tmp_path)
    assert _truth(again)["measured"] == _truth(built["adam"])["measured"]


def test_onset_rule_on_a_known_series() -> None:
    q = {s: 1.0 for s in range(1, 21)} | {s: 2.0 ** (s - 20) for s in range(21, 41)}
    # q first exceeds 10 at step 24 (16) and stays; the last step at or under 2.5 is 21
    assert onset_range(q, 10.0, 5) == (21, 24, 20, 25)
    assert onset_range({1: 1.0, 2: 20.0, 3: 1.0}, 10.0, 1) is None  # a blip is not a creep


def test_splits_are_their_own_seeds() -> None:
    from fixtures.creep_draws import SPLITS
    from fixtures.draws import SPLITS as DRAW_SPLITS

    taken = {s for seeds in DRAW_SPLITS.values() for s in seeds}
    creep = [set(seeds) for seeds in SPLITS.values()]
    assert not taken & set().union(*creep)
    assert sum(map(len, creep)) == len(set().union(*creep))  # no seed in two splits
    assert {draw_creep(s).kind for s in CREEP_TUNING[:3]} == set(DANGER)


def test_history_names_the_adam_creep_at_its_tensor_and_onset_and_the_twin_nothing(
    built: dict[str, Path],
) -> None:
    truth = _truth(built["adam"])
    doc = cf.history(run_dir=built["adam"], model="fixtures/tinygpt.py:factory").doc
    assert [c["cause"] for c in doc["verdict"]["causes"]] == ["adam_instability"]
    assert doc["verdict"]["first_anomalous_module"] == truth["layers"][0]
    (f,) = [f for f in doc["findings"] if "adam_instability" in f["supports"]]
    assert f["kind"] == "adam_step_growth" and f["metrics"]["tensor"] == truth["tensors"][0]
    lo, hi = truth["creep"]["onset_range"]
    assert lo <= doc["history"]["onset_step"] <= hi, (doc["history"]["onset_step"], lo, hi)
    assert f["metrics"]["max_step"][-1] > 2 and f["metrics"]["growth"] >= 4
    # the plan raises the run's own beta2 (0.72 < 0.9^2), from the optimizer's saved groups
    (c,) = doc["plan"]["changes"]
    d = draw_creep(ADAM)
    assert c["knob"] == "beta2" and c["value"] == 0.95
    assert c["edits"][0]["before"] == [0.9, d.beta2] and c["edits"][0]["after"] == [0.9, 0.95]
    twin = cf.history(run_dir=built["adam-twin"], model="fixtures/tinygpt.py:factory").doc
    assert [c["cause"] for c in twin["verdict"]["causes"]] == ["none"]
    assert twin["findings"] == [] and twin["history"]["onset_step"] is None
    steps = twin["history"]["trajectories"]["max_step"]
    assert max(v for vals in steps.values() for v in vals if v is not None and v == v) < 2
