"""Every reader on files its own library wrote; optimizer ids mapped to names, verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.core.errors import OptimizerMappingError
from ckptforensics.formats.locate import resolve_checkpoint
from ckptforensics.formats.optstate import map_optimizer
from fixtures.tinygpt import GPT, GPTConfig
from tests.test_cli import assert_bad_input

RUNS = {
    "healthy": "nanogpt",
    "healthy-torch": "torch",
    "healthy-safetensors": "safetensors",
    "lightning": "lightning",
    "hf-trainer": "hf-trainer",
}
MCORE = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "megatron-core-0.19"


@pytest.mark.parametrize("run,fmt", sorted(RUNS.items()))
def test_reader_sees_every_tensor_and_its_moments(zoo: dict[str, Path], run: str, fmt: str) -> None:
    ck = open_checkpoint(resolve_checkpoint("30", zoo[run]))
    assert ck.format == fmt
    assert ck.step == 30
    assert ck.names(), "no tensors"
    for n in ck.names():
        t = ck.tensor(n)
        assert tuple(t.shape) == ck.meta(n).shape and t.dtype == ck.meta(n).dtype
    if fmt == "safetensors":
        assert ck.optimizer is None
        return
    opt = ck.optimizer
    assert opt is not None and opt.kind == "adam"
    # Every trainable tensor has moments of its own shape, and the Adam step is 30.
    assert set(opt.state) == set(ck.names())
    for n, st in opt.state.items():
        assert tuple(st["exp_avg"].shape) == ck.meta(n).shape, n
        assert int(st["step"]) == 30


def test_tied_weights_appear_once(zoo: dict[str, Path]) -> None:
    ck = open_checkpoint(zoo["healthy"] / "step_30.pt")
    # GPT ties lm_head to wte: one tensor, the alias recorded.
    assert ("lm_head.weight" in ck.names()) != ("transformer.wte.weight" in ck.names())
    assert ck.aliases


def test_hf_groups_follow_the_trainer_decay_rule(zoo: dict[str, Path]) -> None:
    ck = open_checkpoint(zoo["hf-trainer"] / "checkpoint-30")
    assert ck.optimizer is not None and ck.optimizer.mapping == "HF decay/no-decay groups"
    assert ck.hyper("model.norm.weight").weight_decay == 0.0
    assert ck.hyper("model.layers.0.self_attn.q_proj.weight").weight_decay == pytest.approx(0.1)
    assert ck.scalars["scheduler"]["last_epoch"] == 30
    assert ck.optimizer.groups[0].initial_lr == pytest.approx(3e-3)


def test_id_mapping_matches_names_torch_saved(tmp_path: Path) -> None:
    """Ground truth from torch itself: an optimizer built from named parameters saves param_names."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    named = list(model.named_parameters())
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).backward()
    opt.step()
    osd = opt.state_dict()
    truth = {
        pid: name
        for g in osd["param_groups"]
        for pid, name in zip(g["params"], g["param_names"], strict=True)
    }
    for g in osd["param_groups"]:
        del g["param_names"]
    view = map_optimizer(osd, [(n, tuple(p.shape)) for n, p in named], "test")
    got = {
        pid: name
        for name in view.state
        for pid, st in osd["state"].items()
        if st is view.state[name]
    }
    assert got == truth


def test_ambiguous_mapping_is_refused() -> None:
    params = [("a.scale", (3,)), ("b.bias", (3,)), ("c.scale", (3,)), ("d.bias", (3,))]
    state = {
        i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        for i in range(4)
    }
    osd = {
        "state": state,
        "param_groups": [{"params": [0, 1], "lr": 1e-3}, {"params": [2, 3], "lr": 1e-3}],
    }
    with pytest.raises(OptimizerMappingError, match="ambiguously"):
        map_optimizer(osd, params, "optimizer.pt")


