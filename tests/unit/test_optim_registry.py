"""The optimizer families' registry (ckptforensics/optim/): one module per family, one record
each, duplicates refused; recognition that no registry order can change, on what each real
optimizer saves; family names spelled in optim/ only (issue #43)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckptforensics import optim
from ckptforensics.engine.replay.window import optimizer_name
from ckptforensics.optim import bnb
from ckptforensics.optim.registry import OPTIONS, registry

PACKAGE = Path(optim.__file__).resolve().parents[1]

# Modules outside optim/ that still spell a family's name, each owned by another change: remove
# one here once it asks the registry (`optim.find(name)`, a `Family` field) instead.
ALLOWED = {
    "engine/audit.py",  # its Adam-only risks (`kind != "adam"`)
    "engine/diff/pair.py",  # the 8-bit note (`family == "adam8bit"`)
    "engine/replay/window.py",  # `optimizer_name`: `Family.replay_label` says the same
    "trainers/deepspeed/checkpoint.py",  # DeepSpeed's ZeRO state is Adam's (kind="adam")
}


def test_every_family_module_is_registered_once() -> None:
    found = []
    for m in pkgutil.iter_modules(optim.__path__):
        mod = importlib.import_module(f"ckptforensics.optim.{m.name}")
        if isinstance(getattr(mod, "FAMILY", None), optim.Family):
            found.append(mod.FAMILY)
    assert sorted(f.name for f in found) == sorted(optim.FAMILIES)
    assert all(optim.FAMILIES[f.name] is f for f in found)
    # The order reports list them in (the diff's note on an optimizer the tool does not know).
    assert list(optim.FAMILIES) == ["adam", "lamb", "lion", "adafactor", "muon", "sgd", "adam8bit"]


def test_the_registry_refuses_duplicates() -> None:
    lion = optim.family("lion")
    with pytest.raises(ValueError, match="'lion' registered twice"):
        registry(lion, optim.family("sgd"), lion)
    twin = dataclasses.replace(lion, name="lion2", marks=optim.family("muon").marks)
    with pytest.raises(ValueError, match="'muon' and 'lion2' both claim the group options"):
        registry(optim.family("muon"), twin)
    with pytest.raises(TypeError):
        optim.FAMILIES["lion2"] = twin  # type: ignore[index]


def test_lookup_by_name() -> None:
    assert optim.family("adam8bit").title == "8-bit Adam"
    assert optim.find("none") is None and optim.find("unknown:sum") is None
    assert optim.find("") is None and optim.find(None) is None
    with pytest.raises(KeyError, match=r"no optimizer family 'adagrad' \(known: adam, lamb"):
        optim.family("adagrad")
    assert optim.DEFAULT is optim.family("adam")
    assert set(OPTIONS) == {o for f in optim.FAMILIES.values() for o in f.options}


def _saved(make: Any, shape: tuple[int, ...] = (8, 12)) -> list[tuple[set[str], dict[str, Any]]]:
    """(state keys, group) of an optimizer's state_dict before its first step and after it."""
    p = torch.nn.Parameter(torch.randn(shape))
    opt = make([p])
    out = []
    for _ in range(2):
        sd = opt.state_dict()
        st = {k: bnb.unwrap(v) for k, v in sd["state"].items()}
        out.append((set().union(*st.values()) if st else set(), sd["param_groups"][0]))
        p.grad = torch.randn(shape)
        opt.step()
    return out


