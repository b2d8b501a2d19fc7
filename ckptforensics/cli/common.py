"""What every command does around its one library call: library prints kept off stdout,
progress on stderr (`cli.progress`), --out checked before any work, and the verdict or JSON
at the end."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import click

from ckptforensics.cli.progress import mode_of, progress
from ckptforensics.cli.quiet import libraries
from ckptforensics.core.errors import ForensicsError

__all__ = [
    "command_line",
    "count_tensors",
    "echo_verdict",
    "finish",
    "not_rank_zero",
    "output",
    "progress",
    "work",
]


@contextmanager
def work(ctx: click.Context) -> Iterator[None]:
    """The work of a command: anything a library prints (DeepSpeed's import-time
    accelerator notice, say) goes to stderr, for stdout is the report (`--json`) and
    nothing else; libraries' warnings go to the log unless --debug (`quiet.libraries`).
    Failures are turned into one line by the group (`_Cli.invoke`)."""
    with redirect_stdout(sys.stderr), libraries(debug=bool(getattr(ctx.obj, "debug", False))):
        yield


@contextmanager
def output(out: Path | None, inputs: list[Path], *, file: bool = False) -> Iterator[None]:
    """--out, checked before any work: never inside an input checkpoint, and writable
    (`report.prepare_out`: a file in the way, read-only, no room all fail here, in one
    line). Directories made for it are removed again if the command then fails, so a
    failed command leaves no trace in --out."""
    if out is None:
        yield
        return
    from ckptforensics.report import check_outside, prepare_out, remove_made

    check_outside(out, inputs)

    made = prepare_out(out, file=file)
    try:
        yield
    except BaseException:
        remove_made(made)
        raise


def not_rank_zero() -> bool:
    from ckptforensics.engine.diff.shard import dist_world

    return dist_world()[0] != 0


def command_line(name: str) -> str:
    return "ckptforensics " + " ".join(sys.argv[1:]) if sys.argv[1:] else f"ckptforensics {name}"


def count_tensors(path: Path, fmt: str | None, quiet: bool = False) -> int:
    """Tensors to stream (the progress line's total); 0 when no progress is shown, or when
    the checkpoint cannot be opened (the command itself then says why)."""
    if quiet or mode_of(sys.stderr) == "off":
        return 0
    from ckptforensics.checkpoints import open_checkpoint

    try:
        with open_checkpoint(path, fmt) as ck:
            return len(ck.names())
    except (ForensicsError, OSError):
        return 0


def finish(
    ctx: click.Context,
    doc: dict[str, Any],
    findings: list[Any],
    as_json: bool,
    written: list[Path],
    strict: bool,
    fail_on: str,
    verdict: bool = True,
) -> None:
    """The JSON, or the verdict (unless the command printed its own) and the files written;
    then exit 1 under --strict when a finding is at or above --fail-on."""
    from ckptforensics.detectors import SEVERITIES
    from ckptforensics.report import to_json

    if as_json:
        click.echo(to_json(doc), nl=False)
    else:
        if verdict:
            echo_verdict(doc)
        for p in written:
            click.echo(f"wrote {p}")
    if strict:
        floor = SEVERITIES.index(fail_on)
        severities = [f["severity"] if isinstance(f, dict) else f.severity for f in findings]
        if any(SEVERITIES.index(s) >= floor for s in severities):
            ctx.exit(1)


def echo_verdict(doc: dict[str, Any]) -> None:
    v = doc["verdict"]
    click.echo(v["summary"])
    causes = ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"])
    click.echo(f"causes: {causes}")
    for f in doc["findings"][:8]:
        click.echo(f"  [{f['severity']}] {f['id']} {f['kind']}: {f['message']}")
    if len(doc["findings"]) > 8:
        click.echo(f"  ... {len(doc['findings']) - 8} more findings in the report")
