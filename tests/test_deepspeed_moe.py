"""DeepSpeed-MoE checkpoints written by real DeepSpeed (`fixtures/deepspeed_moe_run.py`,
committed under fixtures/data/deepspeed-moe): the experts' `layer_{L}_expert_{E}_...` files
read beside the dense model states, each expert tensor under its full name with its ZeRO-1
optimizer state; the diff of the pair names the planted incident (expert 2 of MoE layer 1
at 1000x its LR between the saves, the LR restored before the second save), per expert too:
the one-tensor-per-expert records stacked per module and parameter (`split_groups`) give the
expert rules of fused tensors their statistics. No training here, no DeepSpeed needed."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.detectors.base import Thresholds
from ckptforensics.detectors.diff.experts import (
    detect_dead_experts,
    detect_expert_return,
    detect_expert_update_outlier,
)
from ckptforensics.engine.diff.chunks import Moments, Pair, Staging
from ckptforensics.engine.diff.experts import ExpertAcc, expert_slices, split_groups, split_key
from ckptforensics.engine.diff.records import DiffResult, ExpertStats, PairInfo, TensorDiff
from ckptforensics.formats.torchfile import load_torch_file
from tests.conftest import ROOT, assert_one_expert_named
from tests.test_cli import assert_bad_input

RUN = ROOT / "fixtures" / "data" / "deepspeed-moe"
TRUTH = json.loads((RUN / "truth.json").read_text())
EXPERTS = ".mlp.moe.deepspeed_moe.experts.deepspeed_experts."


def _expert_names(names: list[str]) -> list[str]:
    return [n for n in names if EXPERTS in n]


def test_expert_tensors_are_read_with_their_optimizer_state() -> None:
    ck = open_checkpoint(RUN / TRUTH["after"])
    assert ck.format == "deepspeed" and ck.step == 8 and ck.scalars["zero_stage"] == 1
    names = _expert_names(ck.names())
    # 2 MoE layers x 4 experts x (fc1, fc2) x (weight, bias), each from its own file.
    assert len(names) == TRUTH["moe_layers"] * TRUTH["n_experts"] * 4
    assert ck.scalars["moe_experts"] == {"0": 4, "1": 4}
    for n in TRUTH["tensors"]:
        assert n in names
        w = ck.tensor(n)
        st = ck.optim_state(n)
        assert st["exp_avg"].shape == w.shape == st["exp_avg_sq"].shape
        assert float(st["exp_avg_sq"].min()) >= 0 and float(st["exp_avg_sq"].max()) > 0
    # The router stays in the dense model states.
    assert ck.has("transformer.h.1.mlp.moe.deepspeed_moe.gate.wg.weight")
    # The expert's own (moe) group: its LR as saved (restored before the save).
    hot = ck.hyper(TRUTH["tensors"][0])
    assert hot.lr == pytest.approx(TRUTH["lr"])


def test_inspect_lists_the_expert_tensors() -> None:
    r = CliRunner().invoke(cli, ["inspect", "--all", str(RUN / TRUTH["after"])])
    assert r.exit_code == 0, r.output
    for n in TRUTH["tensors"]:
        assert n in r.output
    assert "DeepSpeed-MoE: 32 expert tensors" in r.output


@pytest.fixture(scope="module")
def rep() -> dict:
    """The diff's JSON report of the committed pair (steps 4 -> 8), run once for the module."""
    r = CliRunner().invoke(
        cli,
        ["diff", "--run-dir", str(RUN), "--before", "4", "--after", "8", "--workers", "1"]
        + ["--json"],
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_diff_names_the_expert_run_at_1000x_its_lr(rep: dict) -> None:
    causes = [c["cause"] for c in rep["verdict"]["causes"]]
    assert causes and causes[0] == "lr_too_high", rep["verdict"]
    tensors = {t["name"]: t for t in rep["diff"]["tensors"]}
    assert set(_expert_names(list(tensors))) >= set(TRUTH["tensors"])
    # Only the planted expert's tensors moved further than Adam allows at the saved LR ...
    past = {n for n, t in tensors.items() if t.get("bound_violations")}
    assert past == set(TRUTH["tensors"]), past
    # ... and they lead the update/weight ratios, far ahead of every other tensor.
    top = sorted(tensors, key=lambda n: -(tensors[n]["update_ratio"] or 0))
    assert set(top[: len(TRUTH["tensors"])]) == set(TRUTH["tensors"])
    rest = tensors[top[len(TRUTH["tensors"])]]["update_ratio"]
    assert min(tensors[n]["update_ratio"] for n in TRUTH["tensors"]) > 5 * rest


def test_per_expert_evidence_names_expert_2_of_layer_1_alone(rep: dict) -> None:
    """The split experts stacked per module and parameter: expert 2 of MoE layer 1 stands out
    in each of its 4 tensors (~800x its peers' update/weight), past Adam's bound at its
    recorded LR (so the finding supports lr_too_high); no other expert is named."""
    assert rep["verdict"]["causes"][0]["cause"] == "lr_too_high", rep["verdict"]
    for f in assert_one_expert_named(rep, TRUTH):
        assert f"deepspeed_experts.{TRUTH['expert']}." in f["subject"]
    # The expert's tensors lead the exploding layers.
    lead = rep["verdict"]["exploding_layers"][0]
    assert lead.startswith(f"transformer.h.{TRUTH['moe_layer']}{EXPERTS}{TRUTH['expert']}.")


def test_split_key_groups_per_expert_names_and_leaves_dense_ones() -> None:
    ds = "transformer.h.1.mlp.moe.deepspeed_moe.experts.deepspeed_experts"
    assert split_key(f"{ds}.2.fc1.weight") == (ds, 2, "fc1.weight")
    mg = "decoder.layers.3.mlp.experts.local_experts"
    assert split_key(f"{mg}.7.linear_fc1.weight") == (mg, 7, "linear_fc1.weight")
    mx = "model.layers.0.block_sparse_moe.experts"
    assert split_key(f"{mx}.5.w1.weight") == (mx, 5, "w1.weight")
    for dense in (
        "model.layers.0.mlp.experts.gate_up_proj",  # fused: read per expert along its dim 0
        "model.layers.0.mlp.gate_proj.weight",
        "transformer.h.1.mlp.moe.deepspeed_moe.gate.wg.weight",
        "decoder.layers.3.mlp.router.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
        "transformer.h.2.attn.c_attn.weight",
    ):
        assert split_key(dense) is None, dense
    assert expert_slices(f"{mx}.5.w1.weight", (16, 8), 8) == 1
    assert expert_slices("model.layers.0.mlp.experts.gate_up_proj", (8, 4, 16), 8) == 8
    assert expert_slices("model.layers.0.mlp.gate_proj.weight", (8, 16), 8) is None
    # Grouped per module and parameter across the experts, shapes equal, 2 experts or more.
    ts = [
        _td(f"{mg}.{e}.{p}", (8, 4))
        for e in (1, 0, 2)
        for p in ("linear_fc1.weight", "linear_fc2.weight")
    ]
    ts += [_td(f"{mx}.0.w1.weight", (8, 4)), _td(f"{mx}.1.w1.weight", (4, 8))]  # shapes differ
    ts += [_td(f"{ds}.0.fc1.weight", (8, 4))]  # one expert
    ts += [_td("model.layers.0.mlp.gate_proj.weight", (8, 4))] * 2
    gs = {(g.module, g.param): g for g in split_groups(ts)}
    assert set(gs) == {(mg, "linear_fc1.weight"), (mg, "linear_fc2.weight")}
    g = gs[(mg, "linear_fc1.weight")]
    assert g.ids == (0, 1, 2) and g.members == tuple(
        f"{mg}.{e}.linear_fc1.weight" for e in range(3)
    )
    assert g.record.name == f"{mg}.*.linear_fc1.weight" and g.expert(2) == f"{mg}.2"
    assert g.record.experts is not None and g.record.experts.experts == 3


def _td(name: str, shape: tuple[int, ...], **kw: object) -> TensorDiff:
    base: dict[str, object] = dict(
        name=name, role="mlp", shape=shape, dtype="float32", numel=math.prod(shape),
        w_norm_a=1.0, dw_norm=0.01, dw_max_abs=0.01, update_ratio=0.01, max_abs_b=1.0,
        headroom_b=1e30, nonfinite_a=0, nonfinite_b=0,
    )  # fmt: skip
    return TensorDiff(**{**base, **kw})  # type: ignore[arg-type]


B1, B2, K, LR = 0.9, 0.95, 5, 1e-2


def _moments(dead: int) -> dict[str, torch.Tensor]:
    """Adam's moments of a [4, 6, 5] expert tensor over K steps; `dead` gets no gradient."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 6, 5)
    wa = torch.randn(shape, generator=g) * 0.02
    ma = torch.randn(shape, generator=g) * 1e-3
    va = torch.rand(shape, generator=g) * 1e-6 + 1e-8
    grads = torch.randn((K, *shape), generator=g) * 1e-3
    grads[:, dead] = 0.0
    mb, vb = ma.clone(), va.clone()
    for gk in grads:
        mb.lerp_(gk, 1 - B1)
        vb.mul_(B2).addcmul_(gk, gk, value=1 - B2)
    wb = wa - LR * torch.sign(mb) * torch.rand(shape, generator=g)
    return {"wa": wa, "wb": wb, "ma": ma, "mb": mb, "va": va, "vb": vb}


def _acc(s: dict[str, torch.Tensor], n: int) -> ExpertStats:
    acc = ExpertAcc(n, s["wa"].numel(), k=K, betas=(B1, B2))
    stage = Staging("cpu")
    f = {k: t.reshape(-1) for k, t in s.items()}
    acc.add(
        0, Pair(f["wa"], f["wb"], stage), Moments([f[k] for k in ("ma", "mb", "va", "vb")], stage)
    )
    return acc.result(steps=K, lr=LR, step_a=100)


def test_single_expert_accumulators_stack_to_the_fused_statistics() -> None:
    """Where the diff runs the accumulator on each expert's own tensor (n=1, `expert_slices`),
    the group stacks their exact statistics: the fused tensor's, the decay test included,
    and the dead-expert rule names the expert."""
    s = _moments(dead=1)
    fused = _acc(s, 4)
    mod = "decoder.layers.3.mlp.experts.local_experts"
    ts = [
        _td(f"{mod}.{e}.linear_fc1.weight", (6, 5), has_moments=True, k=K, lr=LR,
            experts=_acc({k: t[e] for k, t in s.items()}, 1))
        for e in range(4)
    ]  # fmt: skip
    (g,) = split_groups(ts)
    st = g.record.experts
    assert st is not None and st.experts == 4 and st.numel == fused.numel
    assert st.decayed == fused.decayed == (False, True, False, False)
    for a, b in ((st.update_ratio, fused.update_ratio), (st.step_rms, fused.step_rms),
                 (st.mean_v_a, fused.mean_v_a), (st.mean_v_b, fused.mean_v_b)):  # fmt: skip
        assert a == pytest.approx(b, rel=1e-6)
    assert st.r_v == pytest.approx(fused.r_v, rel=1e-6, abs=1e-9)
    pair = PairInfo(
        step_a=100, step_b=105, adam_step_a=100, adam_step_b=105, loss_scale_a=None,
        loss_scale_b=None, lr_a=(LR,), lr_b=(LR,), base_lr=(LR,), optimizer="adamw",
        betas=(B1, B2), weights_only=False,
    )  # fmt: skip
    diff = DiffResult(pair, ts)
    (f,) = detect_dead_experts(diff, Thresholds())
    assert f.subject == f"{mod}.1" and f.metrics["experts"] == [1] and f.metrics["layer"] == 3
    assert f.metrics["tensors"] == [f"{mod}.1.linear_fc1.weight"]
    assert detect_expert_update_outlier(diff, Thresholds()) == []
    assert detect_expert_return(diff, Thresholds()) == []


def _copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    return run


def test_truncated_expert_file_is_one_error_line(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    f = run / TRUTH["after"] / TRUTH["expert_file"]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    for args in (
        ["inspect", str(run / TRUTH["after"])],
        ["diff", "--run-dir", str(run), "--before", "4", "--after", "8", "--workers", "1"],
    ):
        assert_bad_input(
            CliRunner().invoke(cli, args),
            f"{TRUTH['expert_file']}: truncated or not a torch file",
        )


def test_missing_expert_file_is_named(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    (run / TRUTH["after"] / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    assert_bad_input(
        CliRunner().invoke(cli, ["inspect", str(run / TRUTH["after"])]),
        "layer_0_expert_3_mp_rank_00_model_states.pt missing (num_experts [4, 4]",
    )


def test_expert_weights_match_their_fp32_partition() -> None:
    """The expert file's tensor is the module's copy of the fp32 partition ZeRO-1 steps:
    the names param_shapes gives the moe groups address the same values."""
    ck = open_checkpoint(RUN / TRUTH["before"])
    osd = load_torch_file(RUN / TRUTH["before"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[0][
        "optimizer_state_dict"
    ]
    g = TRUTH["optimizer_group"]
    for n in TRUTH["tensors"]:
        frag = osd["param_slice_mappings"][g][n]
        start, numel = int(frag.get("start")), int(frag.get("numel"))
        flat = osd["single_partition_of_fp32_groups"][g].narrow(0, start, numel)
        torch.testing.assert_close(ck.tensor(n).reshape(-1), flat)
