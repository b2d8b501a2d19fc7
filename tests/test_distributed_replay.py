"""replay and bisect under torchrun (2 gloo ranks, FSDP2): the single-process report.

The ranks shard the model and its Adam state with FSDP2 and split each batch's rows, so
sums are taken in another order: every number may differ in its last bits (relative 1e-4
allowed here; measured: within 1e-5; a replay-vs-after difference 1e-3, measured 1.3e-4), a count of elements past a tolerance by the few a last
bit moves across it (measured: 1 of 6568), every verdict field must be equal, and the report
states how it ran (`replay.config.distributed`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from ckptforensics.formats.dcp import read_metadata
from tests.conftest import draw_args, ranks_said, torchrun, truth

REL = 1e-4
COUNT = 1e-3  # a count of elements past a tolerance: one moved across it by the last bit


def _two(args: list[str], out: Path) -> subprocess.CompletedProcess:
    return torchrun(
        ["-m", "ckptforensics.cli", "-q", *args, "--out", str(out)],
        {**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=400,
    )


def _differences(x: Any, y: Any, path: str = "", rel: float = REL) -> list[str]:
    """Where two reports differ beyond float noise (relative `rel`)."""
    if isinstance(x, dict) and isinstance(y, dict):
        keys = set(x) | set(y)
        return [
            d
            for k in sorted(keys)
            for d in (
                _differences(x.get(k), y.get(k), f"{path}/{k}", rel)
                if k in x and k in y
                else [f"{path}/{k}: only one"]
            )
        ]
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return [f"{path}: {len(x)} vs {len(y)} items"]
        return [
            d
            for i, (u, v) in enumerate(zip(x, y, strict=True))
            for d in _differences(u, v, f"{path}[{i}]", rel)
        ]
    if (
        isinstance(x, int)
        and isinstance(y, int)
        and not isinstance(x, bool)
        and not isinstance(y, bool)
    ):
        return [] if abs(x - y) <= max(2, COUNT * max(abs(x), abs(y))) else [f"{path}: {x} vs {y}"]
    if isinstance(x, float) and isinstance(y, float) and not isinstance(x, bool):
        # A count's share, and a difference of two near-equal tensors (replay vs after: its
        # last bits are the sum order's; `worst` is the largest such difference over its
        # tolerance), move by more than a figure computed once. One process forms a fused
        # linear's weight gradient per sample, then over samples (`PerSampleGrad`); FSDP2's
        # ranks take autograd's: another sum order.
        rel = max(rel, COUNT) if path.endswith(("_share", "max_abs_diff", "worst")) else rel
        same = (
            x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= rel * max(abs(x), abs(y))
        )
        return [] if same else [f"{path}: {x} vs {y}"]
    return [] if x == y else [f"{path}: {x!r} vs {y!r}"]


def _assert_same(one: dict[str, Any], two: dict[str, Any]) -> None:
    dist = two["replay"]["config"].pop("distributed")
    assert dist["value"]["world_size"] == 2 and dist["source"] == "torchrun"
    for doc in (one, two):
        doc["incident"].pop("command")  # the command line differs by --out, and so
        doc["incident"].pop("report_dir", None)  # does the report's own folder
    assert _differences(one, two) == []


def _both(
    draw_report: Any, run: Path, command: str, batch: str | None, tmp_path: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command's report in one process (the session's, shared with test_draws) and on
    two ranks, checked equal."""
    one = draw_report(run, command, batch)
    proc = _two(draw_args(run, command, batch), tmp_path / "two")
    assert proc.returncode == 0, ranks_said(proc.stderr)
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    _assert_same(one, two)
    return one, two


