"""Per-expert evidence of a fused Mixture-of-Experts tensor in `diff`, on a tiny Qwen3-MoE
trained by transformers' Trainer (`fixtures/hf_families.py`).

One run, checkpoints every 4 steps: from step 8 on, layer 1's router never picks expert 2 (a
forward hook on the model's own router, `mlp.gate`, masks that expert's logit before its top-k).
Window 4 -> 8 is the healthy run (every expert routed, the usual imbalance), window 8 -> 12 the
one where expert 2 of layer 1 gets no token: its moments decay exactly by beta^k.
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

    class Drop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2 * SAVE:  # the steps after checkpoint-8 route around it
                _drop_expert(router, DEAD)

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


def _kinds(rep: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in rep.findings:
        out.setdefault(f.kind, []).append(f)
    return out


def test_a_dead_expert_is_named_by_its_layer_and_id(run: Path) -> None:
    rep = cf.diff(2 * SAVE, 3 * SAVE, run_dir=run)
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
    assert rep.verdict["causes"][0]["cause"] == "expert_collapse"


def test_the_healthy_window_is_quiet(run: Path) -> None:
    rep = cf.diff(SAVE, 2 * SAVE, run_dir=run)
    kinds = _kinds(rep)
    assert not {"dead_expert", "expert_update_outlier", "expert_return_sign_like"} & set(kinds)
    assert rep.verdict["causes"][0]["cause"] == "none", rep.verdict["causes"]
