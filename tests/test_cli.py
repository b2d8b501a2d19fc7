"""The CLI as users type it: exit codes, one-line errors, untouched inputs, refused pickles."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from ckptforensics.cli import cli
from tests.conftest import tree_hash, truth

MCORE = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "megatron-core-0.19"


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_bad_input(result: click.testing.Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert message in lines[0], lines[0]


def test_every_command_has_help_with_an_example() -> None:
    for name, cmd in cli.commands.items():
        result = invoke(name, "--help")
        assert result.exit_code == 0, name
        assert "Example" in result.output, name
        assert cmd.help and cmd.help.splitlines()[0].strip(), name
    top = invoke("--help")
    assert "Exit codes" in top.output and "--before 41950 --after 42000" in top.output
    assert invoke("--version").output.startswith("ckptforensics")


def test_diff_writes_reports_and_leaves_inputs_untouched(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    run = zoo["silent_corruption"]
    before = tree_hash(run)
    result = invoke(
        "diff",
        "--run-dir",
        str(run),
        "--before",
        "30",
        "--after",
        "40",
        "--out",
        str(tmp_path / "rep"),
    )
    assert result.exit_code == 0
    assert tree_hash(run) == before
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["schema"] == "ckptforensics.report/1"
    assert set(doc) >= {"incident", "verdict", "findings", "diff", "replay", "bisect", "whatif"}
    assert doc["verdict"]["causes"][0]["cause"] == truth(run)["cause"]
    assert doc["verdict"]["corrupted_elements"][0]["index"] == truth(run)["corrupted"]["index"]
    md = (tmp_path / "rep" / "report.md").read_text().splitlines()
    # Ticket-first: the verdict and the culprit are on the first screen.
    head = "\n".join(md[:25])
    assert "silent corruption" in head and truth(run)["corrupted"]["tensor"] in head
    assert not list((tmp_path / "rep").glob(".report*")), "temp files left behind"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_diff_on_a_gpu_torch_cannot_see_is_bad_input(zoo: dict[str, Path]) -> None:
    run = zoo["silent_corruption"]
    result = invoke(
        "diff", "--run-dir", str(run), "--before", "30", "--after", "40", "--device", "cuda"
    )
    assert_bad_input(result, "--device cuda: this torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_replay_and_audit_on_a_gpu_torch_cannot_see_are_bad_input(zoo: dict[str, Path]) -> None:
    run = zoo["poison_batch"]
    hint = truth(run)["replay"]
    model = str(Path(__file__).resolve().parent.parent / hint["model"].split(":")[0])
    spec = f"{model}:{hint['model'].split(':')[1]}"
    common = ["--run-dir", str(run), "--model", spec, "--device", "cuda"]
    replay = invoke(
        "replay", "--before", "30", "--after", "35", "--batch", str(run / hint["batch"]), *common
    )
    assert_bad_input(replay, "--device cuda: this torch")
    assert_bad_input(invoke("audit", *common), "--device cuda: this torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_diff_on_the_gpu_finds_what_the_cpu_finds(zoo: dict[str, Path]) -> None:
    """`--device cuda`: chunks staged through pinned buffers, the statistics in torch's ops
    on the GPU; the verdict, the corrupted element and every tensor's figures as on CPU."""
    run = zoo["silent_corruption"]
    docs = []
    for device in ("cpu", "cuda"):
        result = invoke(
            "diff", "--run-dir", str(run), "--before", "30", "--after", "40", "--json",
            "--device", device,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        docs.append(json.loads(result.stdout))
    cpu, gpu = docs
    assert gpu["verdict"]["causes"] == cpu["verdict"]["causes"]
    assert gpu["verdict"]["corrupted_elements"] == cpu["verdict"]["corrupted_elements"]
    for a, b in zip(cpu["diff"]["tensors"], gpu["diff"]["tensors"], strict=True):
        assert a["name"] == b["name"]
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-12, nan_ok=True), (a["name"], k)


def test_json_output_and_strict_exit_codes(zoo: dict[str, Path]) -> None:
    bad = invoke(
        "diff",
        "--run-dir",
        str(zoo["lr_jump"]),
        "--before",
        "30",
        "--after",
        "40",
        "--json",
        "--strict",
    )
    assert bad.exit_code == 1
    assert json.loads(bad.stdout)["verdict"]["causes"][0]["cause"] == "lr_too_high"
    ok = invoke(
        "diff", "--run-dir", str(zoo["healthy"]), "--before", "30", "--after", "40", "--strict"
    )
    assert ok.exit_code == 0
    assert "No anomaly" in ok.output


