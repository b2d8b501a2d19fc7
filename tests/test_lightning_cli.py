"""A LightningCLI run replays with no `--model`: the class path its checkpoints record.

The run is trained in the test session by Lightning's own `LightningCLI` in subclass mode
(`fixtures/lightning_cli_run.py`), so `hyper_parameters` is what LightningCLI writes:
the module's arguments, `_class_path` and `_instantiator`. A checkpoint is untrusted: a
class path rewritten to anything but an installed LightningModule subclass is refused in
one line, and what it names is never called.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("lightning", reason="the LightningCLI fixture needs lightning")
pytest.importorskip(
    "jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the dev extra)"
)

import fixtures.tinygpt  # noqa: E402
from ckptforensics.cli import cli  # noqa: E402
from fixtures.lightning_cli_run import CLASS_PATH, build  # noqa: E402
from tests.test_cli import assert_bad_input  # noqa: E402

CKPTS = Path("lightning_logs") / "version_0" / "checkpoints"


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The LightningCLI run (12 steps, a checkpoint every 4), built once (under a second on CPU once lightning is imported)."""
    t0 = time.perf_counter()
    out = build(tmp_path_factory.mktemp("lightning-cli") / "run")
    print(f"LightningCLI fixture built in {time.perf_counter() - t0:.1f} s")
    return out


def _replay(run: Path, *extra: str) -> tuple[int, dict | None, str]:
    args = ["replay", "--run-dir", str(run), "--before", "4", "--after", "8", "--json", *extra]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    return r.exit_code, json.loads(r.stdout) if r.exit_code == 0 else None, r.output


def test_lightning_cli_records_the_class_path_in_hyper_parameters(cli_run: Path) -> None:
    hp = torch.load(cli_run / CKPTS / "epoch=0-step=4.ckpt", weights_only=True)["hyper_parameters"]
    assert hp["_class_path"] == CLASS_PATH
    assert hp["_instantiator"] == "lightning.pytorch.cli.instantiate_module"
    assert hp["n_layer"] == 2 and hp["lr"] == 3e-3


@pytest.mark.parametrize("batch", ["batches.h5", "flight"])
def test_replay_builds_the_module_from_its_class_path_without_model(
    cli_run: Path, batch: str
) -> None:
    code, doc, out = _replay(cli_run, "--batch", str(cli_run / batch))
    assert code == 0, out
    assert doc is not None
    model = doc["replay"]["config"]["model"]["value"]
    assert model.startswith(CLASS_PATH + "(") and "n_layer=2" in model
    assert "hyper_parameters class path" in model
    assert doc["verdict"]["reproducible"] is True and doc["verdict"]["causes"][0]["cause"] == "none"
    assert doc["replay"]["reproduction"]["mismatched"] == 0
    logged = json.loads((cli_run / "truth.json").read_text())["losses"]
    for s in doc["replay"]["steps"]:
        assert abs(s["loss"] - logged[str(s["step"])]) < 1e-5, s["step"]


def _rewritten(cli_run: Path, tmp_path: Path, class_path: str | None) -> Path:
    """The step-4 checkpoint with its class path replaced (None: removed, as LightningCLI(MyModule) writes)."""
    ckpt = torch.load(cli_run / CKPTS / "epoch=0-step=4.ckpt", weights_only=True)
    if class_path is None:
        del ckpt["hyper_parameters"]["_class_path"]
    else:
        ckpt["hyper_parameters"]["_class_path"] = class_path
    path = tmp_path / "epoch=0-step=4.ckpt"
    torch.save(ckpt, path)
    return path


def _spy(calls: list[str], name: str) -> object:
    def spy(*args: object, **kwargs: object) -> None:
        calls.append(name)
        raise AssertionError(f"{name} was called")

    return spy


@pytest.mark.parametrize(
    ("class_path", "message"),
    [
        ("os.system", "is not a LightningModule (standard library)"),
        ("collections.OrderedDict", "is not a LightningModule (standard library)"),
        ("fixtures.tinygpt.GPT", "is not a LightningModule subclass (a class)"),
        ("fixtures.tinygpt.factory", "is not a LightningModule subclass (function)"),
        ("fixtures.tinygpt.NoSuchClass", "is not a LightningModule subclass (missing)"),
        (
            "__main__.GPTModule",
            "the training script itself (__main__); pass --model path/to/script.py:GPTModule",
        ),
        ("no_such_package_here.Module", "module 'no_such_package_here' is not importable here"),
        ("os.system('id')", "is not a dotted Python name"),
        ("fixtures.no_such_module.Module", "import failed (ModuleNotFoundError"),
    ],
)
def test_a_rewritten_class_path_is_refused_in_one_line_and_never_called(
    cli_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, class_path: str, message: str
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(os, "system", _spy(calls, "os.system"))
    monkeypatch.setattr(fixtures.tinygpt.GPT, "__init__", _spy(calls, "GPT"))
    monkeypatch.setattr(fixtures.tinygpt, "factory", _spy(calls, "factory"))
    before = _rewritten(cli_run, tmp_path, class_path)
    args = [
        "replay",
        "--before",
        str(before),
        "--after",
        str(cli_run / CKPTS / "epoch=0-step=8.ckpt"),
        "--batch",
        str(cli_run / "batches.h5"),
    ]
    r = CliRunner().invoke(cli, args)
    assert_bad_input(r, message)
    assert f"class path {class_path!r}" in r.stderr and "--model" in r.stderr
    assert calls == []


def test_lightning_cli_with_a_fixed_model_class_records_no_class_path(
    cli_run: Path, tmp_path: Path
) -> None:
    before = _rewritten(cli_run, tmp_path, None)
    args = [
        "replay",
        "--before",
        str(before),
        "--after",
        str(cli_run / CKPTS / "epoch=0-step=8.ckpt"),
        "--batch",
        str(cli_run / "batches.h5"),
    ]
    assert_bad_input(
        CliRunner().invoke(cli, args), "with a fixed model class, so they name no class"
    )
    ok = CliRunner().invoke(
        cli, [*args, "--model", "fixtures/lightning_cli_run.py:GPTModule"], catch_exceptions=False
    )
    assert ok.exit_code == 0, ok.output


def test_without_lightning_the_class_path_says_what_to_install(
    cli_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    for name in ("lightning", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # import lightning -> ImportError
    r = CliRunner().invoke(
        cli,
        [
            "replay",
            "--run-dir",
            str(cli_run),
            "--before",
            "4",
            "--after",
            "8",
            "--batch",
            str(cli_run / "batches.h5"),
        ],
    )
    assert_bad_input(
        r, f"class path {CLASS_PATH!r}: building a LightningModule needs lightning installed"
    )
