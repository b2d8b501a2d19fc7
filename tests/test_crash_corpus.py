"""What a crash leaves on disk: a corpus of damaged copies of real runs (tests/crash_corpus.py),
each refused with exit 2 and one line, nothing written into its input, nothing left in --out.
Then the rule of each zoo format on a real checkpoint with one file removed or truncated, and
triage's rollback past a partial newest checkpoint."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptforensics.checkpoints import completeness
from ckptforensics.cli import cli
from tests.conftest import ROOT
from tests.crash_corpus import Case, build_cases, snapshot, sources, unprivileged

DATA = ROOT / "fixtures" / "data"


@pytest.fixture(scope="session")
def hf_sharded(zoo: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's HF Trainer run with each checkpoint's weights re-saved by transformers in
    shards of 40 KB (`save_pretrained(max_shard_size=...)`: shards and their index)."""
    from transformers import LlamaForCausalLM

    run = tmp_path_factory.mktemp("hf-sharded")
    for name in ("checkpoint-30", "checkpoint-40"):
        ck = shutil.copytree(zoo["hf-trainer"] / name, run / name)
        (ck / "model.safetensors").unlink()
        LlamaForCausalLM.from_pretrained(zoo["hf-trainer"] / name).save_pretrained(
            ck, max_shard_size="40KB"
        )
        assert len(list(ck.glob("model-*.safetensors"))) > 1
    return run


@pytest.fixture(scope="session")
def corpus(zoo: dict[str, Path], hf_sharded: Path, deepspeed_runs: Any) -> Any:
    """(cases, the root they live under); the root is world-traversable so that the
    permission cases can run as an unprivileged user."""
    ds = deepspeed_runs(2) if importlib.util.find_spec("deepspeed") else None
    root = Path(tempfile.mkdtemp(prefix="ckptforensics-corpus-"))
    root.chmod(0o755)
    try:
        yield build_cases(sources(zoo, DATA, ds, hf_sharded), root / "cases"), root
    finally:
        for d, dirs, files in os.walk(root):
            for n in dirs + files:
                p = Path(d) / n
                if not p.is_symlink():
                    p.chmod(0o755)
        shutil.rmtree(root)


def _refused(r: Any) -> str | None:
    """Why a result is not a refusal of bad input (exit 2, one line, no traceback), or None."""
    lines = r.stderr.strip().splitlines()
    if r.exit_code != 2:
        return f"exit {r.exit_code}: {r.stderr.strip()[-300:] or repr(r.exception)}"
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in r.output:
        return f"not one line: {lines}"
    return None


def _run_case(case: Case, outs: Path) -> list[str]:
    """inspect and diff (with --out) on the damaged checkpoint: what went wrong, if anything."""
    runner = CliRunner()
    before = snapshot(case.run)
    out = outs / case.run.name
    step = ["--run-dir", str(case.run), case.after]
    commands = {
        "inspect": ["inspect", *step],
        "diff": [
            "diff",
            "--run-dir",
            str(case.run),
            "--before",
            case.before,
            "--after",
            case.after,
            "--out",
            str(out),
        ],
    }
    wrong = []
    for name, args in commands.items():
        if case.unprivileged:
            with unprivileged():
                r = runner.invoke(cli, args)
        else:
            r = runner.invoke(cli, args)
        why = _refused(r)
        if why:
            wrong.append(f"{case.name}: {name}: {why}")
    if snapshot(case.run) != before:
        wrong.append(f"{case.name}: its input changed")
    if out.exists() and any(out.rglob("*")):
        wrong.append(f"{case.name}: left {sorted(p.name for p in out.rglob('*'))} in --out")
    return wrong


def test_every_damaged_checkpoint_is_refused_in_one_line(corpus: Any) -> None:
    cases, root = corpus
    outs = root / "outs"
    outs.mkdir()
    outs.chmod(0o777)  # the unprivileged cases create their --out here
    t0 = time.perf_counter()
    wrong = [w for c in sorted(cases, key=lambda c: c.unprivileged) for w in _run_case(c, outs)]
    took = time.perf_counter() - t0
    formats = sorted({c.name.split("/")[0] for c in cases})
    print(
        f"\ncrash corpus: {len(cases)} cases over {len(formats)} formats ({', '.join(formats)}), 2 commands each, {took:.1f} s"
    )
    assert len(cases) >= 150 and len(formats) >= 9
    assert not wrong, f"{len(wrong)} of {2 * len(cases)} runs went wrong:\n" + "\n".join(wrong[:40])


# ---------------------------------------------------------------- one rule per zoo format
def _copy(src: Path, dst: Path) -> Path:
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst / src.name)
    return dst / src.name


