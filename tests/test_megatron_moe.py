"""A megatron-core 0.19 MoE run (`fixtures/megatron_moe_run.py`, committed under
fixtures/data/megatron-core-0.19-moe): GPTModel with SequentialMLP experts (4, top-2, aux and
z losses), torch_dist with the plain optimizer, expert 2 of layer 1 at 1000x its LR between
the saves (4 -> 8), the LR restored before the second; DeepSpeed-MoE's twin
(tests/test_deepspeed_moe.py).

torch_dist keeps each layer's experts in one tensor, `decoder.layers.mlp.experts.experts.<param>`
[layers, experts, ...] (the global expert index on its own dim); the reader gives each expert
its own tensor under SequentialMLP's name (`...mlp.experts.local_experts.<e>.<param>`), and the
diff's split-expert path names the planted expert alone, past Adam's bound: lr_too_high.

The replay rebuilds the model with the reference GPTModel's MoE layers
(trainers/megatron/moe.py) from the checkpoint's args: Megatron-LM's printed `lm loss` is the LM
loss alone, the routers' load-balancing and z-losses entering only the gradient (megatron-core's
MoEAuxLossAutoScaler, at 1 / the micro-batches). No training here, no megatron-core needed."""

from __future__ import annotations

import json
import statistics

import h5py
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.trainers.megatron.experts import experts_in_order, split_experts
from ckptforensics.trainers.megatron.model import megatron_gpt
from tests.conftest import ROOT, assert_one_expert_named, megatron_dist_name

RUN = ROOT / "fixtures" / "data" / "megatron-core-0.19-moe"
TRUTH = json.loads((RUN / "truth.json").read_text())
BEFORE, AFTER = TRUTH["before"], TRUTH["after"]
LOCAL = ".mlp.experts.local_experts."


def _sums(t: torch.Tensor) -> tuple[float, float]:
    t = t.detach().double()
    return float(t.sum()), float(t.abs().sum())


@pytest.mark.parametrize("step", [BEFORE, AFTER])
def test_every_tensor_and_its_adam_state_is_read_per_expert(step: int) -> None:
    """Every parameter the live model had, each expert's own slice of the stacked tensors,
    with Adam's moments and step; the values are those of the live objects at the save."""
    ck = open_checkpoint(RUN / f"iter_{step:07d}")
    assert ck.format == "megatron-dist" and ck.step == step
    assert ck.scalars["moe_experts"] == TRUTH["n_experts"]
    live = TRUTH["saves"][str(step)]["params"]
    assert sorted(ck.names()) == sorted(megatron_dist_name(n) for n in live)
    experts = [n for n in ck.names() if LOCAL in n]
    assert len(experts) == TRUTH["moe_layers"] * TRUTH["n_experts"] * 2  # fc1, fc2
    assert ck.optimizer is not None and ck.optimizer.kind == "adam"
    for name, rec in live.items():
        n = megatron_dist_name(name)
        w, st = ck.tensor(n), ck.optim_state(n)
        assert list(w.shape) == rec["shape"] == list(ck.meta(n).shape), n
        assert int(st["step"]) == int(rec["step"]) == step
        for field, t in (
            ("param", w),
            ("exp_avg", st["exp_avg"]),
            ("exp_avg_sq", st["exp_avg_sq"]),
        ):
            s, a = _sums(t)
            assert s == pytest.approx(rec[field]["sum"], rel=1e-9, abs=1e-12), (n, field)
            assert a == pytest.approx(rec[field]["abs_sum"], rel=1e-9, abs=1e-12), (n, field)
    # The planted expert's group is Megatron's own, its LR as saved (restored before the save).
    assert ck.hyper(TRUTH["tensors"][0]).lr == pytest.approx(TRUTH["lr"])
    assert TRUTH["saves"][str(step)]["param_group_lr"][TRUTH["optimizer_group"]] == TRUTH["lr"]


