"""The command group: global flags, logging set up once, and every failure made one line.

Exit codes: 0 done, 1 --strict alarm, 2 bad input, 3 internal error. Every failure is one
line on stderr (`errors.one_line`), made in one place for every command (`_Cli.invoke`),
on every torchrun rank alike; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import errno
import logging
import sys
from typing import Any

import click

from ckptforensics import __version__
from ckptforensics.core.errors import one_line

__all__ = ["EXIT_HELP", "Ctx", "UsageLine", "cli", "main"]

EXIT_HELP = """
\b
Exit codes:
  0  done (findings or not)
  1  --strict and a finding at or above --fail-on severity (recovery
     --strict: the run did not recover, or a check of the plan failed)
  2  bad input or usage: a missing, damaged or incomplete checkpoint, an
     unreadable file, an --out that cannot be written (one line on stderr)
  3  internal error: a fault in ckptforensics itself (one line on stderr
     naming what it was reading or computing; run with --debug and report it)
"""


# The on-call loop, as `ckptforensics --help` lists the commands: find the onset, look at the
# checkpoints, diagnose, plan the resume, confirm it; then the commands beside the loop.
LOOP = (
    "triage",
    "inspect",
    "diff",
    "replay",
    "bisect",
    "whatif",
    "plan",
    "recovery",
    "audit",
    "history",
    "regress",
    "report",
    "formats",
)


class Ctx:
    debug: bool = False
    quiet: bool = False


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING - 10 * verbose if not quiet else logging.ERROR
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# click >= 8.2 raises this usage error to show the help of a group called with no arguments.
_NO_ARGS: type[Exception] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (Exception,), {})
)


class UsageLine(click.ClickException):
    """A usage error as one line on stderr, naming the help to read; exit 2."""

    exit_code = 2

    @classmethod
    def of(cls, e: click.UsageError) -> UsageLine:
        msg = e.format_message().strip().rstrip(".")
        names, c = [], e.ctx
        while c is not None and c.parent is not None:  # the root is ckptforensics, however invoked
            names.insert(0, c.info_name or "")
            c = c.parent
        path = " ".join(["ckptforensics", *names])
        return cls(f"error: {msg[:1].lower()}{msg[1:]} (see `{path} --help`)")

    def show(self, file: Any = None) -> None:
        click.echo(self.message, err=True)


class _Cli(click.Group):
    """The command group. Every command's failure becomes one line on stderr here, in one
    place: bad input (ForensicsError, an OSError on a file) exits 2, anything else is the
    tool's own fault and exits 3 (`errors.one_line`). Under torchrun every rank runs this,
    and the ranks' collectives hand one rank's failure to all (`errors.Failed`), so every
    rank prints the same line. `--debug` re-raises for the traceback. A usage error (an
    unknown option, a missing one, a bad value) is one line too, instead of click's four."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """The commands in the on-call loop's order (`LOOP`), then any other."""
        return [n for n in LOOP if n in self.commands] + sorted(set(self.commands) - set(LOOP))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with its whole summary line, wrapped (click cuts it at the width)."""
        rows = [
            (name, cmd.get_short_help_str(limit=200))
            for name in self.list_commands(ctx)
            if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden
        ]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except _NO_ARGS:  # bare `ckptforensics`: click shows the help
            raise
        except click.UsageError as e:  # the group's own options
            raise UsageLine.of(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _NO_ARGS:
            raise
        except click.UsageError as e:  # a command's options, or an unknown command
            raise UsageLine.of(e) from None
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except Exception as e:
            if ctx.params.get("debug") or (isinstance(e, OSError) and e.errno == errno.EPIPE):
                raise  # --debug: the traceback; a closed stdout pipe: click's own handling
            code, line = one_line(e)
            click.echo(line, err=True)
            ctx.exit(code)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_HELP)
@click.version_option(__version__, prog_name="ckptforensics")
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress lines or warnings on stderr (a failure still prints its one line).",
)
@click.option(
    "--debug", is_flag=True, help="Show the traceback of a failure instead of its one line."
)
@click.pass_context
def cli(ctx: click.Context, verbose: int, quiet: bool, debug: bool) -> None:
    """Post-mortem forensics for loss spikes in large-model pre-training.

    Point it at the checkpoints around a spike: it says which tensors moved
    abnormally, which hit their dtype's range, and which changed in a way Adam
    cannot explain (hardware corruption).

    \b
    Start here, the on-call loop (commands below in its order):
      ckptforensics triage --run-dir runs/7b      # the onset, the checkpoint to roll back to
      ckptforensics diff --run-dir runs/7b --before 41950 --after 42000 --out incident/
      ckptforensics replay --run-dir runs/7b --before 41950 --after 42000 \\
          --batch runs/7b/batches.h5 --model train.py:build_model --out incident/
      ckptforensics plan incident/ --out plan/    # roll back, skip, change, resume
      ckptforensics recovery --run-dir runs/7b --resumed-from 41950 --plan plan/
    """
    ctx.obj = Ctx()
    ctx.obj.debug = debug
    ctx.obj.quiet = quiet
    _setup_logging(verbose, quiet)


def main() -> None:
    """The console script. A torchrun rank that created a process group leaves through
    `shard.leave_rank`, whatever its status: gloo's threads outlive the interpreter. Only a
    process that loaded the shard module can have created one, so `--help` loads nothing."""
    try:
        cli(prog_name="ckptforensics")  # standalone click: always ends in SystemExit
    except SystemExit as e:
        shard = sys.modules.get("ckptforensics.engine.diff.shard")
        if shard is not None and shard.joined_a_group():
            shard.leave_rank(e.code)
        raise
