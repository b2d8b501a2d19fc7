"""Every trainer module satisfies the `Framework` protocol (its required names, and the
optional replay hooks it has, with the protocol's call signatures); `framework_for` picks the
module that wrote a checkpoint (committed fixtures, and views of checkpoints built in place:
nothing trains); the replay asks the trainer modules, not `ck.format`."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from ckptforensics import trainers as frameworks
from ckptforensics.checkpoints import open_checkpoint
from ckptforensics.formats.base import Checkpoint
from ckptforensics.logs.columns import ALIASES, OURS
from ckptforensics.trainers import (
    HOOKS,
    LOG_ORDER,
    PLANNERS,
    Framework,
    Planner,
    framework_for,
    hook,
    planner_for,
)

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "fixtures" / "data"
REQUIRED = ("owns", "settings", "edits", "render", "skip", "resume")


def _params(fn: Any) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("name", PLANNERS)
def test_every_trainer_module_satisfies_the_protocol(name: str) -> None:
    mod = importlib.import_module(f"ckptforensics.trainers.{name}")
    assert name == mod.NAME and isinstance(mod.TITLE, str) and mod.TITLE
    for fn in REQUIRED:
        assert callable(getattr(mod, fn, None)), f"{name} lacks {fn}"
        assert _params(getattr(mod, fn)) == _params(getattr(Planner, fn)), f"{name}.{fn}"
    for fn in HOOKS:
        if hasattr(mod, fn):
            assert _params(getattr(mod, fn)) == _params(getattr(Framework, fn)), f"{name}.{fn}"
    names = getattr(mod, "LOG_NAMES", {})
    assert set(names) <= set(OURS) and all(
        isinstance(v, tuple) and all(isinstance(n, str) for n in v) for v in names.values()
    )
    # A module is the trainer's whole knowledge: every public function is the protocol's.
    public = {
        n
        for n, v in vars(mod).items()
        if inspect.isfunction(v) and v.__module__ == mod.__name__ and not n.startswith("_")
    }
    assert public <= set(REQUIRED) | set(HOOKS), f"{name}: {public - set(REQUIRED) - set(HOOKS)}"


def test_the_protocols_hooks_are_the_documented_ones() -> None:
    declared = {n for n, v in vars(Framework).items() if callable(v) and not n.startswith("_")}
    assert declared == set(HOOKS)
    assert planner_for is framework_for and set(LOG_ORDER) <= set(PLANNERS)
    with pytest.raises(KeyError):
        hook(Checkpoint(path=Path("x"), format="torch"), "no_such_hook")


def _view(path: Path, fmt: str, config: Any = None, **scalars: Any) -> Checkpoint:
    path.mkdir(parents=True, exist_ok=True)
    return Checkpoint(path=path, format=fmt, scalars=dict(scalars), config=config)


@pytest.mark.parametrize(
    "where, name",
    [
        ("megatron-core-0.19/legacy/iter_0000020", "megatron"),
        ("megatron-core-0.19/plain/iter_0000020", "megatron"),
        ("olmo-core-3.0/run/step20", "olmo_core"),
        ("litgpt-0.5/step-00000020/lit_model.pth", "loop"),
    ],
)
def test_framework_for_the_committed_fixtures(where: str, name: str) -> None:
    with open_checkpoint(DATA / where) as ck:
        fw = framework_for(ck)
        assert name == fw.NAME
        if name != "loop":  # LitGPT's model needs litgpt: its hook is the loop's, not asked here
            assert hook(ck, "batches") is fw.batches and hook(ck, "model") is fw.model
        clip = frameworks.config_clip(ck, ("grad_clip",))
        assert clip is not None and clip[1] == "checkpoint config grad_clip"


def test_framework_for_checkpoints_built_in_place(tmp_path: Path) -> None:
    cases = {
        "hf": _view(tmp_path / "checkpoint-5", "hf-trainer", train_config={"max_grad_norm": 0}),
        "lightning": _view(tmp_path / "last.ckpt", "lightning"),
        "deepspeed": _view(tmp_path / "global_step5", "deepspeed"),
        "torchtitan": _view(tmp_path / "step-5", "dcp"),
        "nanogpt": _view(
            tmp_path / "ckpt.pt",
            "nanogpt",
            train_config={"dtype": "float16", "grad_clip": 1.0},
        ),
        "loop": _view(tmp_path / "model.pt", "torch"),
    }
    for name, ck in cases.items():
        assert name == framework_for(ck).NAME, name
    # The hooks answer as the replay asks them; a framework without one leaves it generic.
    nano, hf = cases["nanogpt"], cases["hf"]
    assert hook(nano, "precision")(nano) == ("fp16", "checkpoint config dtype='float16'")
    assert hook(nano, "clip")(nano) == (1.0, "checkpoint config grad_clip")
    assert hook(hf, "clip")(hf) == (None, "checkpoint config max_grad_norm")
    assert hook(cases["loop"], "precision") is None and hook(cases["torchtitan"], "batches") is None


def test_deepspeed_and_megatron_precision_from_the_runs_config(tmp_path: Path) -> None:
    from ckptforensics.engine.replay import precision as mp

    ds = _view(
        tmp_path / "global_step5",
        "deepspeed",
        train_config={"bf16": True, "ds_config": {"bf16": {"enabled": True}}},
    )
    assert mp.resolve("auto", ds)[0] == "bf16-params"
    with open_checkpoint(DATA / "megatron-core-0.19" / "bf16-legacy" / "iter_0000020") as ck:
        prec, src = mp.resolve("auto", ck)
        assert prec == "bf16-params" and src.startswith("Megatron args bf16=True")
        assert mp.fp32_micro_batches(ck) == ck.scalars["train_config"]["micro_batch_size"]


def test_log_names_are_merged_from_the_trainers() -> None:
    assert ALIASES["loss"][:2] == ("train/CE loss", "lm loss")  # OLMo-core's, then Megatron's
    for name in LOG_ORDER:
        mod = importlib.import_module(f"ckptforensics.trainers.{name}")
        for ours, theirs in mod.LOG_NAMES.items():
            assert set(theirs) <= set(ALIASES[ours])


def test_the_replay_asks_the_trainer_modules_not_the_format() -> None:
    """Which trainer needs what is said in frameworks/ only: replay/ and logs/ branch on no
    format name (the format readers in formats/ are where formats are told apart)."""
    branch = re.compile(
        r"\.format\s*(==|!=|in\b)|format\.startswith|is_olmo_checkpoint\(|is_megatron_args\("
    )
    pkg = ROOT / "ckptforensics"
    found = [
        f"{f.relative_to(pkg)}:{i}"
        for d in ("replay", "logs")
        for f in sorted((pkg / d).glob("*.py"))
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if branch.search(line) and not line.lstrip().startswith(("def ", "#"))
    ]
    assert found == []
