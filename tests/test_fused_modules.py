"""Fused modules are what they compute: a norm fused into the next projection is a norm (the
megatron-core TE-layout run, an opaque fused kernel), a model truly without one is still
named so, and an element of a fused QKV or gate-up weight is named by the part the model's
own split gives it (GPT-2's `c_attn` by transformers, Megatron's per-group `linear_qkv`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import ckptforensics as api
from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.commands.audit import trace_architecture
from ckptforensics.detectors import diff_findings
from ckptforensics.engine.diff.pair import DiffConfig, diff_checkpoints
from ckptforensics.engine.replay.model import load_weights
from ckptforensics.trainers.fused import Heads, computes, heads_from_config, part_of
from ckptforensics.trainers.megatron.model import MegatronGPT
from ckptforensics.verdict import decide
from tests.conftest import ROOT

DATA = ROOT / "fixtures" / "data"
IDS = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}
# megatron-core 0.19's local spec saved as torch_dist (fixtures/megatron_core_run.py): its
# TransformerLayer's `sharded_state_dict_keys_map` writes each input norm under Transformer
# Engine's fused names, `self_attention.linear_qkv.layer_norm_weight` and
# `mlp.linear_fc1.layer_norm_weight` (megatron's own conversion to the TE layout).
TE_LAYOUT_RUN = DATA / "megatron-core-0.19" / "distopt"


def _gpt2() -> nn.Module:
    import transformers as T

    cfg = T.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                       bos_token_id=0, eos_token_id=0)  # fmt: skip
    return T.GPT2LMHeadModel(cfg)


# ----------------------------------------------------------------- a fused norm is a norm
def test_te_layout_megatron_run_audits_its_fused_norms() -> None:
    doc = api.audit(None, run_dir=TE_LAYOUT_RUN, compare="none").doc
    rows = {r["id"]: r for r in doc["audit"]["rows"]}
    assert rows["norm_placement"]["status"] == "ok" and rows["norm_placement"]["value"] == "pre"
    assert not any("no norm found" in r["message"] for r in doc["audit"]["rows"])
    norms = set(doc["architecture"]["norm_params"])
    assert {
        f"decoder.layers.{i}.{m}.layer_norm_weight"
        for i in (0, 1)
        for m in ("self_attention.linear_qkv", "mlp.linear_fc1")
    } <= norms
    assert set(doc["architecture"]["fused_norms"]) == {
        f"decoder.layers.{i}.{m}"
        for i in (0, 1)
        for m in ("self_attention.linear_qkv", "mlp.linear_fc1")
    }
    assert "norms fused into the projection after them" in rows["norm_placement"]["message"]


class _FusedLN(torch.autograd.Function):
    """LayerNorm then linear in one opaque kernel, as Transformer Engine's `_LayerNormLinear`
    runs it (TE itself needs CUDA): the trace sees no `layer_norm` call, only a node that
    takes the weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, w: torch.Tensor,
                bias: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(x, g, b, w, bias)
        return F.linear(F.layer_norm(x, (x.shape[-1],), g, b), w.t(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            ins = [t.detach().requires_grad_() for t in ctx.saved_tensors]
            x, g, b, w, bias = ins
            out = F.linear(F.layer_norm(x, (x.shape[-1],), g, b), w.t(), bias)
            return torch.autograd.grad(out, ins, grad)


class _NormConv1D(nn.Module):
    """GPT-2's `ln_1` fused into its `c_attn` (a `Conv1D`: weight [in, out])."""

    def __init__(self, ln: nn.LayerNorm, proj: nn.Module) -> None:
        super().__init__()
        self.layer_norm_weight, self.layer_norm_bias = ln.weight, ln.bias
        self.weight, self.bias = proj.weight, proj.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedLN.apply(x, self.layer_norm_weight, self.layer_norm_bias, self.weight,
                              self.bias)  # fmt: skip


def _fused_gpt2() -> nn.Module:
    m = _gpt2()
    for blk in m.transformer.h:
        blk.attn.c_attn = _NormConv1D(blk.ln_1, blk.attn.c_attn)
        blk.ln_1 = nn.Identity()
    return m


def _normless_gpt2() -> nn.Module:
    m = _gpt2()
    for blk in m.transformer.h:
        blk.ln_1 = blk.ln_2 = nn.Identity()
    return m


def test_an_opaque_fused_norm_linear_is_a_norm() -> None:
    torch.manual_seed(0)
    plain, fused = _gpt2(), _fused_gpt2()
    a, b = trace_architecture(plain, IDS), trace_architecture(fused, IDS)
    assert a.norm_placement == b.norm_placement == "pre" and b.qk_norm is False
    assert {f"transformer.h.{i}.attn.c_attn.layer_norm_weight" for i in (0, 1)} <= set(
        b.norm_params
    )
    assert not any(n.endswith("c_attn.bias") for n in b.norm_params)  # the projection's own
    assert a.fused_norms == () and b.fused_norms == (
        "transformer.h.0.attn.c_attn",
        "transformer.h.1.attn.c_attn",
    )
    # the fused module computes what ln_1 then c_attn compute
    torch.manual_seed(0)
    ref = _gpt2()
    fused.load_state_dict(_fused_state(ref.state_dict()))
    with torch.no_grad():
        assert torch.allclose(ref.eval()(**IDS).logits, fused.eval()(**IDS).logits, atol=1e-5)


def _fused_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = k.replace(".ln_1.weight", ".attn.c_attn.layer_norm_weight")
        out[k.replace(".ln_1.bias", ".attn.c_attn.layer_norm_bias")] = v
    return out


def normless(_ckpt: Any = None) -> nn.Module:
    """`--model` factory: GPT-2 without its sublayer norms (the audit's 'none')."""
    torch.manual_seed(0)
    return _normless_gpt2()


def test_a_model_truly_without_norms_is_still_named(tmp_path: Path) -> None:
    assert trace_architecture(normless(), IDS).norm_placement == "none"
    torch.save(normless().state_dict(), tmp_path / "model_20.pt")
    doc = api.audit(
        tmp_path / "model_20.pt", model=f"{Path(__file__).resolve()}:normless", compare="none"
    ).doc
    row = {r["id"]: r for r in doc["audit"]["rows"]}["norm_placement"]
    assert row["status"] == "risk" and "no norm found around the attention layers" in row["message"]


# ----------------------------------------------------------------- naming the part
class _Splits(TorchFunctionMode):
    """The outputs of the first `split` a forward runs: the model's own q, k, v."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[torch.Tensor] | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.split, torch.split) and self.parts is None:
            self.parts = [t.detach().clone() for t in out]
        return out


def _own_split(run: Callable[[], Any]) -> list[torch.Tensor]:
    with torch.no_grad(), _Splits() as s:
        run()
    assert s.parts is not None
    return s.parts


def _moved(
    run: Callable[[], Any], w: torch.Tensor, unit: int, dim: int
) -> tuple[int, torch.Tensor]:
    """Which of the model's q/k/v a perturbation of output unit `unit` moves, and where."""
    base = _own_split(run)
    with torch.no_grad():
        w.select(dim, unit).add_(1.0)
    try:
        after = _own_split(run)
    finally:
        with torch.no_grad():
            w.select(dim, unit).sub_(1.0)
    moved = [i for i, (a, b) in enumerate(zip(base, after, strict=True)) if not torch.equal(a, b)]
    assert len(moved) == 1
    i = moved[0]
    return i, (base[i] != after[i]).nonzero()


def test_gpt2_c_attn_columns_are_named_as_transformers_splits_them() -> None:
    torch.manual_seed(0)
    m = _gpt2()
    heads = heads_from_config(m.config.to_dict())
    assert heads == Heads(4, 4, 8, False)
    attn, x = m.transformer.h[0].attn, torch.randn(1, 3, 32)
    w = attn.c_attn.weight  # Conv1D: [n_embd, 3 n_embd], output units on dim 1
    for u in range(w.shape[1]):
        which, where = _moved(lambda: attn.c_attn(x).split(attn.split_size, dim=2), w, u, 1)
        head = int(where[0, -1]) // heads.head_dim
        name = "transformer.h.0.attn.c_attn.weight"
        assert part_of(name, (0, u), tuple(w.shape), heads) == f"{'qkv'[which]} (head {head})"


def test_nanogpt_c_attn_rows_are_named_as_its_split_gives_them() -> None:
    """nanoGPT's `c_attn` is an nn.Linear (output units on dim 0, GPT-2's Conv1D has them on
    dim 1): the same name, the other axis."""
    from fixtures.tinygpt import GPT, GPTConfig

    cfg = GPTConfig()
    heads = heads_from_config({"n_head": cfg.n_head, "n_embd": cfg.n_embd})
    torch.manual_seed(0)
    attn, x = GPT(cfg).transformer.h[0].attn, torch.randn(1, 3, cfg.n_embd)
    w = attn.c_attn.weight  # [3 C, C]
    for u in range(w.shape[0]):
        which, where = _moved(lambda: attn(x), w, u, 0)
        want = f"{'qkv'[which]} (head {int(where[0, -1]) // heads.head_dim})"
        assert part_of("transformer.h.0.attn.c_attn.weight", (u, 0), tuple(w.shape), heads) == want


class _Attention(TorchFunctionMode):
    """The queries, keys and values of the first `scaled_dot_product_attention` a forward
    runs ([B, H, T, D] each, after the model's own split and RoPE: RoPE mixes channels
    within a head, never across heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv: list[torch.Tensor] | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        if func is F.scaled_dot_product_attention and self.qkv is None:
            self.qkv = [t.detach().clone() for t in args[:3]]
        return func(*args, **(kwargs or {}))


def _hf_qkv(model: nn.Module, w: torch.Tensor, unit: int) -> tuple[int, int]:
    """Which of q/k/v (0, 1, 2) and which head of it (a key or value head: its group) row
    `unit` of `w` feeds, as the model's own forward splits its fused projection."""

    def run() -> list[torch.Tensor]:
        with torch.no_grad(), _Attention() as a:
            model(**IDS)
        assert a.qkv is not None
        return a.qkv

    base = run()
    with torch.no_grad():
        w[unit].add_(1.0)
    try:
        after = run()
    finally:
        with torch.no_grad():
            w[unit].sub_(1.0)
    moved = [i for i, (a, b) in enumerate(zip(base, after, strict=True)) if not torch.equal(a, b)]
    assert len(moved) == 1
    i = moved[0]
    heads = (base[i] != after[i]).nonzero()[:, 1].unique()
    # keys and values repeated per query head (GQA, MQA) move every head of their group
    return i, int(heads[0]) // (len(heads) if i else 1)


def _hf(kind: str) -> tuple[nn.Module, str]:
    import transformers as T

    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "attn_implementation": "sdpa",
    }
    if kind.startswith("falcon"):
        arch = {
            "falcon-grouped": {"new_decoder_architecture": True, "num_kv_heads": 2},
            "falcon-multi-query": {"multi_query": True},
            "falcon-per-head": {"multi_query": False},
        }[kind]
        m = T.FalconForCausalLM(T.FalconConfig(num_hidden_layers=1, **small, **arch))
        return m, "transformer.h.0.self_attention.query_key_value.weight"
    if kind == "gpt-neox":
        m = T.GPTNeoXForCausalLM(
            T.GPTNeoXConfig(num_hidden_layers=1, intermediate_size=64, **small)
        )
        return m, "gpt_neox.layers.0.attention.query_key_value.weight"
    m = T.Phi3ForCausalLM(
        T.Phi3Config(
            num_hidden_layers=1,
            intermediate_size=64,
            num_key_value_heads=2,
            pad_token_id=0,
            **small,
        )
    )
    return m, "model.layers.0.self_attn.qkv_proj.weight"


@pytest.mark.parametrize(
    "kind", ["falcon-grouped", "falcon-multi-query", "falcon-per-head", "gpt-neox", "phi3"]
)
def test_hf_fused_qkv_rows_are_named_as_the_model_splits_them(kind: str) -> None:
    torch.manual_seed(0)
    model, name = _hf(kind)
    model.eval()
    heads = heads_from_config(model.config.to_dict())
    assert heads is not None
    w = model.get_parameter(name)
    for u in range(w.shape[0]):
        which, head = _hf_qkv(model, w, u)
        got = part_of(name, (u, 0), tuple(w.shape), heads)
        kv = "query group" if heads.qkv == "grouped" else "head"
        assert got is not None and got.startswith("qkv"[which]), (u, got)
        assert f"(head {head}" in got if which == 0 else got.endswith(f"({kv} {head})"), (u, got)


def test_megatron_linear_qkv_rows_are_named_by_query_group() -> None:
    """megatron-core's `get_query_key_value_tensors` split (q1 q2 k1 v1 | q3 q4 k2 v2), as the
    reference forward runs it, under the args the committed megatron-core run recorded."""
    with open_checkpoint(TE_LAYOUT_RUN / "iter_0000020") as c:
        heads = heads_from_config(c.config)
        model = MegatronGPT(c.config, fused_norm=True)
        load_weights(model, c)  # the run's own weights
    assert heads == Heads(4, 2, 8, True)  # --num-attention-heads 4 --num-query-groups 2 --swiglu
    attn = model.decoder.layers[0].self_attention
    x = torch.randn(1, 3, 32)
    w = attn.linear_qkv.weight  # [ng (np/ng + 2) hn, h]
    per = heads.n_heads // heads.n_kv
    for u in range(w.shape[0]):
        which, where = _moved(lambda: attn(x), w, u, 0)
        g, c = int(where[0, 2]), int(where[0, 3])
        want = (
            f"q (head {g * per + c // heads.head_dim}, query group {g})"
            if which == 0
            else f"{'qkv'[which]} (query group {g})"
        )
        assert part_of("decoder.layers.0.self_attention.linear_qkv.weight", (u, 0), tuple(w.shape), heads) == want  # fmt: skip


class _Chunks(TorchFunctionMode):
    """The halves of the first `chunk` a forward runs: the model's own gate and up."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[torch.Tensor] | None = None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (torch.Tensor.chunk, torch.chunk) and self.parts is None:
            self.parts = [t.detach().clone() for t in out]
        return out


def test_gate_up_rows_are_named_as_the_model_chunks_them() -> None:
    """Phi-3's `gate_up_proj` (transformers) and Megatron's SwiGLU `linear_fc1` (the reference
    forward, under the committed run's args): `chunk(2)`, the first half through the SiLU."""
    import transformers as T

    torch.manual_seed(0)
    phi = T.Phi3ForCausalLM(T.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, pad_token_id=0))  # fmt: skip
    with open_checkpoint(TE_LAYOUT_RUN / "iter_0000020") as c:
        heads, meg = heads_from_config(c.config), MegatronGPT(c.config, fused_norm=True)
        load_weights(meg, c)
    cases = [
        (phi.model.layers[0].mlp, "model.layers.0.mlp.gate_up_proj.weight", heads_from_config(phi.config.to_dict())),
        (meg.decoder.layers[0].mlp, "decoder.layers.0.mlp.linear_fc1.weight", heads),
    ]  # fmt: skip
    for mlp, name, h in cases:
        x = torch.randn(1, 3, 32)
        w = mlp.get_parameter(name.split(".mlp.", 1)[1])
        for u in range(w.shape[0]):
            with torch.no_grad(), _Chunks() as a:
                mlp(x)
            base = a.parts
            with torch.no_grad():
                w[u].add_(1.0)
                with _Chunks() as b:
                    mlp(x)
                w[u].sub_(1.0)
            assert base is not None and b.parts is not None
            moved = [i for i in (0, 1) if not torch.equal(base[i], b.parts[i])]
            assert moved and part_of(name, (u, 0), tuple(w.shape), h) == ("gate", "up")[moved[0]]


@pytest.mark.parametrize(
    ("name", "index", "shape", "want"),
    [
        ("decoder.layers.0.mlp.linear_fc1.weight", (63, 0), (128, 32), "gate"),
        ("decoder.layers.0.mlp.linear_fc1.weight", (64, 0), (128, 32), "up"),
        ("model.layers.0.mlp.gate_up_proj.weight", (70, 1), (128, 32), "up"),
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", (3,), (32,), "norm"),
        ("decoder.layers.0.self_attention.linear_proj.weight", (3, 0), (32, 32), None),
    ],
)
def test_gate_up_and_fused_norm_parts(
    name: str, index: tuple[int, ...], shape: tuple[int, ...], want: str | None
) -> None:
    assert part_of(name, index, shape, Heads(4, 2, 8, True)) == want


def test_a_bit_flip_in_c_attn_names_its_part(zoo: dict[str, Path], tmp_path: Path) -> None:
    """The HF Trainer GPT-2 run with one exponent bit flipped in a column of `c_attn` of its
    saved step-40 weights (safetensors' own writer): the diff's finding and the verdict's
    corrupted element name the part that column feeds, as transformers' split gives it."""
    import transformers as T
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(zoo["hf-gpt2"], run)
    path, name = run / "checkpoint-40" / "model.safetensors", "transformer.h.1.attn.c_attn.weight"
    sd = load_file(path)
    w = sd[name]  # [n_embd, 3 n_embd]
    col = 32 + 2 * 8 + 3  # a column of the key's third head, as transformers splits c_attn
    bits = w[:, col].contiguous().view(torch.int32)
    rows = torch.nonzero(((bits & (1 << 25)) == 0) & (w[:, col].abs() > w.abs().median()))
    row = int(rows[0])
    w[row, col] = (w[row, col : col + 1].view(torch.int32) ^ (1 << 25)).view(torch.float32)[0]
    save_file(sd, str(path), metadata={"format": "pt"})

    with open_checkpoint(run / "checkpoint-30") as a, open_checkpoint(run / "checkpoint-40") as b:
        result = diff_checkpoints(a, b, DiffConfig())
    verdict = decide(diff_findings(result), before="30", after="40")
    model = T.GPT2LMHeadModel(T.GPT2Config.from_pretrained(run / "checkpoint-40"))
    attn, x = model.transformer.h[1].attn, torch.randn(1, 3, 32)
    which, where = _moved(
        lambda: attn.c_attn(x).split(attn.split_size, dim=2),
        attn.c_attn.weight,
        col,
        1,
    )
    want = f"{'qkv'[which]} (head {int(where[0, -1]) // 8})"
    assert want == "k (head 2)"
    e = verdict.corrupted_elements[0]
    assert e["tensor"] == name and e["index"] == [row, col] and e["part"] == want
    assert f"{name} ({want})" in next(f.message for f in diff_findings(result) if f.subject == name)


QKV, FC1 = "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.mlp.linear_fc1"


@pytest.mark.parametrize(
    ("module", "params", "heads", "want"),
    [
        (QKV, [f"{QKV}.weight", f"{QKV}.layer_norm_weight"], None, "norm fused with the q, k, v projections"),
        (FC1, [f"{FC1}.weight", f"{FC1}.layer_norm_weight"], Heads(4, 2, 8, True), "norm fused with the gate, up projections"),
        (FC1, [f"{FC1}.weight", f"{FC1}.layer_norm_weight"], Heads(4, 2, 8, False), "norm fused with the projection"),
        ("transformer.h.0.attn.c_attn", ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"], None, "q, k, v projections"),
        ("transformer.h.0.attn", ["transformer.h.0.attn.c_attn.weight"], None, None),
        ("model.layers.0.self_attn.q_proj", ["model.layers.0.self_attn.q_proj.weight"], None, None),
    ],
)  # fmt: skip
def test_a_fused_module_is_named_by_what_it_computes(
    module: str, params: list[str], heads: Heads | None, want: str | None
) -> None:
    assert computes(module, params, heads) == want


def test_replay_names_what_a_fused_parameter_computes(tmp_path: Path) -> None:
    """A per-module LR bug (x300 from step 31, as the zoo's gradient_explosion) on nanoGPT's
    fused `c_attn`, trained by the project's own loop: the replay's findings on it say it is
    the q, k, v projections."""
    from fixtures.zoo import Run, _module_bug, train

    out = tmp_path / "qkv"
    train(Run(name="qkv", out=out, module_lr={"transformer.h.1.attn.c_attn": _module_bug}))
    doc = api.replay(
        "30", "40", run_dir=out, batch=out / "batches.h5", model="fixtures/tinygpt.py:factory"
    ).doc
    assert doc["verdict"]["first_anomalous_module"] == "transformer.h.1.attn.c_attn"
    rms = [f for f in doc["findings"] if f["kind"] == "rms_t"]
    assert rms and rms[0]["subject"].startswith("transformer.h.1.attn.c_attn.")
    assert f"{rms[0]['subject']} (q, k, v projections)'s gradient" in rms[0]["message"]
