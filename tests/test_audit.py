"""audit: the architecture read from the module graph and forward order on known models and on
every fixture trainer's run; its rows on the two logit mechanisms and their healthy twins; the
command's JSON, exit codes and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import ckptforensics as api
from ckptforensics.cli import cli
from ckptforensics.commands.audit import trace_architecture
from fixtures.tinygpt import GPT, GPTConfig
from tests.conftest import ROOT
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"
DATA = ROOT / "fixtures" / "data"
IDS = {"input_ids": torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))}


# ----------------------------------------------------------------- known architectures
def _hf(name: str, impl: str = "sdpa") -> nn.Module:
    import transformers as T

    small = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "attn_implementation": impl,
    }
    if name == "gpt2":
        return T.GPT2LMHeadModel(
            T.GPT2Config(
                vocab_size=64,
                n_positions=64,
                n_embd=32,
                n_layer=2,
                n_head=4,
                attn_implementation=impl,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
    if name in ("opt-post", "opt-pre"):
        cfg = T.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                          word_embed_proj_dim=32, do_layer_norm_before=name == "opt-pre", attn_implementation=impl)  # fmt: skip
        return T.OPTForCausalLM(cfg)
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **small))
    if name == "gemma2":
        return T.Gemma2ForCausalLM(
            T.Gemma2Config(
                num_key_value_heads=2, head_dim=8, **{**small, "attn_implementation": "eager"}
            )
        )
    if name == "olmo2":
        return T.Olmo2ForCausalLM(T.Olmo2Config(**small))
    if name == "qwen3":
        return T.Qwen3ForCausalLM(T.Qwen3Config(num_key_value_heads=2, head_dim=8, **small))
    raise ValueError(name)


# (builder, placement, qk_norm): what each model's own code does (read from its source).
KNOWN = [
    (lambda: GPT(GPTConfig()), "pre", False),
    (lambda: GPT(GPTConfig(norm="post")), "post", False),
    (lambda: GPT(GPTConfig(norm="reordered")), "reordered", False),
    (lambda: GPT(GPTConfig(qk_norm=True)), "pre", True),
    (lambda: GPT(GPTConfig(norm="post", qk_norm=True)), "post", True),
    (lambda: _hf("gpt2"), "pre", False),
    (lambda: _hf("gpt2", "eager"), "pre", False),
    (lambda: _hf("llama"), "pre", False),
    (lambda: _hf("llama", "eager"), "pre", False),
    (lambda: _hf("opt-post"), "post", False),  # OPT with do_layer_norm_before=False (OPT-350m's)
    (lambda: _hf("opt-pre"), "pre", False),
    (
        lambda: _hf("gemma2"),
        "sandwich",
        False,
    ),  # pre- and post-sublayer norms, soft-capped attention
    (
        lambda: _hf("olmo2"),
        "reordered",
        True,
    ),  # OLMo 2: norm after the sublayer, QK-norm on full q, k
    (lambda: _hf("qwen3"), "pre", True),  # per-head q_norm / k_norm
]
KNOWN_IDS = ["tinygpt", "tinygpt-post", "tinygpt-reordered", "tinygpt-qk", "tinygpt-post-qk", "gpt2", "gpt2-eager", "llama", "llama-eager",
             "opt-post", "opt-pre", "gemma2-eager", "olmo2", "qwen3"]  # fmt: skip


@pytest.mark.parametrize(("build", "placement", "qk"), KNOWN, ids=KNOWN_IDS)
def test_trace_reads_placement_and_qk_norm_of_known_models(
    build: Any, placement: str, qk: bool
) -> None:
    torch.manual_seed(0)
    arch = trace_architecture(build(), IDS)
    assert arch.norm_placement == placement, [x.placement for x in arch.layers]
    assert arch.qk_norm is qk
    assert len(arch.layers) == 2 or len(arch.layers) == 4


def test_gemma2_soft_caps_and_scaled_embeddings_are_seen() -> None:
    torch.manual_seed(0)
    arch = trace_architecture(_hf("gemma2"), IDS)
    assert arch.final_softcap and all(x.softcap for x in arch.layers)
    # Gemma multiplies its embeddings by sqrt(d): the stream enters at ~0.02 sqrt(32)
    assert 0.08 < arch.embed_rms < 0.15
    assert arch.tied_embeddings is True


class _RMS(nn.Module):
    """An RMSNorm written by hand (no torch norm class or function): found by behaviour."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Block(nn.Module):
    """Post-LN, whose norms are named as a pre-LN model's would be: names must not decide."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.input_layernorm = _RMS(d)  # used after the residual add
        self.pre_mlp_layernorm = _RMS(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.ff = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in self.qkv(x).split(d, -1))
        y = (
            nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            .transpose(1, 2)
            .reshape(b, t, d)
        )
        x = self.input_layernorm(x + self.o(y))
        return self.pre_mlp_layernorm(x + self.ff(x))


class _Misnamed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_norm = nn.Embedding(64, 16)  # the token embedding, named like a norm
        self.blocks = nn.ModuleList([_Block(16), _Block(16)])
        self.k_norm = nn.Linear(16, 64)  # the head, named like a norm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.q_norm(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.k_norm(x)


def test_names_do_not_decide() -> None:
    """Norms named `input_layernorm` but applied after the add, a hand-written RMSNorm, an
    embedding and a head named `q_norm` / `k_norm`: post-LN, no QK-norm, untied."""
    torch.manual_seed(0)
    arch = trace_architecture(_Misnamed(), IDS)
    assert arch.norm_placement == "post" and arch.qk_norm is False
    assert (
        arch.head_param == "k_norm.weight"
        and arch.embedding_params == ("q_norm.weight",)
        and arch.tied_embeddings is False
    )
    assert set(arch.norm_params) == {
        f"blocks.{i}.{n}.g" for i in (0, 1) for n in ("input_layernorm", "pre_mlp_layernorm")
    }


# ----------------------------------------------------------------- every fixture trainer's run
@pytest.fixture(scope="module")
def placement_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The project's GPT trained post-LN and with OLMo 2's reordered norm by its own loop."""
    from fixtures.zoo import Run, train

    root = tmp_path_factory.mktemp("placements")
    out = {}
    for norm in ("post", "reordered"):
        run = Run(
            name=norm, out=root / norm, steps=20, save_every=10, cfg=GPTConfig(n_layer=2, norm=norm)
        )
        train(run)
        out[norm] = run.out
    # nanoGPT's calling convention: forward(idx, targets) -> (logits, loss), the last position's
    # logits only without targets; labels are next-token targets.
    run = Run(
        name="targets",
        out=root / "targets",
        steps=20,
        save_every=10,
        cfg=GPTConfig(n_layer=2),
        convention="targets",
    )
    train(run)
    out["targets"] = run.out
    return out