def test_replay_on_two_fsdp2_ranks_is_the_single_process_replay(
    draws: dict[int, Path], draw_report: Any, tmp_path: Path
) -> None:
    """The FSDP2 draw (DCP written by 2 ranks): a per-module LR bug, a gradient explosion;
    replayed from its flight recorder (every param group's LR per step). It computed in
    bf16 on fp32 shards (torchtitan's MixedPrecisionPolicy): two ranks replay in FSDP2's own
    policy, one process casts the weights itself, and bf16 rounds the two apart (a sum in
    another order moves a weight's bf16 rounding by a last bit): the verdicts are the same,
    the losses within bf16's rounding, and both replays reproduce *after*: two ranks to 13
    elements of 38,832, one process to 435 (1.1%; its gradient is one bf16 backward over
    the whole batch where the run summed two ranks' bf16 gradients in fp32, and Adam's
    normalised update turns a rounding apart on a near-zero gradient into up to 2 lr a
    step), none past the Adam bound (`impossible`)."""
    run = draws[1052]
    assert truth(run)["draw"]["mp_policy"] == "bf16"
    one = draw_report(run, "replay", "flight")
    proc = _two(draw_args(run, "replay", "flight"), tmp_path / "two")
    assert proc.returncode == 0, ranks_said(proc.stderr)
    two = json.loads((tmp_path / "two" / "report.json").read_text())
    for doc, share in ((one, 0.02), (two, 0.01)):
        assert doc["replay"]["config"]["precision"]["value"] == "bf16-params"
        rep = doc["replay"]["reproduction"]
        assert rep["mismatched"] <= share * rep["elements"] and rep["impossible"] == 0, rep
    verdict = (
        "causes",
        "first_bad_step",
        "reproducible",
        "first_anomalous_module",
        "exploding_layers",
    )
    assert (
        _differences(
            {k: one["verdict"][k] for k in verdict},
            {k: two["verdict"][k] for k in verdict},
            rel=0.05,
        )
        == []
    )
    bf16 = 2.0**-8  # bf16's unit roundoff
    assert (
        _differences(
            [s["loss"] for s in one["replay"]["steps"]],
            [s["loss"] for s in two["replay"]["steps"]],
            rel=bf16,
        )
        == []
    )
    assert one["verdict"]["causes"][0]["cause"] == truth(run)["cause"]
    assert one["verdict"]["reproducible"] is True


def test_bisect_on_two_ranks_is_the_single_process_bisect(
    draws: dict[int, Path], draw_report: Any, tmp_path: Path
) -> None:
    """The HF Trainer draw (Llama from config.json, padded rows, gradient accumulation 2):
    the poison rows found by two ranks, each holding half of every batch, are the truth's."""
    run = draws[1012]
    one, two = _both(draw_report, run, "bisect", None, tmp_path)
    rows = sorted(s["index"] for s in two["verdict"]["anomalous_samples"])
    assert rows == sorted(truth(run)["samples"])
    assert json.loads((tmp_path / "two" / "skip.json").read_text()) == one["bisect"]["skip"]


def test_a_rank_that_fails_stops_every_rank_with_the_same_line(
    draws: dict[int, Path], tmp_path: Path
) -> None:
    """Rank 1 reads its rows of *before*'s Adam moments from the file FSDP2's rank 1
    wrote; cut that file at the first such chunk: rank 1 fails alone while rank 0 reads
    on, and both stop with one and the same line, exit 2, no report."""
    src = draws[1052]
    run = tmp_path / "run"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("step-60"))
    before = run / f"step-{truth(src)['before']}"
    md = read_metadata(before)
    cut = min(
        int(i.offset)
        for idx, i in md.storage_data.items()
        if str(i.relative_path) == "__1_0.distcp"
        and idx.fqn.endswith("exp_avg")
        and idx.offset
        and idx.offset[0] > 0
    )
    f = before / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:cut])
    proc = _two(draw_args(run, "replay", "flight"), tmp_path / "out")
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
    assert len(errors) == 2 and errors[0] == errors[1] and "__1_0.distcp: truncated" in errors[0], (
        ranks_said(proc.stderr)
    )
    assert "ckptforensics/" not in proc.stderr.replace(str(run), "")
    assert not (tmp_path / "out" / "report.json").exists()


def test_checkpointed_activations_replay_the_same_step(zoo: dict[str, Path]) -> None:
    """--checkpoint-activations recomputes every block in the backward pass (its first
    module runs twice a step; recomputation stops early once the saved tensors are back)
    and changes no figure of the replayed step."""
    from ckptforensics.engine.replay.run import ReplayConfig, plan

    run = zoo["poison_batch"]
    t = truth(run)
    step = t["first_bad_step"]
    records, calls = [], []
    for ac in (False, True):
        cfg = ReplayConfig(
            before=run / f"step_{t['before']}.pt",
            model="fixtures/tinygpt.py:factory",
            batch=str(run / "batches.h5"),
            step=step,
            checkpoint_activations=ac,
        )
        p = plan(cfg)
        session = p.session()
        n = [0]
        session.model.get_submodule("transformer.h.0.ln_1").register_forward_hook(
            lambda *_, n=n: n.__setitem__(0, n[0] + 1)
        )
        rec, stats = session.step(step, p.batches.batch(step), p.lrs[step], None)
        session.close()
        records.append((rec, stats))
        calls.append(n[0])
    assert calls == [1, 2]
    (plain, ps), (ckpt, cs) = records
    assert (
        ckpt.loss == plain.loss
        and ckpt.grad_norm == plain.grad_norm
        and ckpt.sample_loss == plain.sample_loss
    )
    assert torch.equal(ps.fwd.nan_to_num(-1), cs.fwd.nan_to_num(-1)) and torch.allclose(
        ps.bwd.nan_to_num(-1), cs.bwd.nan_to_num(-1), rtol=1e-6
    )
    assert ps.fwd_order == cs.fwd_order