def test_inspect_reads_every_tensor_with_its_state() -> None:
    r = CliRunner().invoke(cli, ["inspect", "--run-dir", str(RUN), str(AFTER)])
    assert r.exit_code == 0, r.output
    n = len(TRUTH["parameters"])
    assert f"in {n} tensors" in r.output and f"{n} params with state" in r.output, r.output
    assert "ids mapped by sharded key" in r.output
    assert f"hold {TRUTH['n_experts']} experts" in r.output


@pytest.fixture(scope="module")
def rep() -> dict:
    """The diff's JSON report of the committed pair (4 -> 8), run once for the module."""
    r = CliRunner().invoke(
        cli,
        ["diff", "--run-dir", str(RUN), "--before", str(BEFORE), "--after", str(AFTER)]
        + ["--workers", "1", "--json"],
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_diff_names_the_expert_run_at_1000x_its_lr_alone(rep: dict) -> None:
    """Expert 2 of layer 1, in each of its tensors, ~700x its peers' update/weight and past
    Adam's bound at its recorded LR on every element: lr_too_high; no other expert named."""
    assert rep["verdict"]["causes"][0]["cause"] == TRUTH["cause"], rep["verdict"]
    tensors = {t["name"]: t for t in rep["diff"]["tensors"]}
    assert len(tensors) == len(TRUTH["parameters"])
    past = {n for n, t in tensors.items() if t.get("bound_violations")}
    assert past == set(TRUTH["tensors"]), past
    for n in TRUTH["tensors"]:
        assert tensors[n]["bound_violations"] == tensors[n]["numel"]
    assert_one_expert_named(rep, TRUTH)
    hot = f"decoder.layers.{TRUTH['moe_layer']}{LOCAL}{TRUTH['expert']}."
    assert rep["verdict"]["exploding_layers"][0].startswith(hot)
    # No finding on any other expert's tensor.
    named = {f["subject"] for f in rep["findings"] if LOCAL in str(f["subject"])}
    assert all(s.startswith(hot) for s in named), named


def test_diff_leaves_the_routers_untouched(rep: dict) -> None:
    """The routers moved as the dense tensors did: within Adam's bound, at their peers'
    update/weight, named by no finding."""
    tensors = {t["name"]: t for t in rep["diff"]["tensors"]}
    routers = [n for n in tensors if n.endswith(".mlp.router.weight")]
    assert len(routers) == TRUTH["moe_layers"]
    dense = statistics.median(
        t["update_ratio"] for n, t in tensors.items() if n not in TRUTH["tensors"]
    )
    for n in routers:
        assert not tensors[n]["bound_violations"]
        assert tensors[n]["update_ratio"] < 3 * dense
    assert not [f for f in rep["findings"] if "router" in str(f["subject"])]


def test_audit_reads_the_routing_settings() -> None:
    """The audit does not crash on the MoE checkpoint; its MoE rows read Megatron's args."""
    r = CliRunner().invoke(
        cli, ["audit", "--run-dir", str(RUN), str(AFTER), "--compare", "none", "--json"]
    )
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in json.loads(r.stdout)["audit"]["rows"]}
    assert rows["load_balancing"]["status"] == "ok"
    assert str(TRUTH["moe_aux_loss_coeff"]) in rows["load_balancing"]["message"]
    assert rows["router_z_loss"]["status"] == "ok"
    assert str(TRUTH["moe_z_loss_coeff"]) in rows["router_z_loss"]["message"]
    assert rows["router_precision"]["status"] == "ok"
    # The router's z-loss is no z-loss on the output logits.
    assert "moe_z_loss_coeff" not in rows["logit_control"]["message"], rows["logit_control"]