def test_inspect_reports_optimizer_and_headroom(zoo: dict[str, Path]) -> None:
    result = invoke("inspect", "--run-dir", str(zoo["hf-trainer"]), "30", "--json")
    assert result.exit_code == 0
    s = json.loads(result.stdout)
    assert s["format"] == "hf-trainer" and s["step"] == 30
    assert s["optimizer"]["kind"] == "adam" and len(s["optimizer"]["groups"]) == 2
    assert all(t["nonfinite"] == 0 and t["headroom"] > 1e30 for t in s["per_tensor"])
    text = invoke("inspect", str(zoo["lightning"] / "epoch=0-step=30.ckpt"))
    assert "lightning, step 30" in text.output and "group 1" in text.output


def test_missing_path(tmp_path: Path) -> None:
    assert_bad_input(invoke("inspect", str(tmp_path / "nope.pt")), "no such file or directory")


def test_missing_step_lists_checkpoints(zoo: dict[str, Path]) -> None:
    r = invoke("diff", "--run-dir", str(zoo["healthy"]), "--before", "30", "--after", "45")
    assert_bad_input(r, "no checkpoint for step 45")
    assert "step_40.pt" in r.stderr


def test_unknown_format(tmp_path: Path) -> None:
    f = tmp_path / "random.bin"
    junk = bytearray(os.urandom(4096))
    junk[8] = ord("x")  # a '{' after 8 random bytes reads as a safetensors header, cut short
    f.write_bytes(bytes(junk))
    assert_bad_input(
        invoke("inspect", str(f)), "not a safetensors, torch.save or checkpoint directory"
    )


def test_truncated_safetensors(zoo: dict[str, Path], tmp_path: Path) -> None:
    src = zoo["healthy-safetensors"] / "step_30.safetensors"
    data = src.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    assert_bad_input(invoke("inspect", str(tmp_path / "cut.safetensors")), "truncated file")
    (tmp_path / "head.safetensors").write_bytes(data[:20])
    assert_bad_input(
        invoke("inspect", str(tmp_path / "head.safetensors")),
        "truncated or corrupt safetensors header",
    )


