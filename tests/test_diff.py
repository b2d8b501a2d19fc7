"""The diff's verdicts against the ground truth each fixture planted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.core.tensors import adam_ratio_bound
from ckptforensics.detectors import diff_findings
from ckptforensics.engine.diff.pair import DiffConfig, diff_checkpoints
from ckptforensics.formats.locate import resolve_checkpoint
from ckptforensics.verdict import decide
from tests.conftest import truth


def run_diff(run: Path, a: str = "30", b: str = "40", **cfg: int):
    ca, cb = (
        open_checkpoint(resolve_checkpoint(a, run)),
        open_checkpoint(resolve_checkpoint(b, run)),
    )
    result = diff_checkpoints(ca, cb, DiffConfig(**cfg))
    findings = diff_findings(result)
    return result, findings, decide(findings, before=a, after=b)


@pytest.mark.parametrize(
    "run", ["healthy", "healthy-torch", "healthy-safetensors", "lightning", "hf-trainer"]
)
@pytest.mark.parametrize("pair", [("10", "20"), ("20", "30"), ("30", "40")])
def test_healthy_pairs_raise_no_alarm(
    zoo: dict[str, Path], run: str, pair: tuple[str, str]
) -> None:
    assert truth(zoo[run])["cause"] == "none"
    _, findings, verdict = run_diff(zoo[run], *pair)
    assert [f for f in findings if f.severity != "info"] == []
    assert verdict.causes[0]["cause"] == "none"
    assert verdict.rollback_checkpoint is None
    # A weights-only pair says it checked no Adam bound; a pair with moments says it did.
    weights_only = run == "healthy-safetensors"
    assert ("update bounds were not checked" in verdict.summary) == weights_only
    assert ("moved within its optimizer's update bound" in verdict.summary) == (not weights_only)


def test_lr_jump_is_ranked_first(zoo: dict[str, Path]) -> None:
    t = truth(zoo["lr_jump"])
    _, findings, verdict = run_diff(zoo["lr_jump"])
    assert verdict.causes[0]["cause"] == t["cause"] == "lr_too_high"
    kinds = {f.kind for f in findings}
    assert {"lr_jump", "lr_above_schedule", "update_ratio_high"} <= kinds
    assert verdict.rollback_checkpoint == "30"
    assert verdict.corrupted_elements == []


@pytest.mark.parametrize("run", ["silent_corruption", "silent_corruption-hf"])
def test_bit_flip_is_located_to_the_element_and_bit(zoo: dict[str, Path], run: str) -> None:
    t = truth(zoo[run])
    _, findings, verdict = run_diff(zoo[run])
    assert verdict.causes[0]["cause"] == "silent_corruption"
    assert len(verdict.corrupted_elements) == 1
    e = verdict.corrupted_elements[0]
    assert e["tensor"] == t["corrupted"]["tensor"]
    assert e["index"] == t["corrupted"]["index"]
    assert e["after"] == pytest.approx(t["corrupted"]["after"])
    assert e["kind"] == f"bit_flip(exponent bit {t['corrupted']['bit']})"


def test_chunking_does_not_change_the_answer(zoo: dict[str, Path]) -> None:
    whole, _, _ = run_diff(zoo["silent_corruption"])
    tiny, _, verdict = run_diff(zoo["silent_corruption"], chunk_elems=1000)
    assert (
        verdict.corrupted_elements[0]["index"]
        == truth(zoo["silent_corruption"])["corrupted"]["index"]
    )
    for x, y in zip(whole.tensors, tiny.tensors, strict=True):
        assert x.r_v == pytest.approx(y.r_v, rel=1e-6)
        assert x.dw_norm == pytest.approx(y.dw_norm, rel=1e-6)
        assert x.bound_violations == y.bound_violations


def test_weights_only_bit_flip_is_an_isolated_change(zoo: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(zoo["healthy-safetensors"], run)
    after = run / "step_40.safetensors"
    sd = load_file(after)
    name = "transformer.h.1.mlp.c_fc.weight"
    flat = sd[name].reshape(-1).clone()
    # Without optimizer state only an upward flip stands out (a weight shrinking to ~0
    # is indistinguishable from a legitimate update), and only on a weight of typical
    # size (near zero several flips explain the same value): flip a 0 bit of such one.
    typical = flat.abs() >= flat.abs().median()
    idx = int(torch.nonzero(((flat.view(torch.int32) & (1 << 25)) == 0) & typical)[0])
    flat[idx] = (flat[idx : idx + 1].view(torch.int32) ^ (1 << 25)).view(torch.float32)
    sd[name] = flat.view(sd[name].shape)
    save_file(sd, after, metadata={"step": "40"})
    result, findings, verdict = run_diff(run)
    assert result.pair.weights_only
    assert verdict.causes[0]["cause"] == "silent_corruption"
    e = verdict.corrupted_elements[0]
    assert (e["tensor"], e["index"]) == (name, [idx // sd[name].shape[1], idx % sd[name].shape[1]])
    assert e["kind"] == "bit_flip(exponent bit 25)"


def test_nonfinite_weights_are_data_not_errors(zoo: dict[str, Path], tmp_path: Path) -> None:
    src = zoo["healthy-torch"]
    ck = torch.load(src / "step_40.pt", weights_only=True)
    ck["model"]["transformer.h.0.mlp.c_fc.weight"][0, :3] = float("nan")
    torch.save(ck, tmp_path / "step_40.pt")
    shutil.copy(src / "step_30.pt", tmp_path / "step_30.pt")
    _, findings, verdict = run_diff(tmp_path)
    nf = [f for f in findings if f.kind == "nonfinite"]
    assert (
        nf and nf[0].subject == "transformer.h.0.mlp.c_fc.weight" and nf[0].metrics["weights"] == 3
    )
    assert "transformer.h.0.mlp.c_fc" in verdict.exploding_layers


def test_adam_bound_constant() -> None:
    # (1-b1)/sqrt((1-b2)(1-b1^2/b2)) = 1.16 at (0.9, 0.95) (docs/signatures.md#adam-update-bound); the first step moves by lr.
    assert adam_ratio_bound(0.9, 0.95, 10**6, 10**6) == pytest.approx(1.165, abs=1e-3)
    assert adam_ratio_bound(0.9, 0.999, 1, 1) == pytest.approx(1.0)


def test_loss_scale_backoff_and_skipped_steps(zoo: dict[str, Path], tmp_path: Path) -> None:
    """fp16 runs: a scaler that halved and trainer steps that never reached the optimizer."""
    import json

    src = zoo["hf-trainer"]
    a, b = tmp_path / "checkpoint-20", tmp_path / "checkpoint-36"
    shutil.copytree(src / "checkpoint-20", a)
    shutil.copytree(src / "checkpoint-30", b)
    torch.save(torch.amp.GradScaler("cpu", init_scale=65536.0).state_dict(), a / "scaler.pt")
    torch.save(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict(), b / "scaler.pt")
    state = json.loads((b / "trainer_state.json").read_text())
    # 16 trainer steps, 10 optimizer steps: 6 skipped on overflow, each halving the scale once
    # (GradScaler's rule: a scale that fell further than its skips is a scaler rebuilt instead)
    state["global_step"] = 36
    (b / "trainer_state.json").write_text(json.dumps(state))
    result, findings, verdict = run_diff(tmp_path, "20", "36")
    assert (result.pair.loss_scale_a, result.pair.loss_scale_b) == (65536.0, 1024.0)
    kinds = {f.kind: f for f in findings}
    assert "loss_scaler_reset" not in kinds
    assert kinds["skipped_steps"].metrics == {"trainer_steps": 16, "optimizer_steps": 10}
    assert kinds["loss_scale_backoff"].metrics["halvings"] == pytest.approx(6.0)
    assert verdict.causes[0]["cause"] == "fp16_overflow"


def test_a_window_over_the_warmup_peak_is_bounded_by_the_base_lr(tmp_path: Path) -> None:
    """A fresh run whose LR warms up to its peak inside the window and falls far below it by
    *after*: both checkpoints store LRs well under the peak the middle steps ran at. Bounded
    by the stored LRs, healthy updates would break Adam's bound everywhere; the schedule's
    base (nanoGPT's learning_rate) bounds a window that holds the end of warmup (its
    warmup_iters)."""
    from fixtures.tinygpt import GPTConfig
    from fixtures.zoo import Run, train

    peak = 1e-2

    def lr(s: int) -> float:  # warm up to the peak at 10, hold it to 18, then drop to 5%
        return peak * min(1.0, s / 10) if s <= 18 else 0.05 * peak

    run = Run(
        name="peak",
        out=tmp_path / "peak",
        steps=25,
        save_every=1,
        lr=lr,
        peak_lr=peak,
        warmup=10,
        cfg=GPTConfig(n_layer=1, n_embd=16, n_head=2),
    )
    train(run)
    for s in range(1, 26):
        if s not in (2, 25):
            (run.out / f"step_{s}.pt").unlink()
    result, findings, verdict = run_diff(run.out, "2", "25")
    assert (
        result.pair.lr_a[0] < 0.5 * peak and result.pair.lr_b[0] < 0.1 * peak
    )  # both ends far below the peak
    assert not [
        f for f in findings if f.kind in ("update_bound_exceeded_widely", "adam_bound_violation")
    ], [f.message for f in findings]
    assert verdict.causes[0]["cause"] == "none"