def test_mapping_failure_names_the_first_mismatch() -> None:
    params = [("w", (4, 4)), ("b", (4,))]
    state = {
        0: {"exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)},
        1: {"exp_avg": torch.zeros(4, 4), "exp_avg_sq": torch.zeros(4, 4)},
    }
    osd = {"state": state, "param_groups": [{"params": [0, 1], "lr": 1e-3}]}
    with pytest.raises(
        OptimizerMappingError, match=r"id 0 in group 0 has state of shape \(4,\) but w is \(4, 4\)"
    ):
        map_optimizer(osd, params, "optimizer.pt")


def test_compiled_nanogpt_prefix_is_stripped(zoo: dict[str, Path], tmp_path: Path) -> None:
    ck = torch.load(zoo["healthy"] / "step_30.pt", weights_only=True)
    ck["model"] = {f"_orig_mod.{k}": v for k, v in ck["model"].items()}
    torch.save(ck, tmp_path / "ckpt.pt")
    view = open_checkpoint(tmp_path / "ckpt.pt")
    assert view.format == "nanogpt"
    assert not any(n.startswith("_orig_mod.") for n in view.names())
    assert view.optimizer is not None and len(view.optimizer.state) == len(view.names())


def test_sharded_hf_weights_with_index(zoo: dict[str, Path], tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    src = zoo["hf-trainer"] / "checkpoint-30"
    model = LlamaForCausalLM.from_pretrained(src)
    out = (
        tmp_path / "model-30"
    )  # a save_pretrained dir (a Trainer's checkpoint-N also needs its optimizer and state)
    model.save_pretrained(out, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    sharded, single = open_checkpoint(out), open_checkpoint(src)
    assert sorted(sharded.names()) == sorted(single.names())
    for n in single.names():
        assert torch.equal(sharded.tensor(n), single.tensor(n)), n


def test_lightning_scaler_state_is_read(zoo: dict[str, Path], tmp_path: Path) -> None:
    """Lightning stores the GradScaler under the precision plugin's class name."""
    ck = torch.load(zoo["lightning"] / "epoch=0-step=30.ckpt", weights_only=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
    ck["MixedPrecision"] = scaler.state_dict()
    torch.save(ck, tmp_path / "epoch=0-step=30.ckpt")
    view = open_checkpoint(tmp_path / "epoch=0-step=30.ckpt")
    assert view.format == "lightning"
    assert view.scalars["loss_scale"] == 2.0**14
    assert view.scalars["scaler"]["growth_interval"] == 2000


def test_megatron_args_and_distributed_optimizer_limit(tmp_path: Path) -> None:
    """A legacy save whose optimizer state lives in distrib_optim.pt (the legacy distributed
    optimizer) is read weights-only, and says so."""
    import shutil

    src = MCORE / "legacy" / "iter_0000010"
    ck = open_checkpoint(src)
    assert ck.config["clip_grad"] == 1.0 and ck.scalars["train_config"]["learning_rate"] == 1e-3
    d = tmp_path / "iter_0000010"
    shutil.copytree(src, d)
    torch.save({"buckets": [torch.zeros(4)]}, d / "mp_rank_00" / "distrib_optim.pt")
    limited = open_checkpoint(d)
    assert limited.optimizer is None
    assert any("distributed optimizer" in n for n in limited.notes)


def test_megatron_torch_dist_matches_the_legacy_save() -> None:
    """The same megatron-core run saved both ways: torch_dist's stacked layer tensors, read per
    layer as `decoder.layers.<i>.<name>` (the local spec's norms under TE's fused names),
    hold the legacy file's tensors and moments bit for bit."""
    te = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    }
    dist = open_checkpoint(resolve_checkpoint("20", MCORE / "plain"))
    legacy = open_checkpoint(resolve_checkpoint("20", MCORE / "legacy"))
    assert dist.format == "megatron-dist" and dist.step == 20 and legacy.format == "megatron"
    assert dist.config["clip_grad"] == 1.0  # args came through the inert unpickler
    assert dist.optimizer is not None and dist.optimizer.kind == "adam"
    seen = set()
    for n in legacy.names():
        name = next((n[: -len(k)] + v for k, v in te.items() if n.endswith(k)), n)
        seen.add(name)
        assert torch.equal(dist.tensor(name), legacy.tensor(n)), n
        for where in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(dist.optim_state(name)[where], legacy.optim_state(n)[where]), (
                n,
                where,
            )
    assert seen == set(dist.names())
    assert dist.hyper("decoder.final_layernorm.weight").weight_decay == 0.0
    assert dist.hyper("decoder.layers.1.mlp.linear_fc1.weight").weight_decay == pytest.approx(0.1)


def test_megatron_bucket_that_does_not_fit_the_model_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    """A distributed-optimizer bucket whose size no reverse, 64-aligned layout of the model's
    parameters explains is refused, not guessed (the real layout: tests/test_real_formats.py)."""
    import json

    import torch.distributed.checkpoint as dcp

    d = tmp_path / "iter_0000010"
    key = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(
            {
                "decoder.final_layernorm.weight": torch.ones(4),
                key: torch.zeros(16),
                key + "_sq": torch.zeros(16),
            },
            checkpoint_id=str(d),
            no_dist=True,
        )
    (d / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    assert_bad_input(
        CliRunner().invoke(cli, ["inspect", str(d)]), "the layout does not match this model"
    )


def test_megatron_torch_dist_bit_flip_is_located_to_its_layer(tmp_path: Path) -> None:
    """A flipped exponent bit in layer 1 of a stacked tensor that megatron-core wrote (the
    chunk rewritten in place, same length): found in that layer, at that element."""
    import io
    import shutil

    from ckptforensics.core.tensors import flip_bit
    from ckptforensics.formats.dcp import DcpStore, read_metadata

    run = tmp_path / "run"
    for it in ("iter_0000010", "iter_0000020"):
        shutil.copytree(MCORE / "plain" / it, run / it)
    dst = run / "iter_0000020"
    store = DcpStore(dst, read_metadata(dst))
    # one chunk per layer of the stacked [2, 128, 32] tensor: take layer 1's
    info = next(
        info
        for idx, info in store.by_fqn["decoder.layers.mlp.linear_fc1.weight"]
        if idx.offset[0] == 1
    )
    t = store._blob(info)
    t[0, 5, 7] = flip_bit(float(t[0, 5, 7]), 30, torch.float32)
    buf = io.BytesIO()
    torch.save(t, buf)
    assert len(buf.getvalue()) == int(info.length)
    with (dst / str(info.relative_path)).open("r+b") as fh:
        fh.seek(int(info.offset))
        fh.write(buf.getvalue())
    r = CliRunner().invoke(
        cli, ["diff", "--run-dir", str(run), "--before", "10", "--after", "20", "--json"]
    )
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)["verdict"]
    assert v["causes"][0]["cause"] == "silent_corruption"
    hit = v["corrupted_elements"][0]
    assert hit["tensor"] == "decoder.layers.1.mlp.linear_fc1.weight" and hit["index"] == [5, 7]