def _makers() -> dict[str, tuple[str, Any]]:
    """Real optimizers -> (their family, a factory over params)."""
    out: dict[str, tuple[str, Any]] = {
        "adamw": ("adam", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
        "adam": ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
        "sgd": ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
        "adafactor": ("adafactor", lambda ps: torch.optim.Adafactor(ps, lr=1e-2)),
        "muon": ("muon", lambda ps: torch.optim.Muon(ps, lr=1e-2)),
    }
    try:
        from transformers.optimization import Adafactor

        out["adafactor_hf"] = (
            "adafactor",
            lambda ps: Adafactor(
                ps, lr=1e-3, scale_parameter=False, relative_step=False, beta1=0.9
            ),
        )
    except ImportError:
        pass
    try:
        from lion_pytorch import Lion

        out["lion"] = ("lion", lambda ps: Lion(ps, lr=1e-3))
    except ImportError:
        pass
    try:
        from pytorch_optimizer import Lamb

        out["lamb"] = ("lamb", lambda ps: Lamb(ps, lr=1e-3))
    except ImportError:
        pass
    try:
        import bitsandbytes

        out["adam8bit"] = (
            "adam8bit",
            lambda ps: bitsandbytes.optim.AdamW8bit(ps, lr=1e-3, min_8bit_size=16),
        )
    except ImportError:
        pass
    return out


def _claims(keys: set[str], group: dict[str, Any]) -> list[str]:
    """Every family whose marks or state rule take this group (whatever the registry order)."""
    g = set(group)
    by_marks = [f.name for f in optim.FAMILIES.values() if any(m <= g for m, _ in f.marks)]
    if by_marks:
        return by_marks
    return [f.name for f in optim.FAMILIES.values() if f.recognise(keys, group) is not None]


@pytest.mark.parametrize("opt", sorted(_makers()))
def test_one_family_claims_what_each_optimizer_saves(opt: str) -> None:
    """No two families' marks, nor two families' state rules, take what one real optimizer
    saves: recognition in registry order is recognition in any order."""
    fam, make = _makers()[opt]
    for i, (keys, group) in enumerate(_saved(make)):
        claims = _claims(keys, group)
        if i == 0 and not claims:
            assert optim.optimizer_family(keys, group)[0] == "none"  # no state, no option says
            continue
        assert claims == [fam], (opt, i, sorted(keys), sorted(group))
        assert optim.optimizer_family(keys, group)[0] == fam


@pytest.mark.parametrize(
    ("group", "impl"),
    [
        (
            {"bias_correction": True, "max_coeff": 10.0, "min_coeff": 0.01, "max_grad_norm": 0.0},
            "deepspeed",
        ),
        ({"bias_correction": True, "grad_averaging": True, "max_grad_norm": 0.0}, "apex"),
    ],
)
def test_fused_lambs_are_claimed_by_lamb_alone(group: dict[str, Any], impl: str) -> None:
    """DeepSpeed's and apex's LAMB (CUDA ops) as their groups save them."""
    g = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, **group}
    assert _claims({"exp_avg", "exp_avg_sq"}, g) == ["lamb"]
    fam, name = optim.optimizer_family({"exp_avg", "exp_avg_sq"}, g)
    assert fam == "lamb" and impl in name.lower()


def test_replay_labels_match_the_replay_config() -> None:
    """`Family.replay_label` names the rebuilt class as `replay.config` does today."""
    for f in optim.FAMILIES.values():
        for impl in ("torch.optim.Adafactor", "pytorch_optimizer.Lamb", "lion-pytorch"):
            h = SimpleNamespace(family=f.name, options={"implementation": impl})
            ck = SimpleNamespace(optimizer=SimpleNamespace(groups=[h]))
            assert optimizer_name(ck) == f.replay_label(impl), (f.name, impl)  # type: ignore[arg-type]


def test_every_bound_is_its_familys() -> None:
    """Each family's bound names its family, and every step bound of a name the tool does
    not know is none."""
    for f in optim.FAMILIES.values():
        b = f.update_bound(
            lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), options={}, t_first=3, t_last=7,
            shape=(16, 8), rms_w=0.02,
        )  # fmt: skip
        assert b.family == f.name
        assert (f.floor is None) == (f.second_moment_floor((0.9, 0.95), {}, 3, 7) is None)
        assert f.second_moment_floor((0.9, 0.95), {}, 7, 3) == 1.0
    b = optim.step_bound(
        "unknown:sum", lr=1e-3, weight_decay=0.0, betas=None, options={}, t_first=1, t_last=2,
        shape=(4,),
    )  # fmt: skip
    assert not b.sharp and b.per_step == float("inf")
    assert optim.second_moment_floor("unknown:sum", None, {}, 1, 2) is None


def _family_literals(path: Path) -> list[int]:
    names = set(optim.FAMILIES)
    return [
        n.lineno
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
    ]


def test_family_names_are_spelled_in_optim_only() -> None:
    """Code outside optim/ asks the registry; it never branches on a family's name."""
    found = {
        p.relative_to(PACKAGE).as_posix(): lines
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.relative_to(PACKAGE).parts[0] != "optim" and (lines := _family_literals(p))
    }
    offenders = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not offenders, (
        f"family names outside optim/ (ask `optim.find`/`optim.family`): {offenders}"
    )
    stale = sorted(ALLOWED - set(found))
    assert not stale, f"remove from ALLOWED (no family name left there): {stale}"
