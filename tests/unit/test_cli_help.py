"""The command line as a new user reads it: help, usage errors, the options every command
shares, and the progress a command shows on stderr (issue 46, items 16 and 17)."""

from __future__ import annotations

import io
from pathlib import Path

import click
from click.testing import CliRunner

from ckptforensics.cli import cli
from ckptforensics.cli.progress import Progress, mode_of
from ckptforensics.cli.runs import unchecked_lines
from ckptforensics.cli.terminal import plain_lines

# The commands whose verdict --strict turns into an exit code.
VERDICTS = ("diff", "replay", "bisect", "whatif", "plan", "recovery", "audit")


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_a_usage_error_is_one_line_naming_the_help_to_read() -> None:
    r = invoke("diff", "--after", "42000")
    assert r.exit_code == 2
    assert r.stderr == "error: missing option '--before' (see `ckptforensics diff --help`)\n"
    r = invoke("dif")
    assert r.exit_code == 2
    assert (
        r.stderr
        == "error: no such command 'dif'. Did you mean 'diff'? (see `ckptforensics --help`)\n"
    )
    r = invoke("whatif", "--before", "30", "--steps", "0", "--try", "clip=1.0")
    assert r.exit_code == 2
    assert r.stderr == (
        "error: invalid value for '--steps': 0 is not in the range x>=1 (see `ckptforensics whatif --help`)\n"
    )
    r = invoke()  # no command at all: the help, as click shows it
    assert r.exit_code == 2 and r.stderr.startswith("Usage: ") and "Start here" in r.stderr
    r = invoke("plan")  # a usage error the command raises itself
    assert r.exit_code == 2
    assert r.stderr == (
        "error: pass --before and --after (the incident's window), or the reports already "
        "written for it (see `ckptforensics plan --help`)\n"
    )


def test_every_option_of_every_command_has_help() -> None:
    for name, cmd in cli.commands.items():
        bare = [
            p.name
            for p in cmd.params
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()
        ]
        assert not bare, f"{name}: {bare}"


def test_every_command_with_a_verdict_has_strict_and_fail_on() -> None:
    for name in VERDICTS:
        opts = {o for p in cli.commands[name].params for o in p.opts}
        assert "--strict" in opts, name
        assert name == "recovery" or "--fail-on" in opts, name


def test_out_says_which_files_each_command_writes() -> None:
    def out_help(name: str) -> str:
        [p] = [p for p in cli.commands[name].params if p.name == "out"]
        return p.help or ""

    four = "Write the report to this directory: report.json, report.md, report.html and evidence.h5"
    assert out_help("diff") == four + "."
    assert out_help("whatif") == four + "."
    assert out_help("bisect") == (
        four + ", plus skip.json (the bad step and its culprit sample ids)."
    )
    assert out_help("plan") == four + ", plus skip.json when the plan skips data."
    assert out_help("triage") == (
        "Write the report to this directory: report.json, report.md and report.html "
        "(report.html with the log's timeline)."
    )


def test_report_renders_with_to_and_keeps_format_as_a_hidden_alias() -> None:
    help_text = invoke("report", "--help").output
    assert "--to [md|html|json]" in help_text and "--format" not in help_text
    r = invoke("report", "incident/report.json", "--to", "md", "--format", "html")
    assert r.exit_code == 2
    assert r.stderr == (
        "error: --to md and --format html disagree; pass --to (see `ckptforensics report --help`)\n"
    )


def test_the_top_level_help_starts_with_the_loop_and_lists_commands_in_its_order() -> None:
    out = invoke("--help").output
    start = out.split("Start here")[1].splitlines()
    assert start[1].strip().startswith("ckptforensics triage --run-dir runs/7b")
    listing = out.split("Commands:")[1].split("Exit codes")[0]
    commands = [ln.split()[0] for ln in listing.splitlines() if ln.strip() and ln[2:3] != " "]
    assert commands[:4] == ["triage", "inspect", "diff", "replay"]
    assert "..." not in listing  # every summary whole, not cut