def test_hf_trainer_rule(zoo: dict[str, Path], hf_sharded: Path, tmp_path: Path) -> None:
    ck = _copy(zoo["hf-trainer"] / "checkpoint-40", tmp_path)
    assert completeness(ck).problems == ()
    (ck / "trainer_state.json").unlink()  # written last by the Trainer: the save did not finish
    assert completeness(ck).problems == (
        "trainer_state.json missing (the Trainer writes it last: the save did not finish)",
    )
    shutil.copy2(zoo["hf-trainer"] / "checkpoint-40" / "trainer_state.json", ck)
    opt = ck / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:-1])
    assert completeness(ck).problems == (
        "optimizer.pt: truncated or not a torch file (no zip end record)",
    )
    opt.unlink()
    assert completeness(ck).problems == ("optimizer.pt missing",)
    sharded = _copy(hf_sharded / "checkpoint-40", tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (sharded / shard).unlink()
    assert completeness(sharded).problems == (
        f"{shard} missing (listed in model.safetensors.index.json)",
    )


def test_hf_trainer_save_only_model_needs_no_optimizer(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """A run saved with `save_only_model=True` has no optimizer.pt by design (its
    training_args.bin says so): complete without one."""
    import torch
    from transformers import TrainingArguments

    ck = _copy(zoo["hf-trainer"] / "checkpoint-40", tmp_path)
    (ck / "optimizer.pt").unlink()
    args = TrainingArguments(
        output_dir=str(tmp_path / "o"), save_only_model=True, report_to=[], use_cpu=True
    )
    torch.save(args, ck / "training_args.bin")  # what the Trainer saves there
    assert completeness(ck).problems == ()


@pytest.mark.parametrize(
    "name,file",
    [
        ("healthy", "step_40.pt"),
        ("lightning", "epoch=0-step=40.ckpt"),
        ("healthy-safetensors", "step_40.safetensors"),
    ],
)
def test_one_file_rules(zoo: dict[str, Path], tmp_path: Path, name: str, file: str) -> None:
    f = _copy(zoo[name] / file, tmp_path)
    assert completeness(f).problems == ()
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 1])
    (problem,) = completeness(f).problems
    assert problem.startswith(f"{file}: ") and (
        "truncated" in problem or "lies outside the file" in problem
    )


def test_deepspeed_rule(deepspeed_runs: Any, tmp_path: Path) -> None:
    src = deepspeed_runs(2)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    tag = run / "global_step3"
    assert completeness(run).problems == () and completeness(tag).problems == ()
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert completeness(tag).problems == (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt missing (dp_world_size 2 in the model states)",
    )
    assert completeness(run).problems == (
        "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt missing (dp_world_size 2 in the model states)",
    )
    shutil.copy2(src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag)
    (run / "latest").write_text("global_step2")  # `latest` lags: the save of step 3 did not finish
    assert completeness(tag).problems == (
        "newer than ../latest (global_step2): DeepSpeed writes `latest` once every rank has saved, so this save did not finish",
    )


# ---------------------------------------------------------------- triage
def test_triage_rolls_back_past_a_partial_newest_checkpoint_and_says_why(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """poison_batch's onset is step 35: its rollback is step 30's checkpoint. With step 30's
    save cut short (as a crash during the save leaves it), the rollback is step 25, and the
    skipped checkpoint is named with what it lacks; the suggested commands use step 25."""
    run = tmp_path / "run"
    shutil.copytree(zoo["poison_batch"], run)
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(run), "--json"])
    assert json.loads(r.stdout)["rollback_step"] == 30
    f = run / "step_30.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    r = CliRunner().invoke(cli, ["triage", "--run-dir", str(run), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["first_bad_step"] == 35 and doc["rollback_step"] == 25
    assert doc["skipped"] == [
        "step_30.pt skipped: incomplete (step_30.pt: truncated or not a torch file (no zip end record))"
    ]
    assert all("--before 25" in c for c in doc["commands"])
    text = CliRunner().invoke(cli, ["triage", "--run-dir", str(run)]).output
    assert (
        f"rollback checkpoint: {run / 'step_25.pt'}" in text
        and "step_30.pt skipped: incomplete" in text
    )


def test_triage_names_no_rollback_when_none_before_the_onset_is_complete(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(zoo["poison_batch"], run)
    for f in run.glob("step_*.pt"):
        if int(f.stem.split("_")[1]) < 35:
            f.write_bytes(b"")
    doc = json.loads(CliRunner().invoke(cli, ["triage", "--run-dir", str(run), "--json"]).stdout)
    assert doc["rollback"] is None and len(doc["skipped"]) == 6 and doc["commands"] == []
