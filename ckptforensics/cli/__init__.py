"""Command line: parse, call the library, render.

Exit codes: 0 done, 1 --strict alarm, 2 bad input, 3 internal error. Every failure is one
line on stderr (`errors.one_line`), made in one place for every command (`group._Cli.invoke`),
on every torchrun rank alike; `--debug` shows the traceback instead.

One module per command group, each adding its commands to the group `cli` when imported:
`checkpoints` (formats, inspect, diff), `replays` (replay, bisect, whatif, plan), `runs`
(recovery, audit, triage), `history` (history), `regress` (regress), `reports` (report); `params` holds the shared options,
`common` what every command does around its library call, `progress` what a command shows
on stderr while it works, `terminal` a report's blocks as plain lines. A usage error is one
line too (`group.UsageLine`). `ckptforensics.cli:main` is the console script;
`python -m ckptforensics.cli` runs it too (torchrun needs a module).
"""

from __future__ import annotations

# Each module adds its commands to `cli` on import; this order is `cli.commands`' order.
from ckptforensics.cli import checkpoints, history, regress, replays, runs  # noqa: F401

# isort: split
from ckptforensics.cli import reports  # noqa: F401
from ckptforensics.cli.group import EXIT_HELP, Ctx, cli, main

__all__ = ["EXIT_HELP", "Ctx", "cli", "main"]