def test_split_views_name_each_expert_and_keep_module_order() -> None:
    stacked = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    views = [
        ("decoder.layers.1.mlp.experts.experts.linear_fc1.weight", lambda: stacked[1], 1),
        ("decoder.layers.1.mlp.router.weight", lambda: stacked[0], 1),
        ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", lambda: stacked[0], 1),
    ]
    out = split_experts(views, 3)
    names = [n for n, _, _ in out]
    assert names == [
        *(f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(3)),
        "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
    ]
    assert [lead for _, _, lead in out] == [2, 2, 2, 1, 1]
    assert torch.equal(out[2][1](), stacked[1, 2])
    rest = [
        "mlp.router.weight",
        *(f"mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(2)),
        *(f"mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(2)),
        "mlp.linear_fc1.layer_norm_weight",
    ]
    assert experts_in_order(rest) == [
        "mlp.router.weight",
        "mlp.experts.local_experts.0.linear_fc1.weight",
        "mlp.experts.local_experts.0.linear_fc2.weight",
        "mlp.experts.local_experts.1.linear_fc1.weight",
        "mlp.experts.local_experts.1.linear_fc2.weight",
        "mlp.linear_fc1.layer_norm_weight",
    ]


def _grad_norm(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> float:
    model.zero_grad()
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return float(sum(p.grad.double().square().sum() for p in model.parameters()).sqrt())


def test_reference_moe_model_is_megatrons_forward_and_gradient() -> None:
    """The reference GPT built from the iteration-4 save's args, in training mode on iteration
    5's batch: megatron-core's LM loss, each layer's load-balancing and z-loss (summed over
    the 2 micro-batches, as its tracker holds them) and its pre-clip grad norm, which holds
    the MoE losses' gradients at 1 / the micro-batches (none, or as a loss term: off by
    ~3e-5 and ~5e-5)."""
    ck = open_checkpoint(RUN / f"iter_{BEFORE:07d}")
    model, _ = megatron_gpt(ck.config, ck.names())
    assert sorted(n for n, _ in model.named_parameters()) == sorted(ck.names())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ck.tensor(n))
    model.train()
    with h5py.File(RUN / "batches.h5") as f:
        row = list(f["step"][:]).index(BEFORE + 1)
        ids, labels = torch.from_numpy(f["input_ids"][row]), torch.from_numpy(f["labels"][row])
    it = TRUTH["iterations"][BEFORE]
    assert it["step"] == BEFORE + 1
    logits = model(ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    assert float(loss.detach()) == pytest.approx(it["loss"], rel=1e-6)
    moe = [layer.mlp for layer in model.decoder.layers]
    for name, per_layer in it["moe_losses"].items():
        assert [m.last_losses[name] for m in moe] == pytest.approx(per_layer, rel=1e-6), name
    assert _grad_norm(model, ids, labels) == pytest.approx(it["grad_norm"], rel=2e-6)
    for m in moe:
        m.grad_scale = 0.0  # the MoE losses out of the gradient
    assert _grad_norm(model, ids, labels) != pytest.approx(it["grad_norm"], rel=1e-5)


def test_replay_lands_on_the_log_until_the_experts_unrecorded_lr(tmp_path) -> None:
    """`replay 4 -> 8` on the run's batch log and printed log: iteration 5 lands on the
    logged loss and on the run's grad norm (the aux and z losses' gradients in it); from 6
    on the replay leaves the log, as it must: expert 2 of layer 1 took iteration 5's update
    at 1000x its group's LR, which neither the log (group 0's LR) nor torch_dist (no group
    members) records, so the replay withholds itself; the diff names the expert."""
    out = tmp_path / "rep"
    args = ["replay", "--run-dir", str(RUN), "--before", str(BEFORE), "--after", str(AFTER)]
    args += ["--batch", str(RUN / "batches.h5"), "--out", str(out)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output[-2000:]
    doc = json.loads((out / "report.json").read_text())
    check = doc["replay"]["check"]
    assert check["checked_steps"] == TRUTH["steps"]
    first = check["steps"][0]
    live = TRUTH["iterations"][BEFORE]
    assert first["step"] == BEFORE + 1 and first["loss_ok"] and first["grad_ok"], first
    assert first["loss"] == pytest.approx(live["loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(live["grad_norm"], rel=2e-6)
    assert check["first_miss"] == BEFORE + 2, check
    assert "mixture of experts" not in r.output
    assert doc["verdict"]["causes"][0]["cause"] == TRUTH["cause"], doc["verdict"]
    expert = [f for f in doc["findings"] if f["kind"] == "expert_update_outlier"]
    assert {f["subject"] for f in expert} == set(TRUTH["tensors"]), expert
    assert all(f["metrics"]["expert"] == TRUTH["expert"] for f in expert)
