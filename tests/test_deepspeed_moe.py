"""DeepSpeed-MoE checkpoints written by real DeepSpeed (`fixtures/deepspeed_moe_run.py`,
committed under fixtures/data/deepspeed-moe): the experts' `layer_{L}_expert_{E}_...` files
read beside the dense model states, each expert tensor under its full name with its ZeRO-1
optimizer state; the diff of the pair names the planted incident (expert 2 of MoE layer 1
at 1000x its LR between the saves, the LR restored before the second save). No training here,
no DeepSpeed needed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.formats.torchfile import load_torch_file
from tests.conftest import ROOT
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


def test_diff_names_the_expert_run_at_1000x_its_lr() -> None:
    r = CliRunner().invoke(
        cli,
        ["diff", "--run-dir", str(RUN), "--before", "4", "--after", "8", "--workers", "1"]
        + ["--json"],
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
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
