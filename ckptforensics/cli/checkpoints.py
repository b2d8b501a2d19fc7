"""Commands on checkpoints as they lie on disk: formats, inspect, diff."""

from __future__ import annotations

import json
from pathlib import Path

import click

import ckptforensics as cf
from ckptforensics.cli.common import command_line, count_tensors, finish, output, progress, work
from ckptforensics.cli.group import cli
from ckptforensics.cli.params import (
    device_option,
    format_option,
    out_option,
    run_dir_option,
    strict_options,
)


@cli.command("formats")
def formats_cmd() -> None:
    """List the checkpoint readers: built-in, and those plugins register through the
    `ckptforensics.formats` entry point. "sniffed" readers are chosen from the files'
    layout; the others (torch.save families) by the file's keys, or by --format.

    \b
    Example:
      ckptforensics formats
      ckptforensics inspect --format nanogpt runs/x/ckpt.pt
    """
    from ckptforensics.checkpoints import SNIFFERS, format_names, is_builtin

    for name in format_names():
        how = "sniffed" if name in SNIFFERS else "with --format"
        click.echo(f"{name:16} {'built-in' if is_builtin(name) else 'plugin':9} {how}")


@cli.command()
@click.argument("checkpoint")
@run_dir_option
@format_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option(
    "--all", "show_all", is_flag=True, help="List every tensor, not only the notable ones."
)
@click.option(
    "--verify",
    is_flag=True,
    help="Read every file whole and check each zip member (torch.save files, DCP chunks) against "
    "its CRC-32: a damaged file exits 2 naming the file, member and tensor. safetensors, JSON and "
    "DCP's metadata carry no checksum: for them only the structure is checked.",
)
@click.pass_context
def inspect(
    ctx: click.Context,
    checkpoint: str,
    run_dir: Path,
    fmt: str | None,
    as_json: bool,
    show_all: bool,
    verify: bool,
) -> None:
    """Summarise one checkpoint: complete or not, format, step, sizes, optimizer, scaler, headroom.

    CHECKPOINT is a step number (resolved in --run-dir) or a path. First its files are
    checked against its format's rule for a complete save (sizes, headers and end records:
    a save that died half-way leaves a file missing or cut short); an incomplete one is
    refused with what is missing (exit 2). --verify also reads every byte and checks it
    against the checksums the files carry (a disk or a copy that garbled a file).

    \b
    Example:
      ckptforensics inspect --run-dir runs/7b 41950
      ckptforensics inspect --verify runs/7b/checkpoint-41950 --json
    """
    from ckptforensics.checkpoints import require_complete, resolve_checkpoint
    from ckptforensics.report.inspect import render_inspect_text

    with work(ctx):
        path = resolve_checkpoint(checkpoint, run_dir)
        require_complete(
            path, fmt
        )  # an incomplete one: exit 2, naming what is missing, before any reading
        with progress(count_tensors(path, fmt), "inspect", ctx.obj.quiet) as prog:
            rep = cf.inspect(path, format=fmt, progress=prog, verify=verify)
    if as_json:
        click.echo(json.dumps(rep.doc, indent=2))
        return
    click.echo(render_inspect_text(rep.doc, show_all), nl=False)


@cli.command()
@click.option(
    "--before",
    "before",
    required=True,
    help="Step (resolved in --run-dir) or path of the healthy checkpoint.",
)
@click.option(
    "--after", "after", required=True, help="Step or path of the checkpoint after the spike."
)
@run_dir_option
@format_option
@out_option()
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@strict_options()
@click.option(
    "--chunk-elems",
    type=click.IntRange(1 << 10),
    default=1 << 19,
    show_default=True,
    help="Elements per streamed chunk.",
)
@click.option(
    "--workers",
    type=click.IntRange(1),
    default=None,
    help="Processes sharing the tensors, one thread each [default: one per CPU core, at most 8, for pairs of 512 MiB and more; else 1]. Under torchrun, per rank. The report does not depend on it.",
)
@device_option(
    "cuda: the statistics on the GPU, each chunk read on the host and staged through a pinned buffer; one process feeds it (--workers is ignored), under torchrun each rank its own GPU. The report does not depend on it."
)
@click.pass_context
def diff(
    ctx: click.Context,
    before: str,
    after: str,
    run_dir: Path,
    fmt: str | None,
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    chunk_elems: int,
    workers: int | None,
    device: str,
) -> None:
    """Diff weights and Adam moments of two checkpoints and score every tensor.

    Streams each tensor pair (weights, exp_avg, exp_avg_sq) once, in bounded memory,
    and reports update/weight ratios, implied gradient bursts, sign-like updates,
    dtype headroom, skipped steps, and elements that moved further than Adam can
    move them (bit flips are located to the element and bit).

    Pairs too large for one machine: run it under torchrun; each rank streams its
    share of the tensors and rank 0 gathers the statistics and writes the report.

    \b
    Example:
      ckptforensics diff --run-dir runs/7b --before 41950 --after 42000 --out incident/
      ckptforensics diff --before ckpt_a.pt --after ckpt_b.pt --json | jq .verdict
      torchrun --nnodes 4 --nproc-per-node 1 ... -m ckptforensics.cli diff --before A --after B --out incident/
    """
    from ckptforensics.checkpoints import resolve_checkpoint
    from ckptforensics.engine.diff.shard import dist_world

    rank, _ = dist_world()
    with work(ctx):
        pa, pb = resolve_checkpoint(before, run_dir), resolve_checkpoint(after, run_dir)
        with output(out if rank == 0 else None, [pa, pb]):
            with progress(count_tensors(pa, fmt), "diff", ctx.obj.quiet or rank != 0) as prog:
                try:
                    rep = cf.diff(
                        pa,
                        pb,
                        format=fmt,
                        chunk=chunk_elems,
                        progress=prog,
                        workers=workers,
                        command=command_line("diff"),
                        device=device,
                    )
                except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)
