"""replay: model/optimizer reconstruction, per-sample gradients, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.engine.replay.samples import PerSampleGrad, per_token_loss, row_data_stats
from fixtures.tinygpt import GPT, GPTConfig
from tests.conftest import truth
from tests.test_cli import assert_bad_input

MODEL = "fixtures/tinygpt.py:factory"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_per_sample_gradient_norms_match_one_backward_per_sample() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    model.transformer.wte.weight = torch.nn.Parameter(
        model.lm_head.weight.detach().clone()
    )  # untie: Linear grads only
    ids = torch.randint(0, 64, (4, 16))
    psg = PerSampleGrad(model)
    psg.enabled = True
    per_token_loss(model(ids), ids).mean().backward()
    fast = psg.sq.clone()
    psg.enabled = False
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for b in range(4):
        model.zero_grad()
        (per_token_loss(model(ids[b : b + 1]), ids[b : b + 1]).sum() / (4 * 15)).backward()
        brute = sum(
            float(m.weight.grad.pow(2).sum())
            + (float(m.bias.grad.pow(2).sum()) if m.bias is not None else 0.0)
            for m in linears
        )
        assert float(fast[b]) == __import__("pytest").approx(brute, rel=1e-4)


def test_row_data_stats() -> None:
    import numpy as np

    rows = np.array([[5] * 40, [1, 2, 3] * 13 + [1], list(range(40))])
    st = row_data_stats(rows, np.arange(0, 10))
    assert st[0].longest_run == 40
    assert st[1].periodic_repeat == 40 and st[1].longest_run == 1
    assert st[2].unique_ratio == 1.0 and st[2].unseen == 30


def test_replay_reproduces_a_healthy_window(zoo: dict[str, Path], tmp_path: Path) -> None:
    run = zoo["healthy"]
    r = invoke(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "40",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
        "--json",
    )
    assert r.exit_code == 0, r.output
    import json

    doc = json.loads(r.stdout)
    assert doc["verdict"]["causes"][0]["cause"] == "none"
    assert doc["verdict"]["reproducible"] is True
    rep = doc["replay"]
    assert [s["step"] for s in rep["steps"]] == list(range(31, 41))
    # Replayed losses are the logged ones: the reconstruction is faithful.
    for s in rep["steps"]:
        assert abs(s["loss"] - rep["logged"][str(s["step"])]["loss"]) < 1e-4
    assert rep["config"]["clip"] == {"value": 1.0, "source": "checkpoint config grad_clip"}


def test_a_batch_the_run_did_not_train_on_is_refused_by_its_own_log(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """Another run's batch, replayed on the HF run's step 31 (model from config.json), gives
    a loss its trainer_state.json does not have: one line, exit 2; with --allow-mismatch the
    report comes from the checkpoint alone, nothing the replay measured in it."""
    import h5py

    with h5py.File(zoo["healthy"] / "batches.h5") as h:
        torch.save({"input_ids": torch.from_numpy(h["input_ids"][30])}, tmp_path / "b.pt")
    args = [
        "replay",
        "--run-dir",
        str(zoo["hf-trainer"]),
        "--before",
        "30",
        "--batch",
        str(tmp_path / "b.pt"),
    ]
    r = invoke(*args)
    assert_bad_input(
        r, "the replay does not reproduce the run's own log on its first checked step (loss"
    )
    assert "likeliest: the batches (data, order, collator) or the model" in r.stderr
    r = invoke(*args, "--allow-mismatch", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    v = doc["verdict"]
    assert v["replay_check"]["status"] == "missed_first"
    assert (
        v["first_bad_step"],
        v["first_anomalous_module"],
        v["reproducible"],
        v["anomalous_samples"],
    ) == (None, None, None, [])
    assert {f["kind"] for f in doc["findings"]} <= {
        "replay_withheld",
        "weights_only",
        "lr_above_schedule",
    } and "replay_withheld" in {f["kind"] for f in doc["findings"]}
    assert set(doc["replay"]) == {"config", "precision", "check", "variants", "withheld"}
    assert doc["replay"]["config"]["model"]["source"] == "checkpoint config.json"
    assert doc["replay"]["check"]["first_miss"] == 31


def test_batch_out_of_vocabulary(zoo: dict[str, Path], tmp_path: Path) -> None:
    torch.save({"input_ids": torch.full((2, 8), 999)}, tmp_path / "b.pt")
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "30",
        "--model",
        MODEL,
        "--batch",
        str(tmp_path / "b.pt"),
    )
    assert_bad_input(r, "token id 999 outside the model's vocabulary of 64")


def test_model_that_does_not_match(zoo: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("import torch\n\ndef f():\n    return torch.nn.Linear(3, 3)\n")
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "30",
        "--model",
        f"{tmp_path}/m.py:f",
        "--batch",
        str(zoo["healthy"] / "batches.h5"),
    )
    assert_bad_input(r, "--model does not match")
    # The first mismatches are listed: what the model lacks and what it has extra.
    assert (
        "missing in the checkpoint (first:" in r.stderr
        and "not in the model (first: ['transformer." in r.stderr
    )


def test_step_missing_from_batch_log(zoo: dict[str, Path]) -> None:
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "60",
        "--model",
        MODEL,
        "--batch",
        str(zoo["healthy"] / "batches.h5"),
    )
    assert_bad_input(r, "no batch for step 61 (steps 1..60)")


def test_factory_that_fails_to_import(zoo: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    r = invoke(
        "replay",
        "--run-dir",
        str(zoo["healthy"]),
        "--before",
        "30",
        "--model",
        f"{tmp_path}/broken.py:f",
        "--batch",
        str(zoo["healthy"] / "batches.h5"),
    )
    assert_bad_input(r, "import failed (ModuleNotFoundError")


def test_weights_only_checkpoint_cannot_be_replayed(zoo: dict[str, Path]) -> None:
    run = zoo["healthy-safetensors"]
    r = invoke(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--model",
        MODEL,
        "--batch",
        str(run / "batches.h5"),
    )
    assert_bad_input(r, "no optimizer state")


def test_one_replayed_step_names_a_stale_second_moment(zoo: dict[str, Path]) -> None:
    """No *after*, one step: RMS_t (the gradient against Adam's second moment before the
    step) finds the gated layer of adam_instability on its own."""
    run = zoo["adam_instability"]
    t = truth(run)
    r = invoke(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "32",
        "--step",
        str(t["first_bad_step"]),
        "--model",
        "fixtures/tinygpt.py:factory",
        "--batch",
        str(run / "batches.h5"),
        "--json",
    )
    assert r.exit_code == 0, r.output
    v = json.loads(r.stdout)["verdict"]
    assert v["causes"][0]["cause"] == "adam_instability"
    assert v["first_bad_step"] == t["first_bad_step"] and v["first_anomalous_module"] in t["layers"]


def test_param_grad_stats_match_their_definitions() -> None:
    """RMS_t against the bias-corrected second moment, and SPAM's g^2 > 5000 v count."""
    from ckptforensics.engine.replay.probes import param_grad_stats

    g = torch.Generator().manual_seed(0)
    v = torch.rand(1000, generator=g) * 1e-6 + 1e-8
    grad = torch.randn(1000, generator=g) * v.sqrt()
    grad[[3, 77]] = 100 * v[[3, 77]].sqrt()  # two elements far past their second moment
    state, group = {"exp_avg_sq": v, "step": torch.tensor(7.0)}, {"betas": (0.9, 0.95), "eps": 1e-8}
    rms, rms_t, spikes = param_grad_stats(grad, state, group).tolist()
    vhat = v / (1 - 0.95**7)
    assert rms == pytest.approx(float(grad.pow(2).mean().sqrt()), rel=1e-5)
    assert rms_t == pytest.approx(float((grad.pow(2) / (vhat + 1e-16)).mean().sqrt()), rel=1e-4)
    assert spikes == 2
    assert torch.equal(grad[[3, 77]], 100 * v[[3, 77]].sqrt())  # the gradient itself is untouched


def test_window_row_stats_match_one_call_per_batch() -> None:
    import numpy as np

    from ckptforensics.engine.replay.samples import window_row_stats

    rng = np.random.default_rng(0)
    for vocab in (5, 40, 400):
        window = [rng.integers(0, vocab, (b, t)) for b, t in ((3, 16), (4, 16), (0, 16), (2, 9))]
        want = [
            row_data_stats(
                ids,
                np.concatenate(
                    [w.ravel() for j, w in enumerate(window) if j != k] or [np.zeros(0, int)]
                ),
            )
            for k, ids in enumerate(window)
        ]
        assert window_row_stats(window) == want