def test_truncated_torch_file(zoo: dict[str, Path], tmp_path: Path) -> None:
    data = (zoo["healthy"] / "step_30.pt").read_bytes()
    (tmp_path / "step_30.pt").write_bytes(data[: len(data) // 3])
    assert_bad_input(
        invoke("inspect", str(tmp_path / "step_30.pt")), "truncated or not a torch file"
    )


def test_different_parameter_sets(zoo: dict[str, Path]) -> None:
    # two runs' checkpoints, a window apart (one step each: the same step is an empty window)
    r = invoke(
        "diff",
        "--before",
        str(zoo["healthy"] / "step_20.pt"),
        "--after",
        str(zoo["lightning"] / "epoch=0-step=30.ckpt"),
    )
    assert_bad_input(r, "parameter sets differ")


def test_shape_mismatch(zoo: dict[str, Path], tmp_path: Path) -> None:
    ck = torch.load(zoo["healthy-torch"] / "step_40.pt", weights_only=True)
    ck["model"]["transformer.wpe.weight"] = ck["model"]["transformer.wpe.weight"][:16]
    torch.save({"model": ck["model"], "step": 40}, tmp_path / "b.pt")
    r = invoke(
        "diff",
        "--before",
        str(zoo["healthy-torch"] / "step_30.pt"),
        "--after",
        str(tmp_path / "b.pt"),
    )
    assert_bad_input(r, "transformer.wpe.weight: shape [32, 32]")


def test_missing_optimizer_state_is_a_weights_only_diff(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    ck = torch.load(zoo["healthy-torch"] / "step_40.pt", weights_only=True)
    torch.save({"model": ck["model"], "step": 40}, tmp_path / "b.pt")
    r = invoke(
        "diff",
        "--before",
        str(zoo["healthy-torch"] / "step_30.pt"),
        "--after",
        str(tmp_path / "b.pt"),
        "--out",
        str(tmp_path / "rep"),
    )
    assert r.exit_code == 0
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["diff"]["pair"]["weights_only"] is True
    assert any("weights-only" in n for n in doc["diff"]["pair"]["notes"])
    assert "weights-only diff" in (tmp_path / "rep" / "report.md").read_text()


def test_mismatched_optimizer_kinds(zoo: dict[str, Path], tmp_path: Path) -> None:
    ck = torch.load(zoo["healthy-torch"] / "step_40.pt", weights_only=True)
    params = [
        torch.nn.Parameter(t.clone()) for k, t in ck["model"].items() if k != "lm_head.weight"
    ]
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    sgd.step()
    torch.save({"model": ck["model"], "optimizer": sgd.state_dict(), "step": 40}, tmp_path / "b.pt")
    r = invoke(
        "diff",
        "--before",
        str(zoo["healthy-torch"] / "step_30.pt"),
        "--after",
        str(tmp_path / "b.pt"),
    )
    assert_bad_input(r, "optimizer kinds differ")


def test_pickle_that_runs_code_is_refused(zoo: dict[str, Path], tmp_path: Path) -> None:
    canary = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):  # noqa: ANN204 - a hostile pickle
            return (os.system, (f"touch {canary}",))

    ckpt = tmp_path / "checkpoint-30"
    shutil.copytree(zoo["hf-trainer"] / "checkpoint-30", ckpt)
    torch.save({"state": {}, "param_groups": [], "payload": Exploit()}, ckpt / "optimizer.pt")
    r = invoke("inspect", str(ckpt))
    assert_bad_input(r, "refused to unpickle")
    assert "system" in r.stderr
    assert not canary.exists()


def test_out_inside_an_input_directory_is_refused(zoo: dict[str, Path]) -> None:
    ck = zoo["hf-trainer"]
    before = tree_hash(ck)
    r = invoke(
        "diff",
        "--run-dir",
        str(ck),
        "--before",
        "20",
        "--after",
        "30",
        "--out",
        str(ck / "checkpoint-30" / "rep"),
    )
    assert_bad_input(r, "inside the input checkpoint")
    assert tree_hash(ck) == before


HOSTILE = {
    "os.system": "(os.system, ('touch {canary}',))",
    "subprocess.call": "(__import__('subprocess').call, (['touch', '{canary}'],))",
    "builtins.eval": "(eval, (\"open('{canary}', 'w').close()\",))",
}


@pytest.mark.parametrize(
    "where",
    [
        "optimizer.pt",
        "scaler.pt",
        "scheduler.pt",
        "lightning.ckpt",
        "nested",
        "torch_dist common.pt",
    ],
)
@pytest.mark.parametrize("how", sorted(HOSTILE))
def test_hostile_pickles_are_refused(
    zoo: dict[str, Path], tmp_path: Path, where: str, how: str
) -> None:
    """Every pickle that would run code is refused with one line, and the canary proves nothing ran."""
    canary = tmp_path / "ran"
    reduce_src = HOSTILE[how].format(canary=canary)

    class Exploit:
        def __reduce__(self):  # noqa: ANN204 - a hostile pickle
            return eval(reduce_src)  # noqa: S307 - builds the hostile payload in the test

    if where == "torch_dist common.pt":
        target = tmp_path / "iter_0000030"
        shutil.copytree(MCORE / "plain" / "iter_0000020", target)  # megatron-core 0.19 wrote it
        torch.save({"args": Exploit(), "iteration": 30}, target / "common.pt")
    elif where == "lightning.ckpt":
        ck = torch.load(zoo["lightning"] / "epoch=0-step=30.ckpt", weights_only=True)
        ck["callbacks"] = {"x": Exploit()}
        target = tmp_path / "epoch=0-step=30.ckpt"
        torch.save(ck, target)
    else:
        target = tmp_path / "checkpoint-30"
        shutil.copytree(zoo["hf-trainer"] / "checkpoint-30", target)
        name = "optimizer.pt" if where == "nested" else where
        payload = (
            {"state": {}, "param_groups": [{"params": [], "extra": [{"deep": Exploit()}]}]}
            if where == "nested"
            else {"scale": Exploit()}
        )
        torch.save(payload, target / name)
    r = invoke("inspect", str(target))
    assert_bad_input(r, "refused to unpickle")
    assert not canary.exists()


def test_every_command_leaves_its_inputs_byte_identical(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """inspect, diff, replay, bisect, whatif, triage and report, run on one run dir."""
    run = zoo["poison_batch"]
    before = tree_hash(run)
    model, batch = "fixtures/tinygpt.py:factory", str(run / "batches.h5")
    window = ["--run-dir", str(run), "--before", "30", "--after", "35"]
    replayed = ["--model", model, "--batch", batch]
    for i, args in enumerate(
        [
            ["inspect", "--run-dir", str(run), "30"],
            ["diff", *window],
            ["replay", *window, *replayed],
            ["bisect", *window, *replayed],
            [
                "whatif",
                "--run-dir",
                str(run),
                "--before",
                "30",
                "--steps",
                "3",
                *replayed,
                "--try",
                "clip=0.5",
            ],
            ["triage", "--run-dir", str(run)],
        ]
    ):
        out = ["--out", str(tmp_path / str(i))] if args[0] != "inspect" else []
        r = invoke("-q", *args, *out)
        assert r.exit_code == 0, (args[0], r.output)
    r = invoke(
        "report",
        str(tmp_path / "2" / "evidence.h5"),
        "--format",
        "md",
        "--out",
        str(tmp_path / "again.md"),
    )
    assert r.exit_code == 0, r.output
    assert tree_hash(run) == before


def test_a_run_dir_given_as_a_checkpoint_lists_its_steps(zoo: dict[str, Path]) -> None:
    assert_bad_input(
        invoke("inspect", str(zoo["lr_jump"])),
        "a run directory with checkpoints at steps 10, 20, 30, 40, 50, 60",
    )


def test_a_megatron_save_dir_stands_for_its_latest_iteration() -> None:
    for run, fmt in ((MCORE / "legacy", "megatron"), (MCORE / "plain", "megatron-dist")):
        latest = int((run / "latest_checkpointed_iteration.txt").read_text())
        r = invoke("inspect", str(run))
        assert r.exit_code == 0, r.output
        assert f"iter_{latest:07d}: {fmt}, step {latest}" in r.output


def test_progress_in_a_log_file_is_plain_lines_naming_unit_and_total(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """A batch job's stderr is a file: progress is a plain line (no carriage return) at most
    every CKPTFORENSICS_PROGRESS_EVERY seconds (0 here: every tensor), with its unit and total."""
    import re
    import subprocess
    import sys

    run = zoo["poison_batch"]
    log = tmp_path / "job.log"
    with log.open("w") as err:
        done = subprocess.run(
            [sys.executable, "-m", "ckptforensics.cli", "diff", "--run-dir", str(run)]
            + ["--before", "30", "--after", "35"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "CKPTFORENSICS_PROGRESS_EVERY": "0"},
            check=False,
        )
    assert done.returncode == 0
    text = log.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert re.fullmatch(
        r"diff: 1 of 40 tensors \(2%\): transformer\.wte\.weight \[0:\d\d\]", lines[0]
    )
    assert re.fullmatch(r"diff: 40 of 40 tensors \(100%\): .+ \[0:\d\d\]", lines[-1])


def test_plan_names_its_own_directory_for_the_recovery_check(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    """With --out, the recovery command the plan prints names that directory, not a
    placeholder (issue #46 item 13)."""
    run = zoo["poison_batch"]
    out = tmp_path / "plan"
    r = invoke(
        "plan", "--run-dir", str(run), "--before", "30", "--after", "35", "--out", str(out),
        "--batch", str(run / "batches.h5"), "--model", "fixtures/tinygpt.py:factory",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert f"--plan {out}" in r.stdout and "PLAN_DIR" not in r.stdout


def test_plan_prints_the_plan_in_plain_words_and_strict_exits_1(zoo: dict[str, Path]) -> None:
    run = zoo["poison_batch"]
    r = invoke(
        "plan", "--run-dir", str(run), "--before", "30", "--after", "35",
        "--batch", str(run / "batches.h5"), "--model", "fixtures/tinygpt.py:factory", "--strict",
    )  # fmt: skip
    assert r.exit_code == 1, r.output  # the replay's findings are warnings and worse
    lines = r.stdout.splitlines()
    assert (
        f"1. Roll back to {run}/step_30.pt (step 30): the last complete checkpoint before the onset (step 35)."
        in lines
    )
    assert lines[1].startswith("causes: poison_batch (")
    assert not any(mark in r.stdout for mark in ("**", "```", "`step_30.pt`"))


def test_audit_without_a_model_says_what_to_pass(zoo: dict[str, Path]) -> None:
    r = invoke("audit", "--run-dir", str(zoo["poison_batch"]), "40")
    assert r.exit_code == 0, r.output
    assert (
        "  10 checks need --model module:factory (no config.json to build the model from): "
        "norm_placement, qk_norm, logit_control, tied_embeddings, embedding_scale, beta2, "
        "weight_decay, attention_logits, output_logits, activation_growth"
    ) in r.stdout.splitlines()


def test_report_renders_to_a_format_and_triage_writes_report_files(
    zoo: dict[str, Path], tmp_path: Path
) -> None:
    run = zoo["silent_corruption"]
    r = invoke("-q", "diff", "--run-dir", str(run), "--before", "30", "--after", "40",
               "--out", str(tmp_path / "d"))  # fmt: skip
    assert r.exit_code == 0, r.output
    page = tmp_path / "ticket.html"
    r = invoke("report", str(tmp_path / "d" / "evidence.h5"), "--to", "html", "--out", str(page))
    assert r.exit_code == 0 and r.stdout == f"wrote {page}\n"
    assert page.read_text().startswith("<!doctype html>")
    r = invoke("triage", "--run-dir", str(zoo["poison_batch"]), "--out", str(tmp_path / "t"))
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == [
        "report.html",
        "report.json",
        "report.md",
    ]
