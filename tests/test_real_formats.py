"""What real trainers write (issue: every format backed by files the framework wrote).

Runs written in the test session by the framework itself (transformers' Trainer with a
tied GPT-2, Lightning with name-filtered param groups), plus files that a framework that
cannot be installed in CI wrote once, committed under `fixtures/data/` beside the script
that wrote them. Each test checks what the tool read against what the framework recorded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import open_checkpoint, open_pair
from ckptforensics.cli import cli
from ckptforensics.core.errors import OptimizerMappingError
from ckptforensics.formats.optstate import AmbiguousMapping, map_optimizer, settle_by_evidence
from ckptforensics.formats.torchfile import load_torch_file
from tests.conftest import megatron_dist_name
from tests.test_cli import assert_bad_input


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


# ------------------------------------------------------------------ HF GPT-2, tied head
def test_hf_gpt2_tied_head_replays_without_model(zoo: dict[str, Path], tmp_path: Path) -> None:
    run = zoo["hf-gpt2"]
    ck = open_checkpoint(run / "checkpoint-20")
    assert "lm_head.weight" not in ck.names()  # HF never stores the tied head
    assert ck.optimizer is not None and set(ck.optimizer.state) == set(ck.names())
    r = invoke(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "20",
        "--after",
        "30",
        "--batch",
        str(run / "batches.h5"),
        "--out",
        str(tmp_path / "rep"),
    )
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())["replay"]
    assert rep["config"]["model"]["value"].startswith("transformers from config.json")
    assert [s["step"] for s in rep["steps"]] == list(range(21, 31))
    # GPT-2's loss_type is None, so the Trainer counts num_items_in_batch over the unshifted
    # labels: its logged loss is (T-1)/T of the mean, and the replay divides the same way.
    assert (
        "before the shift" in rep["config"]["loss"]["value"]
        and rep["config"]["loss"]["source"] == "the run's trainer"
    )
    assert rep["config"]["clip"] == {
        "value": 1.0,
        "source": "checkpoint config grad_clip",
    }  # training_args.bin
    logged = {int(k): v["loss"] for k, v in rep["logged"].items()}
    assert [s["loss"] for s in rep["steps"]] == pytest.approx(
        [logged[s["step"]] for s in rep["steps"]], rel=1e-5
    )
    assert rep["reproduction"]["mismatched"] == 0


def test_hf_padded_rows_with_gradient_accumulation_reproduce(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """Rows of 10-32 tokens padded with -100 labels and attention mask 0, two micro-batches
    per step: the replay divides by the Trainer's num_items_in_batch (labels[..., 1:] over
    both micro-batches), takes the clip from training_args.bin, and lands on step 30."""
    run = zoo["hf-padded"]
    ck = open_checkpoint(run / "checkpoint-20")
    tc = ck.scalars["train_config"]
    assert (
        tc["max_grad_norm"] == 1.0
        and tc["gradient_accumulation_steps"] == 2
        and tc["per_device_train_batch_size"] == 4
    )
    out = tmp_path / "rep"
    r = invoke(
        "replay",
        "--run-dir",
        str(run),
        "--before",
        "20",
        "--after",
        "30",
        "--batch",
        str(run / "batches.h5"),
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    rep = doc["replay"]
    assert "labels[..., 1:]" in rep["config"]["loss"]["value"]
    logged = {int(k): v["loss"] for k, v in rep["logged"].items()}
    assert [s["loss"] for s in rep["steps"]] == pytest.approx(
        [logged[s["step"]] for s in rep["steps"]], rel=1e-5
    )
    assert rep["reproduction"]["mismatched"] == 0
    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]


def test_hostile_training_args_is_refused_and_the_rest_read(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    canary = tmp_path / "ran"
    ck = tmp_path / "checkpoint-20"
    shutil.copytree(zoo["hf-padded"] / "checkpoint-20", ck)
    torch.save({"max_grad_norm": 1.0, "x": _Canary(canary)}, ck / "training_args.bin")
    c = open_checkpoint(ck)
    assert any("training_args.bin not read" in n and "refused" in n for n in c.notes)
    assert c.optimizer is not None and not canary.exists()


# ------------------------------------------------------------------ Lightning groups
def _lightning(zoo: dict[str, Path], step: int) -> Path:
    return zoo["lightning"] / f"epoch=0-step={step}.ckpt"


def test_lightning_name_filtered_groups_map_every_id(zoo: dict[str, Path]) -> None:
    """Three groups whose members interleave in model order (decay, no-decay, embedding
    with its own LR): every id maps to its parameter, shape-checked, with its group's LR."""
    raw = torch.load(_lightning(zoo, 30), weights_only=True)
    ck = open_checkpoint(_lightning(zoo, 30))
    opt = ck.optimizer
    assert opt is not None and opt.kind == "adam" and len(opt.groups) == 3
    assert [len(g["params"]) for g in raw["optimizer_states"][0]["param_groups"]] == [9, 18, 1]
    for name, st in opt.state.items():
        assert tuple(st["exp_avg"].shape) == ck.meta(name).shape, name
        assert int(st["step"]) == 30
    assert opt.hyper["model.transformer.wte.weight"].lr == pytest.approx(1.5e-3)
    assert opt.hyper["model.transformer.wte.weight"].index == 2
    assert opt.hyper["model.transformer.h.0.ln_1.weight"].weight_decay == 0.0
    assert opt.hyper["model.transformer.h.1.mlp.c_fc.weight"].weight_decay == pytest.approx(0.1)


