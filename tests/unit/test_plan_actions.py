"""The plan's actions for the logit causes and Adam's instability: the logit causes' model
fix named at the verdict's layer with a lower LR as the config change, and Adam's change in
the run's own terms (its saved betas and epsilon), on a checkpoint torch.save wrote."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.detectors.causes import CAUSES
from ckptforensics.planner import plan_section
from ckptforensics.planner_adam import AdamRun


def _run(tmp_path: Path, betas: tuple[float, float], eps: float) -> Path:
    """Two checkpoints of a tiny AdamW loop (`ckpt_10.pt`, `ckpt_20.pt`); returns the first."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=betas, eps=eps)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    for step in (10, 20):
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            tmp_path / f"ckpt_{step}.pt",
        )
    return tmp_path / "ckpt_10.pt"


def _doc(cause: str, layer: str, tensor: str | None = None) -> dict[str, Any]:
    metrics = {"tensor": tensor} if tensor else {}
    return {
        "verdict": {
            "causes": [{"cause": cause, "confidence": 1.0, "evidence": ["F1"]}],
            "first_bad_step": 15,
            "first_anomalous_module": layer,
        },
        "findings": [{"kind": "k", "subject": layer, "metrics": metrics, "supports": [cause]}],
    }


@pytest.mark.parametrize(
    ("betas", "eps", "beta2", "raised"),
    [
        ((0.9, 0.72), 1e-16, 0.95, 1e-6),  # the creep draws' regime: beta2 < beta1^2 = 0.81
        ((0.9, 0.95), 1e-8, None, 1e-6),  # safe already: nothing to raise
        ((0.99, 0.9), 1e-6, 0.99, 1e-5),  # 0.95 and 0.98 are still under 0.99^2
        ((0.9, 0.5), math.nan, 0.95, 1e-6),  # no epsilon saved
    ],
)
def test_adams_safe_beta2_and_raised_eps_from_the_runs_own(
    betas: tuple[float, float], eps: float, beta2: float | None, raised: float
) -> None:
    run = AdamRun(betas, eps, None)
    assert run.safe_beta2 == beta2
    assert run.raised_eps == pytest.approx(raised)


def test_adam_instability_raises_the_runs_beta2_where_it_is_below_beta1_squared(
    tmp_path: Path,
) -> None:
    with open_checkpoint(_run(tmp_path, (0.9, 0.72), 1e-16)) as ck:
        p = plan_section(_doc("adam_instability", "1", "1.weight"), ck)
    (c,) = p["changes"]
    assert c["knob"] == "beta2" and c["value"] == 0.95 and c["status"] == "not_replayed"
    assert "the run's betas (0.9, 0.72) (1.weight's group)" in c["why"] and "0.81" in c["why"]
    (e,) = c["edits"]
    assert e["key"] == "optimizer: betas" and e["before"] == [0.9, 0.72]
    assert e["after"] == [0.9, 0.95]
    assert "betas" not in p["config_diff"]  # the trainer's config has no key for it


def test_adam_instability_raises_the_runs_eps_where_beta2_is_safe(tmp_path: Path) -> None:
    with open_checkpoint(_run(tmp_path, (0.9, 0.95), 1e-16)) as ck:
        p = plan_section(_doc("adam_instability", "1", "1.weight"), ck)
    (c,) = p["changes"]
    assert c["knob"] == "eps" and c["value"] == 1e-6
    assert c["why"].endswith("(the run's eps 1e-16 (1.weight's group))")
    assert c["edits"] == [{"key": "AdamW eps", "before": None, "after": 1e-6, "note": ""}]
    assert "g['eps'] = 1e-06" in p["config_diff"]


@pytest.mark.parametrize(
    ("cause", "layer", "fix"),
    [
        ("attention_logit_growth", "h.1.attn", "QK-norm on its queries and keys"),
        ("output_logit_divergence", "lm_head", "z-loss (1e-4 log^2 Z, PaLM)"),
    ],
)
def test_the_logit_causes_name_the_model_fix_at_the_layer_and_a_lower_lr(
    tmp_path: Path, cause: str, layer: str, fix: str
) -> None:
    with open_checkpoint(_run(tmp_path, (0.9, 0.95), 1e-8)) as ck:
        p = plan_section(_doc(cause, layer), ck)
    assert [(c["knob"], c["value"]) for c in p["changes"]] == [("lr_scale", 0.5)]
    note = p["notes"][0]
    assert note.startswith(cause.replace("_", " ")) and fix in note
    assert f"for {layer}" in note and "no change is known" not in " ".join(p["notes"])
    assert CAUSES[cause].tries[0] == "lr_scale=0.5"
