"""Re-rendering a report already written: report."""

from __future__ import annotations

from pathlib import Path

import click

from ckptforensics.cli.common import output, work
from ckptforensics.cli.group import cli


@cli.command("report")
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--to",
    "out_format",
    type=click.Choice(["md", "html", "json"]),
    default=None,
    help="What to render: Markdown, the self-contained HTML page, or the JSON document.  [default: md]",
)
# --format, this command's old name for --to: kept working, not shown (elsewhere --format
# names a checkpoint reader).
@click.option("--format", "old_format", type=click.Choice(["md", "html", "json"]), hidden=True)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    metavar="FILE",
    help="Write this file instead of printing to stdout.",
)
@click.pass_context
def report_cmd(
    ctx: click.Context,
    source: Path,
    out_format: str | None,
    old_format: str | None,
    out: Path | None,
) -> None:
    """Re-render a report from evidence.h5 or report.json, without re-running anything.

    SOURCE is the evidence.h5 or report.json a command wrote with --out.

    \b
    Example:
      ckptforensics report incident/evidence.h5 --to html --out ticket.html
      ckptforensics report incident/report.json --to md | less
    """
    if out_format and old_format and out_format != old_format:
        raise click.UsageError(f"--to {out_format} and --format {old_format} disagree; pass --to")
    out_format = out_format or old_format or "md"
    from ckptforensics.report import atomic_write, render_html, render_markdown, to_json
    from ckptforensics.report.evidence import load_report

    with work(ctx), output(out, [], file=True):
        doc = load_report(source)
        text = {"md": render_markdown, "html": render_html, "json": to_json}[out_format](doc)
        if out is not None:
            atomic_write(out, text)
    if out is None:
        click.echo(text, nl=False)
    else:
        click.echo(f"wrote {out}")
