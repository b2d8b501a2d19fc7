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

__all__ = ["EXIT_HELP", "Ctx", "cli", "main"]

EXIT_HELP = """
\b
Exit codes:
  0  done (findings or not)
  1  --strict and a finding at or above --fail-on severity
  2  bad input or usage: a missing, damaged or incomplete checkpoint, an
     unreadable file, an --out that cannot be written (one line on stderr)
  3  internal error: a fault in ckptforensics itself (one line on stderr
     naming what it was reading or computing; run with --debug and report it)
"""


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


class _Cli(click.Group):
    """The command group. Every command's failure becomes one line on stderr here, in one
    place: bad input (ForensicsError, an OSError on a file) exits 2, anything else is the
    tool's own fault and exits 3 (`errors.one_line`). Under torchrun every rank runs this,
    and the ranks' collectives hand one rank's failure to all (`errors.Failed`), so every
    rank prints the same line. `--debug` re-raises for the traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
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
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or warnings.")
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
    Start here:
      ckptforensics inspect --run-dir runs/7b 41950
      ckptforensics diff --run-dir runs/7b --before 41950 --after 42000 --out incident/
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
