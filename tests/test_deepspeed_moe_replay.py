"""The replay of a DeepSpeed-MoE own-loop run (`fixtures/deepspeed_moe_run.py`, committed under
fixtures/data/deepspeed-moe): the model's own MoE layers (DeepSpeed's `TopKGate` routing under a
capacity) replayed from global_step4 over steps 5-8 land on the loop's log (LM loss + 0.01 x the
gates' `l_aux`), and the routing figures hold, per MoE layer and step, the tokens each expert kept
and those dropped past its capacity: none at capacity factor 4.0 (the committed run), about half
at 0.5 (the same run trained with a tight capacity, committed as fixtures/data/deepspeed-moe-tight). The reference for the dropped tokens is
DeepSpeed's own gate on the step's batch (its dense form: `dispatch_mask`, `exp_counts`), not the
replay's reading of the sparse routes."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.formats.batches import open_batches
from tests.conftest import ROOT, validate_reports

pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

RUN = ROOT / "fixtures" / "data" / "deepspeed-moe"
# The same run trained with capacity factor 0.5 (`deepspeed_moe_run.py OUT --capacity-factor 0.5`)
TIGHT_RUN = ROOT / "fixtures" / "data" / "deepspeed-moe-tight"
SCRIPT = ROOT / "fixtures" / "deepspeed_moe_run.py"


def _replay(run: Path, factory: str, out: Path) -> dict:
    r = CliRunner().invoke(
        cli,
        ["-q", "replay", "--run-dir", str(run), "--before", "4", "--after", "8"]
        + ["--model", f"{SCRIPT}:{factory}", "--batch", str(run / "batches.h5")]
        + ["--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """capacity -> (run, its replay's report.json, the report's folder)."""
    out = tmp_path_factory.mktemp("ds-moe-replay")
    return {
        "ample": (RUN, _replay(RUN, "factory", out / "ample"), out / "ample"),
        "tight": (TIGHT_RUN, _replay(TIGHT_RUN, "tight_factory", out / "tight"), out / "tight"),
    }


def _log(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r for r in rows}


@pytest.mark.parametrize("which", ["ample", "tight"])
def test_the_replay_lands_on_the_loops_log(reports: dict, which: str) -> None:
    """Every replayed step's loss (LM loss + the gates' weighted l_aux) and pre-clip grad norm
    are the run's own, and the after checkpoint is reproduced."""
    run, rep, _ = reports[which]
    log = _log(run)
    steps = rep["replay"]["steps"]
    assert [s["step"] for s in steps] == [5, 6, 7, 8]
    for s in steps:
        assert s["loss"] == pytest.approx(log[s["step"]]["loss"], rel=1e-6), s["step"]
        assert s["grad_norm"] == pytest.approx(log[s["step"]]["grad_norm"], rel=1e-5), s["step"]
    kinds = {f["kind"] for f in rep["findings"]}
    assert {"replay_log_agreement", "replay_reproduces"} <= kinds, kinds
    assert "MoE gates routing under a capacity" in rep["replay"]["config"]["model"]["value"]
    # Each row's share of the gradient (the row rules' evidence) from the linears the rows feed;
    # the experts, fed capacity buffers, are left out of it.
    for s in steps:
        sq = s["sample_grad_sq"]
        assert sq is not None and len(sq) == 4 and all(0 < v < math.inf for v in sq), s["step"]


@pytest.mark.parametrize("which", ["ample", "tight"])
def test_routing_figures_per_moe_layer(reports: dict, which: str) -> None:
    """Each step's figures name both gates and give each expert's tokens, kept and routed."""
    run, rep, _ = reports[which]
    truth = json.loads((run / "truth.json").read_text())
    assert truth["capacity_factor"] == {"ample": 4.0, "tight": 0.5}[which]
    for s in rep["replay"]["steps"]:
        r = s["router"]
        assert r["modules"] == [
            f"transformer.h.{i}.mlp.moe.deepspeed_moe.gate" for i in range(truth["moe_layers"])
        ]
        assert len(r["tokens"]) == len(r["routed"]) == truth["moe_layers"]
        for kept, routed, dropped, cap in zip(
            r["tokens"], r["routed"], r["dropped"], r["capacity"], strict=True
        ):
            assert len(kept) == truth["n_experts"] and sum(routed) == 4 * 16  # top-1, 64 tokens
            assert all(k <= min(n, cap) for k, n in zip(kept, routed, strict=True))
            assert dropped == sum(routed) - sum(kept)
        assert r["load"][0] == pytest.approx([n / 64 for n in r["routed"][0]])
    dropped = [d for s in rep["replay"]["steps"] for d in s["router"]["dropped"]]
    if which == "ample":  # ceil(64 / 4 x 4.0) = 64 routes an expert: nothing dropped
        assert set(dropped) == {0}
        assert {c for s in rep["replay"]["steps"] for c in s["router"]["capacity"]} == {64}
    else:  # ceil(64 / 4 x 0.5) = 8 routes an expert: at least half the tokens dropped
        assert min(dropped) >= 32
        assert {c for s in rep["replay"]["steps"] for c in s["router"]["capacity"]} == {8}