def test_progress_in_a_log_file_is_a_plain_line_every_few_seconds() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress("diff", 40, "tensors", stream=out, mode="lines", every=10.0, clock=lambda: now[0])
    for i, t in enumerate([1.0, 5.0, 10.5, 12.0, 21.0]):
        now[0] = t
        p(f"transformer.h.{i}.attn.c_attn.weight")
    p.close()
    assert out.getvalue() == (
        "diff: 3 of 40 tensors (7%): transformer.h.2.attn.c_attn.weight [0:10]\n"
        "diff: 5 of 40 tensors (12%): transformer.h.4.attn.c_attn.weight [0:21]\n"
    )
    assert "\r" not in out.getvalue()


def test_replay_progress_says_its_pass_and_the_step_of_the_window() -> None:
    from ckptforensics.engine.replay.run import in_pass

    got: list[str] = []
    say = in_pass(got.append, "pass 2, clip 1.0", 5)
    assert say is not None
    for s in (31, 32, 33):
        say(f"step {s}")
    assert got[-1] == "pass 2, clip 1.0: step 33 (3 of 5)"
    only = in_pass(got.append, "", 5)
    assert only is not None
    only("step 31")
    assert got[-1] == "step 31 (1 of 5)"
    now = [0.0]
    out = io.StringIO()
    p = Progress("replay", stream=out, mode="lines", every=10.0, clock=lambda: now[0])
    now[0] = 12.0
    p(got[2])
    assert out.getvalue() == "replay: pass 2, clip 1.0: step 33 (3 of 5) [0:12]\n"


def test_progress_on_a_terminal_rewrites_one_line_and_clears_it() -> None:
    now = [0.0]
    out = io.StringIO()
    p = Progress("inspect", 2, "tensors", stream=out, mode="live", clock=lambda: now[0])
    p("a")
    now[0] = 1.0
    p("b")
    p.close()
    first, second = (
        "inspect: 1 of 2 tensors (50%): a [0:00]",
        "inspect: 2 of 2 tensors (100%): b [0:01]",
    )
    assert out.getvalue() == f"\r{first}\r{second}\r{' ' * len(second)}\r"


def test_progress_goes_where_stderr_goes(tmp_path: Path) -> None:
    assert mode_of(io.StringIO()) == "off"  # an in-process capture: no one to show it to
    with (tmp_path / "job.log").open("w") as f:
        assert mode_of(f) == "lines"  # a batch job's log file


def test_audit_says_what_to_pass_for_the_checks_it_could_not_make() -> None:
    no_model = "not checked: runs/7b/step_40.pt: no config.json to build the model from; pass --model module:factory"
    rows = [
        {"id": "qk_norm", "status": "unknown", "message": no_model},
        {
            "id": "beta2",
            "status": "unknown",
            "message": f"beta2 0.95; RMS_t not measured ({no_model[13:]})",
        },
        {"id": "eps", "status": "ok", "message": "eps 1e-8"},
        {
            "id": "clipping",
            "status": "unknown",
            "message": "the run recorded no gradient-clipping setting",
        },
    ]
    assert unchecked_lines(rows) == [
        "  2 checks need --model module:factory (no config.json to build the model from): qk_norm, beta2",
        "  not checkable from what the run recorded: clipping (the run recorded no gradient-clipping setting)",
    ]


def test_plain_lines_carry_no_markdown() -> None:
    from ckptforensics.report.blocks import Bold, Bullets, Code, Item, Para, Pre, Steps

    blocks = [
        Para(["Trainer: training loop"]),
        Steps(
            [
                Item(1, [Bold("Roll back to"), " ", Code("step_30.pt"), " (step 30)."]),
                Item(
                    2,
                    [Bold("Skip"), " samples [273]:"],
                    pre=Pre("skip = ..."),
                    notes=[["verified"]],
                ),
            ]
        ),
        Bullets([["also replayed: clip=0.5"]]),
    ]
    assert plain_lines(blocks) == [
        "Trainer: training loop",
        "1. Roll back to step_30.pt (step 30).",
        "2. Skip samples [273]:",
        "      skip = ...",
        "   - verified",
        "- also replayed: clip=0.5",
    ]
