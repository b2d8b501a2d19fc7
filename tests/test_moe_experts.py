"""Per-expert evidence of a fused Mixture-of-Experts tensor in `diff`, on a tiny Qwen3-MoE
trained by transformers' Trainer (`fixtures/hf_families.py`).

One run, checkpoints every 4 steps: from step 8 on, layer 1's router never picks expert 2 (a
forward hook on the model's own router, `mlp.gate`, masks that expert's logit before its top-k),
and layer 0's expert 1 gets 30x its gradient (a hook on the fused parameters scales its slice).
Window 4 -> 8 is the healthy run (every expert routed, the usual imbalance), window 8 -> 12 the
one where expert 2 of layer 1 gets no token (its moments decay exactly by beta^k) and expert 1
of layer 0 takes the gradient energy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptforensics as cf
from fixtures.formats import _hf_run
from fixtures.hf_families import ROUTERS, build, layer_prefix

pytest.importorskip("transformers")

FAMILY, LAYER, DEAD, SAVE, STEPS = "qwen3_moe", 1, 2, 4, 12
HOT_LAYER, HOT, HOT_SCALE = 0, 1, 30.0


def _drop_expert(router: torch.nn.Module, expert: int) -> None:
    """Route around `expert`: its logit masked, the top-k redone as the router does."""

    def hook(mod: Any, _inp: Any, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits = out[0].clone()
        logits[:, expert] = -1e4
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, mod.top_k, dim=-1)
        if mod.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    router.register_forward_hook(hook)


def _scale_expert(experts: torch.nn.Module, expert: int, scale: float) -> None:
    """`expert`'s slice of every fused parameter's gradient times `scale`."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g[expert] *= scale
        return g

    for p in experts.parameters():
        p.register_hook(hook)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    out = _hf_run(tmp_path_factory.mktemp("moe"), "qwen3-moe-dead-expert")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build(FAMILY, vocab=64, seq=32, width=16, layers=2, heads=4)
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(STEPS * 8):
        ids = torch.randint(1, 64, (32,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    router = model.get_submodule(f"{layer_prefix(FAMILY)}{LAYER}.{ROUTERS[FAMILY]}")
    experts = model.get_submodule(f"{layer_prefix(FAMILY)}{HOT_LAYER}.mlp.experts")

    class Drop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2 * SAVE:  # the steps after checkpoint-8 route around it
                _drop_expert(router, DEAD)
                _scale_expert(experts, HOT, HOT_SCALE)

    args = TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=SAVE, per_device_train_batch_size=8,
        learning_rate=1e-2, weight_decay=0.1, adam_beta2=0.95, max_grad_norm=1.0, logging_steps=1,
        use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Drop()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return out


@pytest.fixture(scope="module")
def incident(run: Path) -> Any:
    """The window 8 -> 12: expert 2 of layer 1 routed around, expert 1 of layer 0 hot."""
    return cf.diff(2 * SAVE, 3 * SAVE, run_dir=run)


def _kinds(rep: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in rep.findings:
        out.setdefault(f.kind, []).append(f)
    return out


def test_a_dead_expert_is_named_by_its_layer_and_id(incident: Any) -> None:
    rep = incident
    dead = _kinds(rep).get("dead_expert", [])
    layer = f"{layer_prefix(FAMILY)}{LAYER}.mlp.experts"
    assert [f.subject for f in dead] == [layer], dead
    f = dead[0]
    assert f.metrics["experts"] == [DEAD] and f.metrics["layer"] == LAYER
    assert f.severity == "warning" and f.supports == ("expert_collapse",)
    assert f.source == "docs/signatures.md#dead-expert"
    # The per-expert statistics behind it: no element of either moment left the decay.
    rows = {t["name"]: t for t in rep.doc["diff"]["tensors"]}
    st = rows[f"{layer}.gate_up_proj"]["experts"]
    assert st["decayed"] == [e == DEAD for e in range(st["experts"])]
    assert abs(st["r_v"][DEAD]) < 1e-3
    assert "expert_collapse" in [c["cause"] for c in rep.verdict["causes"]]


def test_an_expert_taking_the_gradient_leads_the_exploding_layers(incident: Any) -> None:
    rep = incident
    hot = _kinds(rep).get("expert_update_outlier", [])
    layer = f"{layer_prefix(FAMILY)}{HOT_LAYER}.mlp.experts"
    assert {f.subject for f in hot} == {f"{layer}.gate_up_proj", f"{layer}.down_proj"}, hot
    assert all(f.metrics["expert"] == HOT and f.metrics["layer"] == HOT_LAYER for f in hot)
    # Adam normalised its update; its moments took the energy.
    assert all(f.metrics["energy_factor"] > 30 for f in hot)
    assert rep.verdict["exploding_layers"][0] == layer
    assert rep.verdict["causes"][0]["cause"] == "gradient_explosion"


def test_the_healthy_window_is_quiet(run: Path) -> None:
    rep = cf.diff(SAVE, 2 * SAVE, run_dir=run)
    kinds = _kinds(rep)
    assert not {"dead_expert", "expert_update_outlier", "expert_return_sign_like"} & set(kinds)
    assert rep.verdict["causes"][0]["cause"] == "none", rep.verdict["causes"]
