"""The replay's detectors: pure functions behind one protocol; the verdict reads their findings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckptforensics.detectors import Finding, Thresholds
from ckptforensics.detectors import replay as rd
from ckptforensics.engine.replay.run import ReplayConfig, replay
from ckptforensics.verdict import replay_fields
from tests.conftest import truth


def _f(kind: str, subject: str, primary: bool = False, **metrics: object) -> Finding:
    return Finding("", kind, subject, 1.0, "warning", dict(metrics), "", "", (), primary)


def test_replay_fields_settle_in_one_place() -> None:
    """The earliest onset; an overflow only without one; a stale second moment and a step
    the before state pins make it earlier; the forward-order module comes first."""
    spike = _f("replay_spike", "step 12", step=12)
    over = _f("replay_overflow", "h.1.mlp", step=14, tensor={"name": "h.1.mlp"})
    fwd = _f("first_forward_anomaly", "h.0.attn", step=12)
    rms = _f("rms_t", "h.2.mlp.c_fc.weight", primary=True, step=11)
    assert replay_fields([over])["first_bad_step"] == 14
    assert replay_fields([spike, over])["first_bad_step"] == 12
    got = replay_fields([spike, fwd, over, rms], state_steps=[13])
    assert got["first_bad_step"] == 11 and got["first_anomalous_module"] == "h.0.attn"
    assert got["overflowing_tensors"] == [{"name": "h.1.mlp"}]
    assert replay_fields([over, rms])["first_anomalous_module"] == "h.1.mlp"
    assert replay_fields([rms])["first_anomalous_module"] == "h.2.mlp.c_fc"
    assert replay_fields([_f("replay_config_mismatch", "run")]) == {"reproducible": None}
    assert replay_fields([]) == {}


def test_replay_detectors_do_not_depend_on_their_order(zoo: dict[str, Path]) -> None:
    """Every detector of a stage reads the same evidence and writes nothing: run in reverse,
    a stage gives the same findings, and the verdict's fields are the planted truth."""
    run = zoo["poison_batch"]
    t = truth(run)
    rep = replay(
        ReplayConfig(
            before=run / "step_30.pt",
            after=run / "step_35.pt",
            batch=str(run / "batches.h5"),
            model="fixtures/tinygpt.py:factory",
        )
    )
    th = Thresholds()
    ev = rd.ReplayEvidence(rep)
    onset = [f for d in rd.ONSET_DETECTORS for f in d(ev, th)]
    ev = rd.ReplayEvidence(
        rep, min(f.metrics["step"] for f in onset if f.kind in rd.ONSET_KINDS), True
    )
    for stage in (rd.EXAMINE_DETECTORS, rd.STATE_DETECTORS):
        forward = [f for d in stage for f in d(ev, th)]
        backward = [f for d in reversed(stage) for f in d(ev, th)]
        assert sorted(map(repr, forward)) == sorted(map(repr, backward))
    found = rd.replay_findings(rep, th)
    assert all(
        dataclasses.is_dataclass(f) and f.source.startswith("docs/signatures.md") for f in found
    )
    fields = replay_fields(found)
    assert fields["first_bad_step"] == t["first_bad_step"]
    assert sorted(x["index"] for x in fields["anomalous_samples"]) == sorted(t["samples"])
    assert fields["reproducible"] is True