def _audit(run: Path, model: str | None = None, step: str | None = None) -> dict[str, Any]:
    return api.audit(step, run_dir=run, model=model).doc


# (zoo run or fixtures/data dir, --model, placement, qk_norm): the architecture each run's model has.
TRAINERS = [
    ("healthy", MODEL, "pre", False),  # own loop (fixtures/zoo.py), nanoGPT checkpoints
    ("hf-trainer", None, "pre", False),  # transformers Trainer, Llama (config.json)
    ("hf-gpt2", None, "pre", False),  # transformers Trainer, GPT-2
    ("lightning", "fixtures/tinygpt.py:from_hparams", "pre", False),  # Lightning ModelCheckpoint
    (
        "data:megatron-core-0.19/legacy",
        None,
        "pre",
        False,
    ),  # megatron-core, local spec (RMSNorm modules)
    (
        "data:megatron-core-0.19/distopt",
        None,
        "pre",
        False,
    ),  # megatron-core, TE spec: norms fused into linear_qkv
    ("data:olmo-core-3.0/run", None, "reordered", True),  # OLMo-core reordered_norm block, qk_norm
]


@pytest.mark.parametrize(
    ("run", "model", "placement", "qk"), TRAINERS, ids=[t[0] for t in TRAINERS]
)
def test_audit_names_norm_placement_and_qk_norm_of_every_trainer(
    zoo: dict[str, Path], run: str, model: str | None, placement: str, qk: bool
) -> None:
    path = DATA / run.split(":", 1)[1] if run.startswith("data:") else zoo[run]
    doc = _audit(path, model)
    assert doc["architecture"]["norm_placement"] == placement
    assert doc["architecture"]["qk_norm"] is qk
    rows = {r["id"]: r for r in doc["audit"]["rows"]}
    assert rows["norm_placement"]["status"] == "ok" and rows["norm_placement"]["value"] == placement
    assert rows["qk_norm"]["status"] == ("ok" if qk else "risk")


