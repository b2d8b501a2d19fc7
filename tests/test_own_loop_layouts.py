"""Own training loops saved the ways people save them (fixtures/own_loop_layouts.py): the step
read from the name, modded-nanogpt's `optimizers` list mapped to names, Lion and Muon + AdamW
read, diffed and replayed, each against the truth its run planted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import list_checkpoints, open_checkpoint, resolve_checkpoint
from ckptforensics.cli import cli
from ckptforensics.formats.locate import step_of_name
from fixtures import own_loop_layouts as layouts
from fixtures.tinygpt import GPT, GPTConfig

pytest.importorskip("lion_pytorch")

RUNS = sorted(f"{name}-{kind}" for name, kinds in layouts.RUNS.items() for kind in kinds)
# layout -> (the format it reads as, the optimizer kind its groups make)
EXPECTED = {
    "lion": ("torch", "lion"),
    "muon": ("modded_nanogpt", "muon+adam"),
    "ckpt": ("torch", "adam"),
    "model": ("torch", "adam"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return layouts.build(tmp_path_factory.mktemp("own_loop"))


def _truth(run: Path) -> dict:
    return json.loads((run / "truth.json").read_text())


def _cli(*args: str) -> dict:
    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _window(run: Path) -> list[str]:
    t = _truth(run)
    return ["--run-dir", str(run), "--before", str(t["before"]), "--after", str(t["after"])]


@pytest.mark.parametrize(
    "name,step",
    [
        ("step_000060.pt", 60),
        ("state_step000060.pt", 60),
        ("ckpt_60.pt", 60),
        ("model_60.pt", 60),
        ("model_step_000060.safetensors", 60),
        ("checkpoint_60", 60),
        # Other trainers' names keep their own reading.
        ("checkpoint-60", 60),
        ("global_step60", 60),
        ("iter_0000060", 60),
        ("step-60", 60),
        ("step60", 60),
        ("epoch=0-step=60.ckpt", 60),
        # Not checkpoint names: no step.
        ("optimizer_60.pt", None),
        ("rank_1.pt", None),
        ("model-00001-of-00002.safetensors", None),
        ("ckpt.pt", None),
        ("run3_step60.pt", 60),
        ("blackbox-step40", None),  # the flight recorder's folder, not a checkpoint
    ],
)
def test_step_from_the_name(tmp_path: Path, name: str, step: int | None) -> None:
    assert step_of_name(tmp_path / name) == step
    (tmp_path / name).write_bytes(b"")
    assert [s for s, _ in list_checkpoints(tmp_path)] == ([step] if step is not None else [])


def test_a_file_is_read_at_its_own_names_step(tmp_path: Path) -> None:
    """Its own name only: a folder's name may be a model's version (`model_2/`)."""
    assert step_of_name(tmp_path / "step-60") == 60
    assert step_of_name(tmp_path / "ckpt_60" / "weights_10.pt") == 10
    assert step_of_name(tmp_path / "model_2" / "weights.pt") is None


def test_two_layouts_of_one_step_are_ambiguous(tmp_path: Path) -> None:
    """`step_60.pt` beside `model_60.pt`: step 60 names two files, an error that lists both."""
    for name in ("step_60.pt", "model_60.pt"):
        (tmp_path / name).write_bytes(b"")
    res = CliRunner().invoke(cli, ["inspect", "--run-dir", str(tmp_path), "60"])
    assert res.exit_code == 2
    assert "step 60 is ambiguous" in res.stderr and "model_60.pt" in res.stderr


@pytest.mark.parametrize("run", RUNS)
def test_every_layout_is_read_at_its_named_step(runs: dict[str, Path], run: str) -> None:
    t = _truth(runs[run])
    path = resolve_checkpoint(str(t["after"]), runs[run])
    assert path.name == t["files"]
    fmt, kind = EXPECTED[t["layout"]]
    with open_checkpoint(path) as ck:
        assert (ck.format, ck.step) == (fmt, t["after"])
        assert ck.optimizer is not None and ck.optimizer.kind == kind
        # Every parameter's state under its module name (no `_orig_mod.`).
        assert set(ck.optimizer.state) == set(ck.names())
        assert not any(n.startswith("_orig_mod.") for n in ck.names())
        recorded = "step" in torch.load(path, weights_only=True)
        assert any("read from the name" in n for n in ck.notes) == (not recorded)
    doc = _cli("inspect", "--run-dir", str(runs[run]), str(t["after"]))
    assert (doc["format"], doc["step"], doc["optimizer"]["kind"]) == (fmt, t["after"], kind)


def test_modded_nanogpt_optimizers_map_each_to_its_own_params(runs: dict[str, Path]) -> None:
    """Each state_dict's ids are positions in its own optimizer's groups: Muon's momentum
    buffers land on the hidden matrices, AdamW's moments on the embeddings and vectors, in
    the order the fixture's own optimizers were given them (wpe and the attention's output
    projections share a shape: only the order tells them apart)."""
    path = runs["muon-healthy"] / "state_step000060.pt"
    saved = torch.load(path, weights_only=True)["optimizers"]
    model = GPT(GPTConfig())
    names = {id(p): n for n, p in model.named_parameters()}
    opts = layouts.LAYOUTS["muon"].optimizers(model)
    with open_checkpoint(path) as ck:
        for opt, sd in zip(opts, saved, strict=True):
            params = [p for g in opt.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                for key, want in sd["state"][i].items():
                    if isinstance(want, torch.Tensor) and want.dim() > 0:
                        assert torch.equal(ck.optim_state(names[id(p)])[key], want), (
                            names[id(p)],
                            key,
                        )
        fams = {ck.hyper(names[id(p)]).family for p in opts[0].param_groups[0]["params"]}
        assert fams == {"muon"}
        assert ck.hyper("transformer.wpe.weight").family == "adam"


@pytest.mark.parametrize("run", RUNS)
def test_diff_names_the_lr_spike_and_passes_the_healthy_twins(
    runs: dict[str, Path], run: str
) -> None:
    t = _truth(runs[run])
    doc = _cli("diff", *_window(runs[run]))
    v = doc["verdict"]
    assert doc["incident"]["before"]["step"] == t["before"]
    if t["cause"] == "none":
        assert v["causes"][0]["cause"] == "none", v["summary"]
        assert not [f for f in doc["findings"] if f["severity"] == "critical"]
        return
    assert v["causes"][0]["cause"] == t["cause"], v["summary"]
    # Elements of the family's own tensors moved further than its bound at the recorded LR
    # (Lion's exact lr (1 + wd |w|); Muon's spectral bound), those of the healthy twin never.
    fam = {"lion": "lion", "muon": "muon"}[t["layout"]]
    hit = [r for r in doc["diff"]["tensors"] if r["family"] == fam and r["bound_violations"]]
    assert hit, f"no {fam} tensor over its bound"
    healthy = _cli("diff", *_window(runs[f"{t['layout']}-healthy"]))
    assert not [r for r in healthy["diff"]["tensors"] if r["bound_violations"]]


@pytest.mark.parametrize("run", RUNS)
def test_replay_rebuilds_each_loop_and_finds_the_spike(runs: dict[str, Path], run: str) -> None:
    """Replayed with the family's own class (lion-pytorch's Lion; torch's Muon beside the
    run's AdamW): the healthy twins land on the run's log with no critical finding; the LR
    spike is dated to its first step and group."""
    t = _truth(runs[run])
    doc = _cli(
        "replay", *_window(runs[run]), "--model", "fixtures/tinygpt.py:factory",
        "--batch", str(runs[run] / "batches.h5"),
    )  # fmt: skip
    v = doc["verdict"]
    opt = doc["replay"]["config"]["optimizer"]["value"]
    assert (
        opt
        == {
            "lion": "lion_pytorch.Lion",
            "muon": "torch.optim.Muon + AdamW",
            "ckpt": "AdamW",
            "model": "AdamW",
        }[t["layout"]]
    )
    agree = next(f for f in doc["findings"] if f["kind"] == "replay_log_agreement")
    if t["cause"] == "none":
        assert agree["metrics"]["status"] == "matched", agree["message"]
        # Every weight and state tensor lands on after's (Muon's buffers within its bf16
        # Newton-Schulz rounding: `optim.muon`'s state_rounding).
        assert v["reproducible"] is True, doc["replay"]["reproduction"]["worst"]
        assert v["causes"][0]["cause"] == "none", v["summary"]
        assert not [f for f in doc["findings"] if f["severity"] == "critical"]
        return
    # The log is matched up to the spike (the step it diverges at, if any, is past it).
    assert agree["metrics"].get("step", math.inf) > t["first_bad_step"], agree["message"]
    assert v["first_bad_step"] == t["first_bad_step"]
    jump = next(f for f in doc["findings"] if f["kind"] == "lr_step_jump")
    assert jump["metrics"]["step"] == t["first_bad_step"]
    # Groups in the checkpoint's order: every optimizer's, one after another.
    model = GPT(GPTConfig())
    opts = layouts.LAYOUTS[t["layout"]].optimizers(model)
    flat = {(i, j): k for k, (i, j) in enumerate((i, j) for i, o in enumerate(opts) for j in range(len(o.param_groups)))}  # fmt: skip
    assert sorted(jump["metrics"]["groups"]) == sorted(flat[tuple(g)] for g in t["spike"]["groups"])
    assert v["causes"][0]["cause"] == t["cause"], v["summary"]
