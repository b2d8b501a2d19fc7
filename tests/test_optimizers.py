"""Optimizers beyond AdamW, each from its own package's real runs (fixtures/optim_runs.py),
and the resume that lost training state (fixtures/resume_run.py): what the tool finds
against the truth each fixture planted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.cli import cli
from ckptforensics.commands.diff import run_diff
from ckptforensics.commands.replay import run_replay
from ckptforensics.core.errors import ForensicsError
from ckptforensics.engine.replay.run import ReplayConfig
from fixtures import optim_runs, resume_run

pytest.importorskip("lion_pytorch")
pytest.importorskip("transformers")

# Optimizers from packages the dev extra installs but a bare checkout may lack: their cases
# skip, saying which package, and the rest still run.
_PACKAGES = {"adam8bit": "bitsandbytes", "lamb": "pytorch_optimizer"}


def _have(opt: str) -> bool:
    import importlib.util

    return opt not in _PACKAGES or importlib.util.find_spec(_PACKAGES[opt]) is not None


def _opt(opt: str, *rest: str) -> object:
    """A parameter that skips, naming the package, where the optimizer's package is absent."""
    return pytest.param(
        opt,
        *rest,
        marks=pytest.mark.skipif(
            not _have(opt), reason=f"{opt} needs {_PACKAGES.get(opt)} (pip install -e '.[dev]')"
        ),
    )


