"""DeepSpeed ZeRO 0-3 written by real DeepSpeed (2 ranks, gloo, CPU), read without DeepSpeed's code."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from tests.conftest import ROOT, ranks_said, torchrun
from tests.test_cli import assert_bad_input

pytest.importorskip("deepspeed")


@pytest.fixture(scope="session")
def zero_runs(deepspeed_runs: Any) -> dict[int, Path]:
    return {stage: deepspeed_runs(stage) for stage in (0, 1, 2, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unflattened_moments_match_zero0(zero_runs: dict[int, Path], stage: int) -> None:
    ref, got = (
        open_checkpoint(zero_runs[0] / "global_step3"),
        open_checkpoint(zero_runs[stage]),
    )  # via `latest`
    assert got.format == "deepspeed" and got.scalars["zero_stage"] == stage and got.step == 3
    # ZeRO pickles a static loss scaler of 1.0 into fp32 runs too: that is no fp16 run.
    assert "loss_scale" not in got.scalars and not {"fp16", "bf16"} & set(
        got.scalars["train_config"]
    )
    assert set(got.names()) == set(ref.names())
    for n in ref.names():
        torch.testing.assert_close(
            got.tensor(n).float(), ref.tensor(n).float(), rtol=1e-4, atol=1e-5
        )
        a, b = ref.optim_state(n), got.optim_state(n)
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], rtol=1e-4, atol=1e-9)
    assert got.hyper("transformer.h.0.mlp.c_fc.weight").weight_decay == pytest.approx(0.1)


def test_deepspeed_diff_is_healthy(zero_runs: dict[int, Path]) -> None:
    r = CliRunner().invoke(
        cli, ["diff", "--run-dir", str(zero_runs[2]), "--before", "2", "--after", "3"]
    )
    assert r.exit_code == 0, r.output
    assert "No anomaly" in r.output


def test_foreign_class_in_a_deepspeed_file_is_refused(
    zero_runs: dict[int, Path], tmp_path: Path
) -> None:
    canary = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):  # noqa: ANN204 - a hostile pickle
            return (os.system, (f"touch {canary}",))

    d = tmp_path / "global_step3"
    shutil.copytree(zero_runs[2] / "global_step3", d)
    f = d / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    obj = torch.load(f, weights_only=False)
    obj["optimizer_state_dict"]["loss_scaler"] = Exploit()
    torch.save(obj, f)
    assert_bad_input(
        CliRunner().invoke(cli, ["inspect", str(d)]), "refused to unpickle posix.system"
    )
    assert not canary.exists()


@pytest.fixture(scope="session")
def zero_bf16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """DeepSpeed's bf16 on CPU (DS_ACCELERATOR=cpu), ZeRO 1 (its BF16_Optimizer) and 3."""
    root = tmp_path_factory.mktemp("deepspeed-bf16")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = {}
    for stage in (1, 3):
        d = root / f"zero{stage}"
        proc = torchrun(
            [str(ROOT / "fixtures" / "deepspeed_zero.py"), str(d), str(stage), "bf16"], env
        )
        assert proc.returncode == 0, ranks_said(proc.stderr)
        out[stage] = d
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_weights_are_the_fp32_masters_and_the_precision_is_bf16_parameters(
    zero_bf16_runs: dict[int, Path], stage: int
) -> None:
    """A bf16 run's optimizer steps fp32 master weights (ZeRO-1/2:
    `single_partition_of_fp32_groups`; ZeRO-3: `fp32_flat_groups`); the module holds their
    bf16 rounding. The masters are read as the weights, and the replay computes in bf16 on
    them, as `ds_config` says."""
    from ckptforensics.engine.replay.precision import candidates

    ck = open_checkpoint(zero_bf16_runs[stage])
    assert candidates(ck) == [
        ("bf16-params", "ds_config bf16.enabled (bf16 weights, fp32 partitions in the optimizer)")
    ]
    assert all(ck.meta(n).dtype == torch.float32 for n in ck.names())
    if stage == 1:
        from ckptforensics.formats.torchfile import load_torch_file

        module = load_torch_file(
            zero_bf16_runs[stage] / "global_step3" / "mp_rank_00_model_states.pt"
        )[0]["module"]
        for n in ck.names():
            assert module[n].dtype == torch.bfloat16
            assert torch.equal(ck.tensor(n).to(torch.bfloat16), module[n]), (
                n
            )  # the module is the masters' rounding
        assert any(
            not torch.equal(ck.tensor(n), module[n].float()) for n in ck.names()
        )  # and the masters hold more
