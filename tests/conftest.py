"""Session fixtures: the zoo is trained once per test session (seconds on CPU)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fixtures.zoo import build  # noqa: E402

__all__ = [
    "ROOT", "SUBSET", "assert_one_expert_named", "build", "draw_args", "free_port",
    "megatron_dist_name", "torchrun", "validate_reports",
]  # fmt: skip


# `make test` runs the suite on two workers (pytest-xdist): each module's tests run on one
# worker, so a module's fixtures are built once; the modules sharing an expensive session
# fixture (the drawn runs, the DeepSpeed runs) run on one worker together.
_SHARED = {
    "test_draws": "draws",
    "test_distributed_replay": "draws",
    "test_deepspeed": "deepspeed",
    "test_crash_corpus": "deepspeed",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with a module (or a `_SHARED` group of modules) as the scope
    (its `xdist_group` marks no longer reach the scheduler under pytest 9)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _SHARED.get(Path(module).stem, module)

    return ByModule(config, log)


if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores: one thread each
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _reports_validate(request: pytest.FixtureRequest) -> Any:
    """Every report.json a test writes under its tmp_path validates against the shipped JSON
    Schema (checked as the test ends, whatever order tests run in)."""
    where = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if where is not None:
        validate_reports(where)


def validate_reports(root: Path) -> int:
    """Validate every report.json under `root` (but a triage's, of its own schema); returns
    how many."""
    import jsonschema

    from ckptforensics.commands.common import TRIAGE_SCHEMA
    from ckptforensics.report import schema

    docs = sorted(root.rglob("report.json"))
    if docs:
        validator = jsonschema.Draft202012Validator(schema())
        for d in docs:
            doc = json.loads(d.read_text())
            if doc.get("schema") == TRIAGE_SCHEMA:  # a triage's report.json: its own schema
                continue
            errors = sorted(validator.iter_errors(doc), key=str)
            assert not errors, f"{d}: {errors[0].message}"
    return len(docs)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> run dir for every incident and every library-written format."""
    return build(tmp_path_factory.mktemp("zoo"))


# The drawn runs CI trains (fixtures/draws.py, tuning split): a Lightning mid-descent
# poison (escalated; the CSVLogger's log, the default checkpoint layout), an LR jump, a
# plateau poison after a natural grad-norm blip, a per-module LR bug, the same on FSDP2
# (torchrun, DCP, group 0's LR logged only), and three healthy traps: a window inside
# warmup, grad-norm blips far before the window, fp16 with routine loss-scale backoffs.
SUBSET = (1002, 1010, 1012, 1013, 1052, 1009, 1022, 1015)


@pytest.fixture(scope="session")
def draws(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """seed -> run dir of every draw in SUBSET, trained once per session, two at a time (each
    trains on one thread; CI has two cores)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from fixtures.draws import build_draw

    root = tmp_path_factory.mktemp("draws")
    with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as pool:
        return dict(zip(SUBSET, pool.map(build_draw, SUBSET, [root] * len(SUBSET)), strict=True))


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`stage -> run dir` of a real DeepSpeed run at that ZeRO stage (2 ranks, gloo, CPU;
    fixtures/deepspeed_zero.py: global_step2/, global_step3/, latest), each trained once a
    session, when first asked for. Skips the asking test when DeepSpeed is not installed."""
    root = tmp_path_factory.mktemp("deepspeed")
    built: dict[int, Path] = {}

    def run(stage: int) -> Path:
        pytest.importorskip("deepspeed")
        if stage not in built:
            d = root / f"zero{stage}"
            env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
            proc = torchrun([str(ROOT / "fixtures" / "deepspeed_zero.py"), str(d), str(stage)], env)
            assert proc.returncode == 0, proc.stderr[-2000:]
            built[stage] = d
        return built[stage]

    return run


def draw_args(run: Path, command: str = "replay", batch: str | None = None) -> list[str]:
    """The command a user types for a drawn run (its truth's window and replay hints)."""
    from bench.zoo import model_spec

    t = truth(run)
    hint = t["replay"]
    args = [
        command,
        "--run-dir",
        str(run),
        "--before",
        str(t["before"]),
        "--after",
        str(t["after"]),
        "--batch",
        str(run / (batch or hint["batch"])),
    ]
    args += (
        ["--model", model_spec(run, hint["model"])] if hint.get("model") else []
    )  # HF Trainer draws: config.json
    args += ["--precision", hint["precision"]] if hint.get("precision") else []
    return args


@pytest.fixture(scope="session")
def draw_report(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`(run, command, batch) -> report.json` of that command in one process, each run once
    a session (several tests read the same replay of a draw); a fresh dict every call."""
    from click.testing import CliRunner

    from ckptforensics.cli import cli

    root = tmp_path_factory.mktemp("draw-reports")
    done: dict[tuple[str, str, str | None], Path] = {}

    def report(run: Path, command: str = "replay", batch: str | None = None) -> dict:
        key = (str(run), command, batch)
        if key not in done:
            out = root / str(len(done))
            r = CliRunner().invoke(
                cli,
                ["-q", *draw_args(run, command, batch), "--out", str(out)],
                catch_exceptions=False,
            )
            assert r.exit_code == 0, r.output
            assert validate_reports(out) == 1
            done[key] = out
        return json.loads((done[key] / "report.json").read_text())

    return report


def free_port() -> int:
    """A TCP port nobody listens on now (torchrun's rendezvous; fixed ports collide)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks_said(stderr: str, tail: int = 3000) -> str:
    """What the ranks wrote to stderr, for an assertion message: torchrun's own log lines
    and its ChildFailedError traceback dropped, but for each failed rank's exit code (its
    report comes last and would fill a plain tail of the output)."""
    launcher = "torch/distributed/elastic/"
    end = stderr.find("Traceback (most recent call last):\n  File", stderr.find(launcher))
    mine = stderr if end < 0 or "torchrun" not in stderr[end : end + 200] else stderr[:end]
    kept = [ln for ln in mine.splitlines() if launcher not in ln]
    codes = [ln.strip() for ln in stderr.splitlines() if "exitcode" in ln and ":" in ln]
    return "\n".join([*kept, *codes])[-tail:]


def torchrun(
    args: list[str], env: dict[str, str], timeout: int = 600
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGS` on a free port. A launch that fails is tried once
    more on a new port: the port found free can be taken before torchrun binds it, and a
    rendezvous lost that way says nothing about the code under test (a real failure
    fails twice)."""
    exe = Path(sys.executable).with_name("torchrun")
    for attempt in (1, 2):
        cmd = [str(exe), "--nproc_per_node", "2", "--master_port", str(free_port()), *args]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout
        )
        if proc.returncode == 0 or attempt == 2 or "error: " in proc.stderr:
            return proc
    return proc


def truth(run: Path) -> dict:
    return json.loads((run / "truth.json").read_text())


def tree_hash(path: Path) -> str:
    """Hash of every file under `path` (names and bytes): inputs must stay byte-identical."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# megatron-core's local spec saves its norms under Transformer Engine's names in torch_dist (an
# MoE layer's pre-MLP norm too, though its MLP has no linear_fc1).
_TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def megatron_dist_name(name: str) -> str:
    """A megatron-core model's parameter name as its torch_dist checkpoint holds it."""
    for mod, te in _TE_NAMES.items():
        if name.endswith(mod):
            return name[: -len(mod)] + te
    return name


def assert_one_expert_named(rep: dict[str, Any], truth: dict[str, Any]) -> list[dict[str, Any]]:
    """The diff's expert findings name the planted expert (`truth`: expert, moe_layer, tensors)
    alone, on each of its tensors, past Adam's bound at its recorded LR (lr_too_high); returns
    them."""
    expert = [f for f in rep["findings"] if "expert" in f["kind"]]
    assert {f["kind"] for f in expert} == {"expert_update_outlier"}, expert
    assert {f["subject"] for f in expert} == set(truth["tensors"])
    for f in expert:
        m = f["metrics"]
        assert m["expert"] == truth["expert"] and m["experts"] == [truth["expert"]]
        assert m["layer"] == truth["moe_layer"] and m["ratio_factor"] > 100
        assert m["bound_violations"] > 0 and f["supports"] == ["lr_too_high"]
    return expert