# optimizer -> (family of its groups in order, the kind the checkpoint reads as)
EXPECTED = {
    "adamw": ("adam", "adam"),
    "adamw_bf16": ("adam", "adam"),
    "adafactor": ("adafactor", "adafactor"),
    "adafactor_hf": ("adafactor", "adafactor"),
    "lion": ("lion", "lion"),
    "muon": ("muon", "muon+adam"),
    "sgd": ("sgd", "sgd"),
    "adam8bit": ("adam8bit", "adam8bit"),
    "lamb": ("lamb", "lamb"),
}
OPTS = [_opt(o) for o in sorted(EXPECTED)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("optim")
    return {opt: optim_runs.build(root, opt) for opt in optim_runs.OPTIMIZERS if _have(opt)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return resume_run.build(tmp_path_factory.mktemp("resume"))


def _pair(run: Path) -> tuple[Path, Path, dict]:
    t = json.loads((run / "truth.json").read_text())
    return run / f"step_{t['before']}.pt", run / f"step_{t['after']}.pt", t


@pytest.mark.parametrize("opt", OPTS)
def test_family_read_from_the_state_layout(runs: dict[str, dict[str, Path]], opt: str) -> None:
    with open_checkpoint(runs[opt]["healthy"] / "step_30.pt") as ck:
        assert ck.optimizer is not None
        fam, kind = EXPECTED[opt]
        assert ck.optimizer.kind == kind
        assert ck.optimizer.groups[0].family == fam
        # Every trainable tensor is mapped to its own state (shape-verified ids).
        assert set(ck.optimizer.state) == set(ck.names())
    if opt == "adafactor_hf":
        g = ck.optimizer.groups[0]
        assert g.options["implementation"].startswith("transformers") and g.options[
            "eps2"
        ] == pytest.approx(1e-3)


@pytest.mark.parametrize("opt", OPTS)
def test_diff_under_each_optimizer(runs: dict[str, dict[str, Path]], opt: str) -> None:
    """Healthy pair: no alarm; LR spike: lr_too_high; bit flip: the element and the bit."""
    a, b, _ = _pair(runs[opt]["healthy"])
    doc, _ = run_diff(a, b, command="diff")
    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]["summary"]
    a, b, _ = _pair(runs[opt]["lr_spike"])
    doc, _ = run_diff(a, b, command="diff")
    assert doc["verdict"]["causes"][0]["cause"] == "lr_too_high"
    a, b, truth = _pair(runs[opt]["bit_flip"])
    doc, _ = run_diff(a, b, command="diff")
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "silent_corruption"
    hit = v["corrupted_elements"][0]
    assert (hit["tensor"], hit["index"]) == (
        truth["corrupted"]["tensor"],
        truth["corrupted"]["index"],
    )
    assert hit["kind"] == f"bit_flip(exponent bit {truth['corrupted']['bit']})"


@pytest.mark.parametrize("opt", OPTS)
def test_inspect_names_the_family(runs: dict[str, dict[str, Path]], opt: str) -> None:
    res = CliRunner().invoke(cli, ["inspect", str(runs[opt]["healthy"] / "step_30.pt"), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["optimizer"]["kind"] == EXPECTED[opt][1]


@pytest.mark.parametrize(
    ("opt", "kind"),
    [
        ("lion", "lr_spike"),
        ("adafactor_hf", "healthy"),
        ("muon", "bit_flip"),
        _opt("adam8bit", "lr_spike"),
        _opt("adam8bit", "bit_flip"),
        _opt("lamb", "bit_flip"),
    ],
)
def test_replay_rebuilds_the_family(runs: dict[str, dict[str, Path]], opt: str, kind: str) -> None:
    """Replayed with the family's own class: an LR spike's first bad step; a healthy pair that
    reproduces; a flipped element no replay reaches."""
    a, b, truth = _pair(runs[opt][kind])
    run = runs[opt][kind]
    cfg = ReplayConfig(
        before=a, after=b, model="fixtures/tinygpt.py:factory", batch=str(run / "batches.h5")
    )
    doc, _ = run_replay(cfg, command="replay")
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == (truth["cause"] or "none")
    if kind == "lr_spike":
        assert v["first_bad_step"] == truth["first_bad_step"]
    if kind == "healthy":
        assert v["reproducible"] is True
    if kind == "bit_flip" and opt == "adam8bit":
        # No per-element bound through 8-bit state: the flipped element is the one the
        # replay, landing on every other element, does not reproduce.
        assert doc["replay"]["reproduction"]["mismatched"] == 1
    elif kind == "bit_flip":
        assert doc["replay"]["reproduction"]["impossible"] >= 1


@pytest.mark.skipif(not _have("adam8bit"), reason="needs bitsandbytes")
def test_8bit_state_dequantised(runs: dict[str, dict[str, Path]]) -> None:
    """The diff's moments are bitsandbytes' own dequantisation of its codes; tensors under
    min_8bit_size keep fp32 state (Adam's exact bound); the note says what was done."""
    import bitsandbytes.functional as F

    path = runs["adam8bit"]["healthy"] / "step_30.pt"
    with open_checkpoint(path) as ck:
        st = ck.optimizer.state["transformer.h.1.mlp.c_fc.weight"]
        assert st["state2"].dtype == torch.uint8 and st["exp_avg_sq"].dtype == torch.float32
        for i, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
            theirs = F.dequantize_blockwise(
                st[f"state{i}"], absmax=st[f"absmax{i}"], code=st[f"qmap{i}"], blocksize=256
            )
            assert torch.equal(st[key], theirs)
        small = ck.optimizer.state["transformer.h.1.ln_1.weight"]
        assert small["state1"].dtype == torch.float32 and small["exp_avg"] is small["state1"]
        v_max, m_max = float(st["exp_avg_sq"].max()), float(st["exp_avg"].abs().max())
    doc, _ = run_diff(runs["adam8bit"]["healthy"] / "step_20.pt", path, command="diff")
    assert any(
        "8-bit optimizer state: 4 quantised tensors' moments dequantised" in n
        for n in doc["diff"]["pair"]["notes"]
    )
    row = next(t for t in doc["diff"]["tensors"] if t["name"] == "transformer.h.1.mlp.c_fc.weight")
    assert row["has_moments"] and row["family"] == "adam8bit" and row["k"] == 10
    assert row["max_v_b"] == pytest.approx(v_max) and row["max_abs_m_b"] == pytest.approx(m_max)


@pytest.mark.skipif(not _have("adam8bit"), reason="needs bitsandbytes")
def test_8bit_state_flip_located(runs: dict[str, dict[str, Path]]) -> None:
    """Bit 7 of one second-moment code: the element under the floor no 8-bit Adam step can
    cross, explained as that bit of the stored code."""
    a, b, truth = _pair(runs["adam8bit"]["state_flip"])
    doc, _ = run_diff(a, b, command="diff")
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "silent_corruption"
    hit = v["corrupted_elements"][0]
    want = truth["corrupted"]
    assert (hit["tensor"], hit["where"], hit["index"]) == (
        want["tensor"],
        want["where"],
        want["index"],
    )
    assert hit["kind"] == "bit_flip(code bit 7)"


def test_lamb_implementations_one_line(runs: dict[str, dict[str, Path]], tmp_path: Path) -> None:
    """DeepSpeed's FusedLamb and apex's FusedLAMB (CUDA ops, not run here) are read from
    their own group options, the diff holds them to their bounds, the replay says in one
    line it cannot rebuild them; bitsandbytes' AdEMAMix / LAMB8bit is an optimizer the tool
    does not know: named, weights-only."""
    if not _have("lamb"):
        pytest.skip("needs pytorch_optimizer")
    from ckptforensics.engine.replay.optimizer import build_optimizer
    from fixtures.tinygpt import GPT, GPTConfig

    a, b, _ = _pair(runs["lamb"]["healthy"])
    for impl, keep in (
        ("deepspeed", {"bias_correction": True, "max_coeff": 10.0, "min_coeff": 0.01}),
        ("apex", {"bias_correction": True, "grad_averaging": True}),
    ):
        for src in (a, b):
            ck = torch.load(src, weights_only=False)
            for g in ck["optimizer"]["param_groups"]:
                step = g["step"]
                for k in (
                    "weight_decouple",
                    "fixed_decay",
                    "rectify",
                    "adam",
                    "foreach",
                    "max_grad_norm",
                    "grad_averaging",
                    "step",
                ):
                    g.pop(k, None)
                g.update(keep, max_grad_norm=0.0)
                if impl == "apex":
                    g["step"] = step  # apex counts in the group
            for st in ck["optimizer"]["state"].values():
                for k in ("weight_norm", "adam_norm", "trust_ratio"):
                    st.pop(k, None)
                if impl == "deepspeed":
                    st["step"] = step  # DeepSpeed counts per parameter
            torch.save(ck, tmp_path / f"{impl}-{src.name}")
        pa, pb = tmp_path / f"{impl}-{a.name}", tmp_path / f"{impl}-{b.name}"
        with open_checkpoint(pb) as ck:
            assert (
                ck.optimizer.kind == "lamb"
                and impl in ck.optimizer.groups[0].options["implementation"].lower()
            )
            with pytest.raises(ForensicsError, match="needs its CUDA op"):
                build_optimizer(
                    GPT(GPTConfig(**torch.load(pb, weights_only=False)["model_config"])),
                    ck,
                    lambda k: k,
                )
        doc, _ = run_diff(pa, pb, command="diff")
        assert doc["verdict"]["causes"][0]["cause"] == "none", (impl, doc["verdict"]["summary"])


@pytest.mark.parametrize("which", ["adagrad", _opt("adam8bit")])
def test_unknown_optimizer_one_line(tmp_path: Path, which: str) -> None:
    """An optimizer the tool does not know (torch's Adagrad; bitsandbytes' AdEMAMix8bit,
    whose 8-bit state is not Adam's rule): diff compares the weights and names it; replay
    refuses in one line."""
    from fixtures.tinygpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=16))
    if which == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)
    else:
        import bitsandbytes as bnb

        opt = bnb.optim.AdEMAMix8bit(model.parameters(), lr=1e-3, min_8bit_size=16)
    for step in (1, 2):
        ids = torch.randint(0, 60, (4, 16))
        opt.zero_grad()
        model(ids, labels=ids).backward()
        opt.step()
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            tmp_path / f"step_{step}.pt",
        )
    res = CliRunner().invoke(
        cli,
        [
            "diff",
            "--before",
            str(tmp_path / "step_1.pt"),
            "--after",
            str(tmp_path / "step_2.pt"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    named = "sum" if which == "adagrad" else "bitsandbytes"  # Adagrad's state key; bnb's package
    assert any(
        "not one the tool knows" in n and named in n for n in doc["diff"]["pair"]["notes"]
    ), doc["diff"]["pair"]["notes"]
    with open_checkpoint(tmp_path / "step_1.pt") as ck:
        from ckptforensics.engine.replay.optimizer import build_optimizer

        with pytest.raises(ForensicsError, match="cannot be rebuilt for a replay"):
            build_optimizer(model, ck, lambda k: k)


def test_resume_that_lost_state(resumed: dict[str, Path]) -> None:
    """Each lost piece is its own finding with the resume step and the rollback; the
    correct resume raises no alarm."""
    for variant, cause in resume_run.VARIANTS.items():
        if variant == "data_restarted":
            continue  # the weights and state cannot show it: test_data_loader_restart
        a, b, truth = _pair(resumed[variant])
        doc, findings = run_diff(a, b, command="diff")
        v = doc["verdict"]
        assert v["causes"][0]["cause"] == cause, (variant, v["summary"])
        if cause == "none":
            assert not [f for f in findings if f.severity != "info"]
            continue
        assert v["first_bad_step"] == truth["first_bad_step"] == resume_run.RESUME + 1
        assert v["rollback_checkpoint"] == str(a) and a.name == truth["rollback"]
        assert any(
            cause.split("_")[0] in x.lower() or "resume" in x.lower()
            for x in v["recommended_actions"]
        )
    lost = run_diff(*_pair(resumed["optimizer_lost"])[:2], command="diff")[0]["verdict"][
        "recommended_actions"
    ][0]
    for way in ("resume_from_checkpoint", "ckpt_path", "load_optimizer_states", "--no-load-optim"):
        assert way in lost


def test_triage_onset_at_the_resume(resumed: dict[str, Path]) -> None:
    """The log shows a rebuilt scheduler (the LR re-runs its warm-up, or dips to its first
    value for one step): triage's onset is the first step after the resume."""
    from ckptforensics.engine.triage import triage

    for variant in ("scheduler_restarted", "optimizer_lost", "correct"):
        run = resumed[variant]
        res = triage(run / "metrics.jsonl", run)
        want = None if variant == "correct" else resume_run.RESUME + 1
        assert res.first_bad_step == want, (variant, [o.message for o in res.onsets])


def test_resume_lost_optimizer_from_replay(resumed: dict[str, Path]) -> None:
    a, b, truth = _pair(resumed["optimizer_lost"])
    run = resumed["optimizer_lost"]
    cfg = ReplayConfig(
        before=a,
        after=b,
        model="fixtures/tinygpt.py:factory",
        batch=str(run / "batches.h5"),
        precision="fp16",
    )
    doc, _ = run_replay(cfg, command="replay")
    v = doc["verdict"]
    assert v["causes"][0]["cause"] == "optimizer_state_lost"
    assert v["first_bad_step"] == truth["first_bad_step"]
    assert v["rollback_checkpoint"] == str(a)


def test_data_loader_restart(resumed: dict[str, Path]) -> None:
    """The batch log's sample ids repeat from the resume on: the step after it re-reads
    step 1's samples; a correct resume's ids never repeat."""
    import h5py

    from ckptforensics.detectors.resume import detect_data_restart

    def ids(run: Path) -> dict[int, list[int]]:
        with h5py.File(run / "batches.h5", "r") as h:
            return {
                int(s): row.tolist() for s, row in zip(h["step"][:], h["sample_id"][:], strict=True)
            }

    window = list(range(resume_run.RESUME + 1, resume_run.RESUME + 11))
    found = detect_data_restart(ids(resumed["data_restarted"]), window)
    assert [f.kind for f in found] == ["data_loader_restarted"]
    assert (
        found[0].metrics["step"] == resume_run.RESUME + 1 and found[0].metrics["repeats_step"] == 1
    )
    assert detect_data_restart(ids(resumed["correct"]), window) == []


def test_hf_trainer_adafactor(tmp_path_factory: pytest.TempPathFactory) -> None:
    """transformers' Adafactor as the HF Trainer builds it for optim="adafactor" (tuning draw
    1311: a healthy Llama run, checkpoint-N/ directories): its eps pair and lr are read,
    inspect names it, and its healthy window raises no alarm in the diff."""
    from fixtures.draws import build_draw, draw

    assert draw(1311).optimizer == "adafactor" and draw(1311).trainer == "hf"
    run = build_draw(1311, tmp_path_factory.mktemp("hf-adafactor"))
    truth = json.loads((run / "truth.json").read_text())
    a, b = run / f"checkpoint-{truth['before']}", run / f"checkpoint-{truth['after']}"
    with open_checkpoint(b) as ck:
        assert ck.optimizer is not None and ck.optimizer.kind == "adafactor"
        g = ck.optimizer.groups[0]
        assert g.options["implementation"] == "transformers.optimization.Adafactor"
        assert g.options["eps2"] == pytest.approx(1e-3) and g.eps == pytest.approx(1e-30)
        assert not g.options["relative_step"] and g.lr > 0
    res = CliRunner().invoke(cli, ["inspect", str(b), "--json"])
    assert res.exit_code == 0, res.output
    doc, findings = run_diff(a, b, command="diff")
    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]["summary"]