@pytest.mark.parametrize("norm", ["post", "reordered"])
def test_audit_own_loop_post_ln_and_reordered(
    placement_runs: dict[str, Path], norm: str, tmp_path: Path
) -> None:
    r = CliRunner().invoke(
        cli, ["audit", "--run-dir", str(placement_runs[norm]), "--model", MODEL, "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["architecture"]["norm_placement"] == norm and doc["architecture"]["qk_norm"] is False
    rows = {x["id"]: x for x in doc["audit"]["rows"]}
    assert rows["norm_placement"]["status"] == ("risk" if norm == "post" else "ok")
    if norm == "post":
        assert (
            rows["norm_placement"]["severity"] == "warning"
            and "post-LN" in rows["norm_placement"]["message"]
        )
        assert rows["embedding_scale"]["status"] == "ok"  # the stream is normalised after every add
    # the pair's rows compare with the checkpoint before
    assert doc["audit"]["compared_with"]["step"] == 10 and rows["activation_growth"]["status"] in (
        "ok",
        "risk",
    )


def test_nanogpt_calling_convention_is_traced_on_every_position(
    placement_runs: dict[str, Path],
) -> None:
    """A model that returns the last position's logits unless given targets is called as its
    trainer calls it (replay.conventions): the head and RMS_t see every position."""
    doc = _audit(placement_runs["targets"], "fixtures/tinygpt.py:targets_factory")
    arch = doc["architecture"]
    assert (
        arch["norm_placement"] == "pre"
        and arch["tied_embeddings"] is True
        and arch["head_param"] == "transformer.wte.weight"
    )  # tied: its first name
    rows = _rows(doc)
    assert rows["beta2"]["status"] in ("ok", "risk") and rows["beta2"]["value"]["rms_t_max"] > 0


def test_litgpt_architecture_or_what_to_install() -> None:
    """LitGPT's model is Llama-like: pre-LN RMSNorm, no QK-norm (model_config.yaml norm_qk false)."""
    doc = _audit(DATA / "litgpt-0.5")
    try:
        import litgpt  # noqa: F401
    except ImportError:
        assert doc["architecture"]["norm_placement"] is None
        assert "needs litgpt (pip install litgpt)" in doc["architecture"]["note"]
        rows = {r["id"]: r for r in doc["audit"]["rows"]}
        assert (
            rows["norm_placement"]["status"] == "unknown"
            and "pip install litgpt" in rows["norm_placement"]["message"]
        )
        assert (
            rows["warmup"]["value"]["warmup"] == 5
        )  # what LitGPT's hyperparameters.yaml says is still read
        return
    assert (
        doc["architecture"]["norm_placement"] == "pre" and doc["architecture"]["qk_norm"] is False
    )


# ----------------------------------------------------------------- the two mechanisms
@pytest.fixture(scope="module")
def logit_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fixtures.logit_runs import build_logit_runs

    return build_logit_runs(tmp_path_factory.mktemp("logits"))


def _rows(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in doc["audit"]["rows"]}


def test_attention_growth_audits_risky_and_its_qk_norm_twin_clean(
    logit_runs: dict[str, Path],
) -> None:
    hot = _rows(_audit(logit_runs["attention_growth"], MODEL))
    layer = json.loads((logit_runs["attention_growth"] / "truth.json").read_text())["layers"][0]
    assert hot["qk_norm"]["status"] == "risk" and hot["qk_norm"]["severity"] == "warning"
    assert (
        hot["attention_logits"]["status"] == "risk" and hot["attention_logits"]["subject"] == layer
    )
    assert hot["attention_logits"]["value"]["max_logit"][layer] > 50
    twin = _rows(_audit(logit_runs["attention_growth-qknorm"], MODEL))
    assert twin["qk_norm"]["status"] == "ok" and twin["attention_logits"]["status"] == "ok"
    assert max(twin["attention_logits"]["value"]["max_logit"].values()) < 50


def test_output_drift_audits_risky_and_its_z_loss_twin_clean(logit_runs: dict[str, Path]) -> None:
    hot = _rows(_audit(logit_runs["output_drift"], MODEL))
    assert hot["logit_control"]["status"] == "risk" and hot["output_logits"]["status"] == "risk"
    assert (
        hot["output_logits"]["value"]["log_z"] > 30 and hot["output_logits"]["subject"] == "lm_head"
    )
    twin = _rows(_audit(logit_runs["output_drift-zloss"], MODEL))
    assert (
        twin["logit_control"]["status"] == "ok"
        and "z-loss 0.0001" in twin["logit_control"]["message"]
    )
    assert (
        twin["output_logits"]["status"] == "ok"
        and abs(twin["output_logits"]["value"]["log_z"]) < 10
    )


def _replay(run: Path, tmp: Path, *extra: str) -> dict[str, Any]:
    t = json.loads((run / "truth.json").read_text())
    args = [
        "-q",
        "replay",
        "--run-dir",
        str(run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
        "--batch",
        str(run / "batches.h5"),
        "--model",
        MODEL,
    ]
    r = CliRunner().invoke(cli, [*args, *extra, "--out", str(tmp)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((tmp / "report.json").read_text())


def test_attention_growth_replays_to_its_cause_and_layer(
    logit_runs: dict[str, Path], tmp_path: Path
) -> None:
    run = logit_runs["attention_growth"]
    truth = json.loads((run / "truth.json").read_text())
    doc = _replay(run, tmp_path / "hot")
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "attention_logit_growth"
    assert v["first_anomalous_module"] == truth["layers"][0]
    f = next(x for x in doc["findings"] if x["kind"] == "attention_logit_growth")
    assert f["subject"] == truth["layers"][0] and f["severity"] == "warning"
    twin = _replay(logit_runs["attention_growth-qknorm"], tmp_path / "twin")
    assert twin["verdict"]["causes"][0]["cause"] == "none"
    assert not any(x["kind"] == "attention_logit_growth" for x in twin["findings"])


def test_output_drift_replays_to_its_cause_and_head(
    logit_runs: dict[str, Path], tmp_path: Path
) -> None:
    doc = _replay(logit_runs["output_drift"], tmp_path / "hot")
    assert doc["verdict"]["causes"][0]["cause"] == "output_logit_divergence"
    assert doc["verdict"]["first_anomalous_module"] == "lm_head"
    twin = _replay(
        logit_runs["output_drift-zloss"],
        tmp_path / "twin",
        "--loss",
        "fixtures/tinygpt.py:zloss_token_loss",
    )
    assert twin["verdict"]["causes"][0]["cause"] == "none"


def test_probe_attention_statistics_match_the_fixtures_own_measurement(
    logit_runs: dict[str, Path],
) -> None:
    """The probe's per-layer max logit and entropy on each replayed step against the fixture's
    own fp32 recomputation of q k^T in training (same state, same batch)."""
    from ckptforensics.engine.replay.run import ReplayConfig, replay

    run = logit_runs["attention_growth"]
    truth = json.loads((run / "truth.json").read_text())
    rep = replay(
        ReplayConfig(
            before=run / f"step_{truth['before']}.pt",
            after=None,
            step=truth["before"] + 1,
            model=MODEL,
            batch=str(run / "batches.h5"),
            clip=1.0,
        )
    )
    s = truth["before"] + 1
    p = rep.passes[s]
    assert (
        p.attn_modules == ("transformer.h.0.attn", "transformer.h.1.attn") and p.head == "lm_head"
    )
    got_max = p.attn[..., 0].amax(1).tolist()
    got_ent = p.attn[..., 1].mean(1).tolist()
    want_max, want_ent = (
        truth["attention"]["max_logit"][str(s)],
        truth["attention"]["entropy"][str(s)],
    )
    assert got_max == pytest.approx(want_max, rel=1e-3)
    assert got_ent == pytest.approx(want_ent, rel=1e-3)
    assert math.isfinite(p.logit_mean)


# ----------------------------------------------------------------- the command
def test_audit_json_strict_and_report_files(logit_runs: dict[str, Path], tmp_path: Path) -> None:
    run = logit_runs["attention_growth"]
    r = CliRunner().invoke(
        cli,
        [
            "audit",
            "--run-dir",
            str(run),
            "--model",
            MODEL,
            "--strict",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    assert r.exit_code == 1, r.output  # warnings at the default --fail-on warning
    assert (
        (tmp_path / "a" / "report.md")
        .read_text()
        .startswith("# ckptforensics audit: 0 critical, 2 warning")
    )
    assert "<h1>ckptforensics audit" in (tmp_path / "a" / "report.html").read_text()
    r = CliRunner().invoke(
        cli,
        [
            "audit",
            "--run-dir",
            str(run),
            "--model",
            MODEL,
            "--strict",
            "--fail-on",
            "critical",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert (
        doc["architecture"]["norm_placement"] == "pre" and doc["architecture"]["qk_norm"] is False
    )
    assert doc["verdict"]["causes"][0]["cause"] == "attention_logit_growth"
    # re-rendered from evidence.h5 identically
    r = CliRunner().invoke(cli, ["report", str(tmp_path / "a" / "evidence.h5"), "--format", "md"])
    assert r.exit_code == 0 and r.output == (tmp_path / "a" / "report.md").read_text()


def test_audit_bad_input_is_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["audit", "--run-dir", str(tmp_path)])
    assert_bad_input(r, "no checkpoint found")
    r = CliRunner().invoke(cli, ["audit", "--run-dir", str(tmp_path), "7"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_audit_help_teaches() -> None:
    r = CliRunner().invoke(cli, ["audit", "--help"])
    assert (
        r.exit_code == 0
        and "Example:" in r.output
        and "--strict" in r.output
        and "jq .architecture.norm_placement" in r.output
    )


# ----------------------------------------------------------------- numerics and optimizer rows
def _low_precision_run(root: Path, dtype: torch.dtype, lr: float, steps: int = 3) -> Path:
    """The project's GPT trained in `dtype` itself (weights and Adam state, no scaler, no fp32
    copy), saved as nanoGPT does."""
    from fixtures.zoo import batch_for_step, markov_table

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2)).to(dtype)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    table = markov_table(0)
    root.mkdir(parents=True)
    for step in range(1, steps + 1):
        ids = batch_for_step(step, table)
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).backward()
        opt.step()
    cfg = {"learning_rate": lr, "grad_clip": 0.0, "beta2": 0.95}
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "model_args": model.model_args(),
            "iter_num": steps,
            "config": cfg,
        },
        root / f"step_{steps}.pt",
    )
    return root


def test_fp16_without_a_scaler_is_critical_and_fails_a_strict_gate(tmp_path: Path) -> None:
    run = _low_precision_run(tmp_path / "fp16", torch.float16, 3e-3)
    r = CliRunner().invoke(
        cli,
        [
            "audit",
            "--run-dir",
            str(run),
            "--model",
            MODEL,
            "--json",
            "--strict",
            "--fail-on",
            "critical",
        ],
    )
    assert r.exit_code == 1, r.output
    rows = _rows(json.loads(r.output))
    assert (
        rows["fp16_loss_scaler"]["status"] == "risk"
        and rows["fp16_loss_scaler"]["severity"] == "critical"
    )
    assert (
        rows["clipping"]["status"] == "risk" and rows["clipping"]["value"] == 0.0
    )  # grad_clip 0 recorded
    assert json.loads(r.output)["audit"]["rows"][0]["id"] == "fp16_loss_scaler"  # severity first


def test_pure_bf16_at_a_small_lr_loses_its_updates(tmp_path: Path) -> None:
    run = _low_precision_run(tmp_path / "bf16", torch.bfloat16, 1e-5)
    rows = _rows(_audit(run, MODEL))
    mw = rows["master_weights"]
    assert mw["status"] == "risk" and mw["severity"] == "warning" and mw["value"] > 0.5
    assert (
        rows["fp16_loss_scaler"]["status"] == "ok" and rows["fp16_loss_scaler"]["value"] == "bf16"
    )


def test_loss_scale_history_of_an_fp16_run_with_a_scaler(zoo: dict[str, Path]) -> None:
    """The zoo's fp16 run: GradScaler (growth interval 20) whose scale the log records."""
    rows = _rows(_audit(zoo["fp16_overflow"], MODEL))
    fp = rows["fp16_loss_scaler"]
    assert fp["status"] == "ok" and fp["value"] >= 1
    ls = rows["loss_scale_history"]
    scales = [
        json.loads(x)["loss_scale"]
        for x in (zoo["fp16_overflow"] / "metrics.jsonl").read_text().splitlines()
    ]
    backoffs = sum(1 for a, b in zip(scales, scales[1:], strict=False) if b < a)
    assert ls["status"] in ("ok", "risk") and ls["value"] == pytest.approx(
        1000 * backoffs / (len(scales) - 1)
    )
    assert ls["threshold"] == pytest.approx(1000 / 20)  # the scaler's own growth interval
