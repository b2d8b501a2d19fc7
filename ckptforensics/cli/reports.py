"""Re-rendering a report already written: report."""

from __future__ import annotations

from pathlib import Path

import click

from ckptforensics.cli.common import output, work
from ckptforensics.cli.group import cli


@cli.command("report")
@click.argument("source", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["md", "html", "json"]),
    default="md",
    show_default=True,
)
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Write here instead of stdout."
)
@click.pass_context
def report_cmd(ctx: click.Context, source: Path, out_format: str, out: Path | None) -> None:
    """Re-render a report from evidence.h5 or report.json, without re-running anything.

    \b
    Example:
      ckptforensics report incident/evidence.h5 --format html --out ticket.html
    """
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