def _deepspeed_reference(run: Path, factory: str) -> list[tuple[list[int], int]]:
    """Each MoE layer's (kept tokens per expert, dropped) as DeepSpeed's own gate reports
    them on step 5's batch from global_step4 (training mode): the gate's dense form,
    `dispatch_mask` summed over tokens and slots, against `exp_counts` (before the cut)."""
    sys.path.insert(0, str(ROOT))
    from fixtures import deepspeed_moe_run as fx

    model = getattr(fx, factory)()
    ck = open_checkpoint(run / "global_step4")
    sd = {k: ck.tensor(k) for k in model.state_dict() if ck.has(k)}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight", "transformer.wte.weight"}
    model.train()
    inputs: list[torch.Tensor] = []
    gates = [b.mlp.moe.deepspeed_moe.gate for b in model.transformer.h]
    hooks = [g.register_forward_pre_hook(lambda _m, a: inputs.append(a[0])) for g in gates]
    batch = open_batches(str(run / "batches.h5")).batch(5)
    with torch.no_grad():
        model(batch["input_ids"])
    for h in hooks:
        h.remove()
    out = []
    with torch.no_grad():
        for g, x in zip(gates, inputs, strict=True):
            _l_aux, _combine, dispatch_mask, exp_counts = g(x)  # sparse_routes=False
            kept = dispatch_mask.sum((0, 2))
            out.append(([int(v) for v in kept], int(exp_counts.sum() - kept.sum())))
    return out


def test_the_report_shows_the_dropped_tokens(reports: dict) -> None:
    """report.md's replay section lists them per layer and step; report.json validates."""
    md = {k: (v[2] / "report.md").read_text() for k, v in reports.items()}
    assert "8 8 8 8 kept; 32 of 64 dropped (capacity 8)" in md["tight"]
    assert "; 0 of 64 dropped (capacity 64)" in md["ample"]
    assert validate_reports(reports["tight"][2].parent) == 2


@pytest.mark.parametrize(("which", "factory"), [("ample", "factory"), ("tight", "tight_factory")])
def test_dropped_tokens_are_deepspeeds_own(reports: dict, which: str, factory: str) -> None:
    run, rep, _ = reports[which]
    ref = _deepspeed_reference(run, factory)
    first = rep["replay"]["steps"][0]["router"]
    assert [list(t) for t in first["tokens"]] == [k for k, _ in ref]
    assert list(first["dropped"]) == [d for _, d in ref]
    assert (sum(d for _, d in ref) > 0) == (which == "tight")


def test_routing_drawn_from_the_rng_is_an_open_question_not_a_fault() -> None:
    """DeepSpeed's default Random Token Selection draws which tokens a full expert keeps from
    torch's RNG: the tight run replayed with it on parts from its log, and the replay names
    the draw among what it cannot exclude (a spike it misses is then no hardware fault); the
    run as trained (RTS off) names none."""
    from ckptforensics.commands.common import replay_config
    from ckptforensics.core.options import replay_options
    from ckptforensics.detectors.replay.agreement import _unexcluded
    from ckptforensics.engine.replay.run import replay

    def run(factory: str) -> tuple[list[str], list]:
        cfg = replay_config(
            4, 8, str(TIGHT_RUN / "batches.h5"), TIGHT_RUN,
            replay_options(None, model=f"{SCRIPT}:{factory}"), None,
        )  # fmt: skip
        rep = replay(cfg)
        return _unexcluded(rep), [r.router for r in rep.records]

    open_rts, routers = run("rts_factory")
    assert all(r.drawn == ("random token selection in full experts",) * 2 for r in routers)
    assert any("drew their routing from torch's RNG" in q for q in open_rts), open_rts
    open_plain, routers = run("tight_factory")
    assert all(r.drawn == ("", "") for r in routers)
    assert not any("RNG" in q for q in open_plain), open_plain