def _regrouped(
    osd: dict, params: list[tuple[str, tuple[int, ...]]], rng: random.Random
) -> tuple[dict, dict[int, str]]:
    """The real state under a random name-filter-like grouping (each group in model order)."""
    by_name = dict(zip([n for n, _ in params], range(len(params)), strict=True))
    k = rng.randint(2, 5)
    owner = [rng.randrange(k) for _ in params]
    groups, state, truth, nid = [], {}, {}, 0
    for g in range(k):
        ids = []
        for i, (name, _) in enumerate(params):
            if owner[i] == g:
                state[nid] = osd["state"][by_name[name]]
                truth[nid] = name
                ids.append(nid)
                nid += 1
        if ids:
            groups.append(
                {"params": ids, "lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
            )
    return {"state": state, "param_groups": groups}, truth


def _model_order_state(ck) -> tuple[list[tuple[str, tuple[int, ...]]], dict]:
    names = [
        n for n in ck.names() if n in ck.optimizer.state
    ]  # model order, as the state_dict lists them
    return [(n, ck.meta(n).shape) for n in names], {
        "state": {i: ck.optimizer.state[n] for i, n in enumerate(names)}
    }


def _ambiguous_seed(params: list, osd: dict, settles=None) -> int:
    """The first random layout that is ambiguous (and that `settles`, when given, settles)."""
    for seed in range(100):
        grouped, _ = _regrouped(osd, params, random.Random(seed))
        try:
            map_optimizer(grouped, params, "x")
        except AmbiguousMapping as e:
            if settles is None:
                return seed
            try:
                settles(e.pending, grouped, seed)
                return seed
            except OptimizerMappingError:
                continue
    raise AssertionError("no random layout is ambiguous")


def test_random_group_layouts_are_settled_by_the_pairs_updates(zoo: dict[str, Path]) -> None:
    """Random groupings of the real Lightning pair's state (each group in model order):
    same-shaped tensors of different layers leave several assignments; the pair's Δw
    against -m/(sqrt(v)+eps) gives the true one or a refusal that names the tensors,
    never a wrong mapping."""
    a, b = open_checkpoint(_lightning(zoo, 20)), open_checkpoint(_lightning(zoo, 30))
    params, osd_b = _model_order_state(b)
    _, osd_a = _model_order_state(a)

    def delta(n: str) -> torch.Tensor:
        return b.tensor(n).double() - a.tensor(n).double()

    outcomes = {"unique": 0, "settled": 0, "refused": 0}
    for seed in range(24):
        grouped_b, truth = _regrouped(osd_b, params, random.Random(seed))
        grouped_a, _ = _regrouped(osd_a, params, random.Random(seed))
        try:
            view = map_optimizer(grouped_b, params, "regrouped")
            got = {
                pid: next(n for n, st in view.state.items() if st is grouped_b["state"][pid])
                for pid in truth
            }
            outcomes["unique"] += 1
        except AmbiguousMapping as e:
            try:
                got, label = settle_by_evidence(e.pending, delta, grouped_b, grouped_a)
            except OptimizerMappingError as refused:
                assert "do not settle it" in str(refused)
                outcomes["refused"] += 1
                continue
            assert "settled by the pair's updates" in label
            outcomes["settled"] += 1
        assert got == truth, seed
    assert outcomes["settled"] >= 8, outcomes


def test_still_ambiguous_mapping_names_the_tensors(zoo: dict[str, Path]) -> None:
    """Without updates to tell them apart (no weight change) the mapping is refused,
    naming the ambiguous tensors, never guessed."""
    ck = open_checkpoint(_lightning(zoo, 20))
    params, osd = _model_order_state(ck)
    grouped, _ = _regrouped(osd, params, random.Random(_ambiguous_seed(params, osd)))
    with pytest.raises(AmbiguousMapping) as err:
        map_optimizer(grouped, params, "optimizer_states[0]")
    with pytest.raises(OptimizerMappingError, match="do not settle it") as err2:
        settle_by_evidence(err.value.pending, lambda n: torch.zeros(ck.meta(n).shape), grouped)
    assert "transformer" in str(err2.value)


def test_pair_settles_ambiguous_ids_end_to_end(zoo: dict[str, Path], tmp_path: Path) -> None:
    """Real Lightning checkpoints saved under an ambiguous grouping: alone, `inspect` says
    the ids are ambiguous; `diff` and `replay` settle them from the pair and run."""
    cks = [open_checkpoint(_lightning(zoo, s)) for s in (20, 30)]
    params, osd = _model_order_state(cks[1])
    _, osd_a = _model_order_state(cks[0])

    def settles(pending, grouped: dict, seed: int) -> None:
        before, _ = _regrouped(osd_a, params, random.Random(seed))
        settle_by_evidence(
            pending,
            lambda n: cks[1].tensor(n).double() - cks[0].tensor(n).double(),
            grouped,
            before,
        )

    seed = _ambiguous_seed(params, osd, settles)
    paths = []
    for step, ck in zip((20, 30), cks, strict=True):
        obj = torch.load(_lightning(zoo, step), weights_only=True)
        _, own = _model_order_state(ck)
        grouped, truth = _regrouped(own, params, random.Random(seed))
        obj["optimizer_states"][0] = grouped
        p = tmp_path / f"epoch=0-step={step}.ckpt"
        torch.save(obj, p)
        paths.append(p)
    r = invoke("inspect", str(paths[0]))
    assert r.exit_code == 0 and "map ambiguously" in r.output, r.output
    a, b = open_pair(*paths)
    for ck, ref in zip((a, b), cks, strict=True):
        assert "settled by the pair's updates" in ck.optimizer.mapping
        for n, st in ck.optimizer.state.items():
            assert torch.equal(st["exp_avg"], ref.optimizer.state[n]["exp_avg"]), n
    r = invoke("diff", "--before", str(paths[0]), "--after", str(paths[1]), "--json")
    assert r.exit_code == 0, r.output
    r = invoke(
        "replay",
        "--before",
        str(paths[0]),
        "--model",
        "fixtures/tinygpt.py:from_hparams",
        "--batch",
        str(zoo["lightning"] / "batches.h5"),
    )
    assert_bad_input(r, "pass --after so the pair's updates settle the mapping")


def test_factory_gets_the_hyper_parameters_its_signature_accepts(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """A factory forwarding **kwargs to its config class refuses Lightning's `lr`: dropped,
    and replay.config says what was passed and what refused."""
    run = zoo["lightning"]
    r = invoke(
        "replay", "--before", str(_lightning(zoo, 20)), "--after", str(_lightning(zoo, 30)),
        "--model", "fixtures/tinygpt.py:from_hparams", "--batch", str(run / "batches.h5"), "--out", str(tmp_path / "rep"),
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())["replay"]
    model = rep["config"]["model"]["value"]
    assert "n_layer=2" in model and "n_embd=32" in model and "refused by the factory: lr" in model
    assert rep["reproduction"]["mismatched"] == 0  # the replay lands on after


# ------------------------------------------------------------------ step dir with one file
def test_step_dir_holding_one_checkpoint_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    """`step_N/ckpt.pt` (a nanoGPT dict inside a step directory) is read, and a run dir of them lists its steps."""
    run = tmp_path / "run"
    for s in (20, 30):
        (run / f"step_{s}").mkdir(parents=True)
        shutil.copy(zoo["healthy"] / f"step_{s}.pt", run / f"step_{s}" / "ckpt.pt")
    r = invoke("inspect", "--run-dir", str(run), "30", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["step"] == 30
    r = invoke("diff", "--run-dir", str(run), "--before", "20", "--after", "30", "--json")
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------ numpy is data
def test_numpy_rng_state_is_data(tmp_path: Path) -> None:
    """np.random.get_state() (uint32 array, dtype, scalars), as every Megatron save holds."""
    f = tmp_path / "rng.pt"
    torch.save(
        {
            "rng_state": [
                {
                    "np_rng_state": np.random.get_state(),
                    "x": np.float64(2.5),
                    "a": np.arange(4, dtype=np.int16),
                }
            ]
        },
        f,
    )
    obj, _ = load_torch_file(f)
    st = obj["rng_state"][0]["np_rng_state"]
    assert st[0] == "MT19937" and st[1].dtype == np.uint32 and st[1].shape == (624,)
    assert float(obj["rng_state"][0]["x"]) == 2.5


@pytest.mark.parametrize("payload", ["object array", "structured object"])
def test_numpy_object_arrays_are_refused(tmp_path: Path, payload: str) -> None:
    """An object array holds more pickle, not data: refused, and the canary proves nothing ran."""
    canary = tmp_path / "ran"

    class Evil:
        def __reduce__(self):  # noqa: ANN204 - a hostile pickle
            return (os.system, (f"touch {canary}",))

    arr = (
        np.array([1, Evil()], dtype=object)
        if payload == "object array"
        else np.array([(Evil(),)], dtype=[("a", "O")])
    )
    f = tmp_path / "model_optim_rng.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "rng_state": arr}, f)
    r = invoke("inspect", str(f))
    assert_bad_input(r, "refused to unpickle")
    assert not canary.exists()


# ------------------------------------------------------------------ files frameworks wrote once
DATA = Path(__file__).resolve().parent.parent / "fixtures" / "data"


def _sums(t: torch.Tensor) -> tuple[float, float]:
    t = t.double()
    return float(t.sum()), float(t.abs().sum())


def _assert_matches_truth(ck, want: dict, name_of=lambda n: n) -> None:
    """Every parameter the framework recorded: shape, weights, moments, Adam step, its group's LR."""
    opt = ck.optimizer
    assert opt is not None and opt.kind == "adam"
    for fqn, p in want.items():
        name = name_of(fqn)
        assert ck.meta(name).shape == tuple(p["shape"]), name
        assert _sums(ck.tensor(name)) == pytest.approx(
            (p["param"]["sum"], p["param"]["abs_sum"]), rel=1e-9, abs=1e-12
        ), name
        st = opt.state[name]
        for field in ("exp_avg", "exp_avg_sq"):
            assert tuple(st[field].shape) == tuple(p["shape"]), (name, field)
            assert _sums(st[field]) == pytest.approx(
                (p[field]["sum"], p[field]["abs_sum"]), rel=1e-9, abs=1e-15
            ), (name, field)
        assert float(st["step"]) == p["step"], name
        h = opt.hyper[name]
        assert h.lr == pytest.approx(p["lr"], rel=1e-12) and h.weight_decay == pytest.approx(
            p["weight_decay"]
        ), name
        if p.get("betas"):
            assert h.betas == pytest.approx(tuple(p["betas"]))


OLMO = DATA / "olmo-core-3.0"


@pytest.mark.parametrize("step", ["0", "10", "20", "30"])
def test_olmo_core_checkpoint_matches_what_olmo_core_recorded(step: str) -> None:
    """OLMo-core 3.0's own Trainer wrote it: its `.metadata` pickles OLMo's `_StorageInfo`
    (read by its fields, never imported), param groups are flattened per parameter, and
    Adam's step runs one ahead of the trainer's (the step-0 save initialises Adam)."""
    want = json.loads((OLMO / "truth.json").read_text())["checkpoints"][step]
    ck = open_checkpoint(OLMO / "run" / f"step{step}")
    assert ck.format == "dcp" and ck.step == want["global_step"]
    assert sorted(ck.names()) == sorted(want["params"])
    _assert_matches_truth(ck, want["params"])
    groups = {frozenset(g["params"]) for g in want["param_groups"]}
    got = {}
    for n, h in ck.optimizer.hyper.items():
        got.setdefault(h.index, set()).add(n)
    assert {frozenset(v) for v in got.values()} == groups
    if step != "0":
        assert any("one ahead of the trainer's" in n for n in ck.notes)


def test_olmo_core_healthy_pair_raises_no_alarm(tmp_path: Path) -> None:
    r = invoke("diff", "--run-dir", str(OLMO / "run"), "--before", "10", "--after", "20", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["verdict"]["causes"][0]["cause"] == "none", doc["verdict"]


def test_olmo_core_replays_onto_after_with_the_reference_model(tmp_path: Path) -> None:
    """No --model: the reference OLMo-core Transformer is built from the experiment's
    config.json (reordered-norm blocks, QK-norm, RoPE theta 5e5, three param groups).
    Each replayed step's loss is OLMo-core's own and the window lands on step 20; the
    config's clip is used and SkipStepAdamW's skipping is said."""
    truth = json.loads((OLMO / "truth.json").read_text())["steps"]
    out = tmp_path / "rep"
    r = invoke(
        "replay",
        "--run-dir",
        str(OLMO / "run"),
        "--before",
        "10",
        "--after",
        "20",
        "--batch",
        str(OLMO / "batches.h5"),
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    rep = doc["replay"]
    assert rep["config"]["model"]["value"].startswith(
        "reference OLMo-core Transformer from config.json (reordered_norm"
    )
    assert rep["config"]["clip"] == {"value": 1.0, "source": "checkpoint config grad_clip"}
    want = truth[10:20] if isinstance(truth, list) else [truth[str(i)] for i in range(11, 21)]
    assert [s["loss"] for s in rep["steps"]] == pytest.approx([w["loss"] for w in want], rel=1e-5)
    assert rep["reproduction"]["mismatched"] == 0
    assert doc["verdict"]["causes"][0]["cause"] == "none"
    assert any("SkipStepAdamW" in n for n in open_checkpoint(OLMO / "run" / "step10").notes)


class _Canary:
    """A pickle that would touch a file if it ever ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - a hostile pickle
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("where", ["model_and_optim/.metadata", "train/rank0.pt"])
def test_hostile_olmo_core_files_are_refused(tmp_path: Path, where: str) -> None:
    """Any other class in OLMo-core's metadata or train state is refused; nothing runs."""
    import pickle

    canary = tmp_path / "ran"
    ck = tmp_path / "step10"
    shutil.copytree(OLMO / "run" / "step10", ck)
    target = ck / where
    if where.endswith(".metadata"):
        target.write_bytes(pickle.dumps({"state_dict_metadata": _Canary(canary)}))
    else:
        torch.save({"global_step": 10, "rng": _Canary(canary)}, target)
    assert_bad_input(invoke("inspect", str(ck)), "refused to unpickle")
    assert not canary.exists()


LITGPT = DATA / "litgpt-0.5"


@pytest.mark.parametrize("step", [10, 20, 30])
def test_litgpt_step_dir_matches_what_litgpt_recorded(step: int) -> None:
    """`litgpt pretrain` wrote `step-000000NN/lit_model.pth` + its YAML side files: the step
    directory is read as the one checkpoint file it holds, ids map in named_parameters order."""
    want = json.loads((LITGPT / "truth.json").read_text())["checkpoints"][f"step-{step:08d}"]
    ck = open_checkpoint(LITGPT / f"step-{step:08d}")
    assert ck.format == "litgpt" and ck.step == want["step_count"] == step
    assert sorted(ck.names()) == sorted(want["params"])
    params = {n: {**p, "step": p["adam_step"]} for n, p in want["params"].items()}
    _assert_matches_truth(ck, params)
    assert ck.config is not None and ck.config["n_layer"] == 2 and ck.config["n_query_groups"] == 2
    assert ck.scalars["train_config"]["grad_clip"] == 1.0


def test_litgpt_run_dir_lists_its_steps_and_a_healthy_pair_raises_no_alarm() -> None:
    r = invoke("diff", "--run-dir", str(LITGPT), "--before", "10", "--after", "20", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"]["causes"][0]["cause"] == "none"
    r = invoke("inspect", str(LITGPT))
    assert_bad_input(r, "a run directory with checkpoints at steps 10, 20, 30")


def test_hostile_litgpt_checkpoint_is_refused(tmp_path: Path) -> None:
    canary = tmp_path / "ran"
    ck = tmp_path / "step-00000010"
    shutil.copytree(LITGPT / "step-00000010", ck)
    obj = torch.load(ck / "lit_model.pth", weights_only=True)
    obj["train_dataloader"] = _Canary(canary)
    torch.save(obj, ck / "lit_model.pth")
    assert_bad_input(invoke("inspect", str(ck)), "refused to unpickle")
    assert not canary.exists()


def test_litgpt_replay_lands_on_after(tmp_path: Path) -> None:
    """The window 11..20 replayed with litgpt.GPT built from model_config.yaml, on the
    batches LitGPT's loader produced (targets already shifted), lands on step 20 exactly.
    litgpt is not a dev dependency (it pins huggingface_hub below transformers' floor):
    this runs where litgpt is installed, as in the fixture's own venv."""
    pytest.importorskip("litgpt")
    for model in ("fixtures/litgpt_run.py:build_model", None):
        extra = ["--model", model] if model else []
        out = tmp_path / f"rep{len(extra)}"
        r = invoke(
            "replay",
            "--run-dir",
            str(LITGPT),
            "--before",
            "10",
            "--after",
            "20",
            *extra,
            "--batch",
            str(LITGPT / "batches.h5"),
            "--out",
            str(out),
        )
        assert r.exit_code == 0, r.output
        rep = json.loads((out / "report.json").read_text())["replay"]
        assert rep["config"]["clip"] == {"value": 1.0, "source": "checkpoint config grad_clip"}
        assert rep["reproduction"]["mismatched"] == 0
    assert rep["config"]["model"]["value"] == "litgpt.GPT from model_config.yaml"


def test_litgpt_without_litgpt_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "litgpt", None)  # import litgpt -> ImportError
    r = invoke(
        "replay",
        "--run-dir",
        str(LITGPT),
        "--before",
        "10",
        "--after",
        "20",
        "--batch",
        str(LITGPT / "batches.h5"),
    )
    assert_bad_input(r, "needs litgpt")


def test_litgpt_and_olmo_core_logs_are_found_and_keyed_by_the_checkpoints_step() -> None:
    """LitGPT's CSVLogger writes iteration i at logger step i-1 (the `iter` column is the
    checkpoint's step); OLMo-core writes one metrics_step{N}.json per step with its own
    key names. Both are discovered in the run directory and read at the right step."""
    from ckptforensics.engine.triage import find_metrics, read_metrics

    log = find_metrics(LITGPT)
    assert log is not None and log.name == "metrics.csv"
    rows = read_metrics(log)
    for rec in json.loads((LITGPT / "truth.json").read_text())["log"]:
        assert rows[rec["step"]]["loss"] == pytest.approx(rec["loss"], rel=1e-9)
    log = find_metrics(OLMO / "run")
    assert log is not None and log.name.startswith("metrics_step")
    rows = read_metrics(log)
    truth = json.loads((OLMO / "truth.json").read_text())["steps"]
    want = truth if isinstance(truth, list) else list(truth.values())
    for rec in want:
        assert rows[rec["step"]]["loss"] == pytest.approx(rec["loss"], rel=1e-6)
        assert rows[rec["step"]]["grad_norm"] == pytest.approx(rec["grad_norm"], rel=1e-6)


MCORE = DATA / "megatron-core-0.19"


@pytest.mark.parametrize("variant", ["plain", "distopt", "legacy"])
def test_megatron_core_replays_onto_after_with_the_reference_model(
    variant: str, tmp_path: Path
) -> None:
    """No --model: the reference Megatron GPT is built from the checkpoint's `args` (GQA,
    RoPE, RMSNorm, SwiGLU, untied head; TE norm names in torch_dist, local ones in legacy).
    Its first step's loss is megatron-core's own, and the window lands on iteration 20."""
    steps = json.loads((MCORE / "truth.json").read_text())["variants"][variant]["steps"]
    out = tmp_path / "rep"
    r = invoke(
        "replay",
        "--run-dir",
        str(MCORE / variant),
        "--before",
        "10",
        "--after",
        "20",
        "--batch",
        str(MCORE / "batches.h5"),
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())["replay"]
    assert rep["config"]["model"]["value"].startswith(
        "reference Megatron GPT from the checkpoint's args"
    )
    assert rep["config"]["clip"]["value"] == 1.0
    assert rep["steps"][0]["loss"] == pytest.approx(steps[10]["loss"], rel=1e-5)
    assert rep["steps"][0]["grad_norm"] == pytest.approx(steps[10]["grad_norm"], rel=1e-4)
    assert rep["reproduction"]["mismatched"] == 0 and rep["reproduction"]["tensors"] == 45


def test_a_megatron_batch_log_that_says_nothing_of_its_labels_replays_the_same(
    tmp_path: Path,
) -> None:
    """Megatron hands the model next-token targets; a batch log a user writes from its loop
    carries no attribute saying so. The replay measures it from the data (it used to shift
    the labels again: step 11's loss then was another task's) and lands on iteration 20; its
    steps are checked against the loss megatron-core logged."""
    import shutil

    import h5py

    log = tmp_path / "batches.h5"
    shutil.copy(MCORE / "batches.h5", log)
    with h5py.File(log, "a") as h:
        del h.attrs["labels_shifted"]
    truth_steps = json.loads((MCORE / "truth.json").read_text())["variants"]["plain"]["steps"]
    metrics = tmp_path / "log.jsonl"
    metrics.write_text(
        "".join(
            json.dumps({"step": st["step"], "loss": st["loss"], "grad_norm": st["grad_norm"]})
            + "\n"
            for st in truth_steps
        )
    )
    out = tmp_path / "rep"
    r = invoke(
        "replay",
        "--run-dir",
        str(MCORE / "plain"),
        "--before",
        "10",
        "--after",
        "20",
        "--batch",
        str(log),
        "--metrics",
        str(metrics),
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    rep = doc["replay"]
    assert rep["config"]["labels"]["value"].startswith("next-token targets") and rep["config"][
        "labels"
    ]["source"].startswith("measured")
    assert (
        rep["reproduction"]["mismatched"] == 0
        and doc["verdict"]["replay_check"]["status"] == "matched"
    )
    assert rep["check"]["checked_steps"] == list(range(11, 21))


def test_megatron_option_the_reference_lacks_is_refused_by_name() -> None:
    from ckptforensics.engine.replay.model import ModelSpecError, build_model

    ck = open_checkpoint(MCORE / "legacy" / "iter_0000010")
    ck.config = {**(ck.config or {}), "num_experts": 8}
    with pytest.raises(ModelSpecError, match="does not implement mixture of experts; pass --model"):
        build_model(None, ck)


@pytest.mark.parametrize(
    "variant", ["plain", "distopt", "legacy", "bf16-plain", "bf16-distopt", "bf16-legacy"]
)
@pytest.mark.parametrize("it", ["10", "20"])
def test_megatron_core_checkpoint_matches_what_megatron_recorded(variant: str, it: str) -> None:
    """megatron-core 0.19 + Megatron-LM's save_checkpoint wrote these: torch_dist without
    common.pt (its common state and a SavePlan in `.metadata`), the distributed optimizer's
    dp_reshardable buckets, and the legacy file with numpy RNG state and enums in `args`.
    Under --bf16 the weights read are the optimizer's fp32 main params (truth's `param`)."""
    want = json.loads((MCORE / "truth.json").read_text())["variants"][variant]["saves"][it]
    ck = open_checkpoint(MCORE / variant / f"iter_{int(it):07d}")
    assert ck.step == want["iteration"]
    rename = (lambda n: n) if variant.endswith("legacy") else megatron_dist_name
    assert sorted(ck.names()) == sorted(rename(n) for n in want["params"])
    _assert_matches_truth(ck, want["params"], rename)


@pytest.mark.parametrize("variant", ["bf16-plain", "bf16-distopt", "bf16-legacy"])
def test_megatron_bf16_weights_are_the_fp32_main_params_the_model_rounds(variant: str) -> None:
    """A --bf16 run keeps bf16 weights in the model and fp32 main params in the optimizer
    (`fp32_from_fp16_params`; torch_dist `optimizer.state.fp32_param.*`; the distributed
    optimizer's bucket `param`). The main params are read as the weights, in fp32, and the
    model's own bf16 weights are their rounding, as megatron-core's live objects were."""
    want = json.loads((MCORE / "truth.json").read_text())["variants"][variant]["saves"]["10"][
        "params"
    ]
    ck = open_checkpoint(MCORE / variant / "iter_0000010")
    rename = (lambda n: n) if variant.endswith("legacy") else megatron_dist_name
    assert ck.scalars["fp32_masters"] is True
    assert any("fp32 main params" in n for n in ck.notes)
    policy = ck.scalars["train_config"]["megatron_precision"]
    assert policy["bf16"] is True and policy["main_params_dtype"] == "torch.float32"
    assert policy["accumulate_allreduce_grads_in_fp32"] is True
    assert policy["use_distributed_optimizer"] is (variant == "bf16-distopt")
    for fqn, p in want.items():
        w = ck.tensor(rename(fqn))
        assert w.dtype == torch.float32 and p["model_dtype"] == "torch.bfloat16"
        assert _sums(w.bfloat16()) == pytest.approx(
            (p["model_param"]["sum"], p["model_param"]["abs_sum"]), rel=1e-9, abs=1e-12
        ), fqn
        assert float((w != w.bfloat16().float()).float().mean()) > 0.99, (
            fqn
        )  # fp32 values, not bf16 ones


@pytest.mark.parametrize("variant", ["bf16-plain", "bf16-distopt", "bf16-legacy"])
def test_megatron_bf16_run_replays_in_its_own_precision_onto_after(
    variant: str, tmp_path: Path
) -> None:
    """megatron-core --bf16 (bf16 params computed on, each micro-batch's bf16 gradient summed
    in fp32, an fp32 optimizer stepping fp32 main params copied back to bf16): the replay reads
    the policy from the run's args, says so, starts from the main params, matches every loss
    and grad norm megatron-core logged, and lands on iteration 20's main params within the
    tolerance it states for bf16 compute. Measured here: losses within 1.2e-7, grad norms
    within 1e-5, the worst element at 0.13 of its tolerance; started from the bf16 weights
    instead, 890 of 68064 elements miss (up to 50x the weight tolerance), and one backward
    over the whole batch instead of per micro-batch puts grad norms 2e-4 off."""
    steps = json.loads((MCORE / "truth.json").read_text())["variants"][variant]["steps"]
    metrics = tmp_path / "log.jsonl"
    metrics.write_text(
        "".join(
            json.dumps({"step": s["step"], "loss": s["loss"], "grad_norm": s["grad_norm"]}) + "\n"
            for s in steps
        )
    )
    out = tmp_path / "rep"
    r = invoke(
        "replay",
        "--run-dir",
        str(MCORE / variant),
        "--before",
        "10",
        "--after",
        "20",
        "--batch",
        str(MCORE / "batches.h5"),
        "--metrics",
        str(metrics),
        "--out",
        str(out),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "report.json").read_text())
    rep = doc["replay"]
    prec = rep["config"]["precision"]
    assert prec["value"] == "bf16-params"
    assert (
        prec["source"].startswith("Megatron args bf16=True")
        and "not modelled" not in prec["source"]
    )
    assert (
        "accumulate_allreduce_grads_in_fp32=True (each micro-batch of micro_batch_size=2 rows"
        in prec["source"]
    )
    assert "main_params_dtype=torch.float32" in prec["source"]
    assert f"use_distributed_optimizer={variant == 'bf16-distopt'}" in prec["source"]
    assert (
        "the weights read (and replayed from) are the optimizer's fp32 main params"
        in prec["source"]
    )
    for got in rep["steps"]:
        logged = steps[got["step"] - 1]
        assert got["loss"] == pytest.approx(logged["loss"], rel=1e-5), got["step"]
        assert got["grad_norm"] == pytest.approx(logged["grad_norm"], rel=2e-4), got["step"]
    assert (
        rep["check"]["checked_steps"] == list(range(11, 21)) and rep["check"]["first_miss"] is None
    )
    assert (
        doc["verdict"]["replay_check"]["status"] == "matched"
        and doc["verdict"]["reproducible"] is True
    )
    repro = rep["reproduction"]
    assert repro["tensors"] == 45 and repro["mismatched"] == 0 and repro["impossible"] == 0
    assert repro["worst"]["deviation_over_tolerance"] < 0.5
    assert (
        "bf16-params" in repro["tolerance"]["moments"]
        and repro["tolerance"]["source"] == "docs/signatures.md#replay-precision"
    )


def test_megatron_distributed_optimizer_unflattens_to_the_plain_run() -> None:
    """The buckets' fp32 `param` slices are the model's weights bit for bit (the layout is
    right), and the moments equal the same run saved with the plain optimizer up to the
    grad-norm summation order (7.5e-9: megatron sums per-tensor norms in buffer order)."""
    from ckptforensics.formats.dcp import DcpStore, read_metadata

    d = MCORE / "distopt" / "iter_0000010"
    dist, plain = open_checkpoint(d), open_checkpoint(MCORE / "plain" / "iter_0000010")
    md = read_metadata(d)
    flat = DcpStore(d, md).tensor(
        next(k for k in md.state_dict_metadata if k.endswith("bucket_idx_0.param"))
    )
    seen = 0
    for name in dist.names():
        st = dist.optimizer.state[name]
        assert set(st) >= {"exp_avg", "exp_avg_sq"}
        for field in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(
                st[field], plain.optimizer.state[name][field], rtol=0, atol=1e-8
            ), (name, field)
            assert torch.isfinite(st[field]).all()  # padding (uninitialised memory) is never read
        w = dist.tensor(name).flatten()
        seen += sum(
            torch.equal(flat[i : i + w.numel()], w)
            for i in range(0, flat.numel() - w.numel() + 1, 32)
        )
    assert seen >= len(dist.names())
    r = invoke(
        "diff", "--run-dir", str(MCORE / "distopt"), "--before", "10", "--after", "20", "--json"
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["verdict"]["causes"][0]["cause"] == "none"


@pytest.mark.parametrize("where", ["legacy", "common_state"])
def test_hostile_megatron_files_are_refused(tmp_path: Path, where: str) -> None:
    canary = tmp_path / "ran"
    if where == "legacy":
        ck = tmp_path / "iter_0000010"
        shutil.copytree(MCORE / "legacy" / "iter_0000010", ck)
        f = ck / "mp_rank_00" / "model_optim_rng.pt"
        real, _ = load_torch_file(f)  # memory-mapped: write the hostile copy beside it
        torch.save(
            {
                "model": real["model"],
                "iteration": 10,
                "rng_state": real["rng_state"],
                "args": _Canary(canary),
            },
            tmp_path / "h.pt",
        )
        del real
        os.replace(tmp_path / "h.pt", f)
    else:
        ck = tmp_path / "iter_0000010"
        shutil.copytree(MCORE / "plain" / "iter_0000010", ck)
        (ck / "common.pt").write_bytes(b"")
        torch.save({"args": _Canary(canary)}, ck / "common.pt")
    assert_bad_input(invoke("inspect", str(ck)), "refused to unpickle")
    assert not canary.exists()


def test_hf_precision_comes_from_training_args(zoo: dict[str, Path]) -> None:
    """A Trainer run with bf16=True keeps fp32 weights: the replay's precision is read from
    training_args.bin, not guessed from the weights."""
    from ckptforensics.engine.replay.records import ReplayConfig
    from ckptforensics.engine.replay.window import run_precision

    ck = open_checkpoint(zoo["hf-padded"] / "checkpoint-20")
    cfg = ReplayConfig(before=ck.path, batch="unused")
    assert run_precision(cfg, ck) == ("fp32", "fp32 weights, no loss scaler")
    ck.scalars["train_config"]["bf16"] = True
    assert run_precision(cfg, ck) == ("bf16", "training_args.bin bf16=True")
