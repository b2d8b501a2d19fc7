"""The `history` command: every checkpoint of a run, followed on one fixed batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

import ckptforensics as cf
from ckptforensics.cli.common import command_line, finish, output, progress, work
from ckptforensics.cli.group import cli
from ckptforensics.cli.params import device_option, out_option, run_dir_option, strict_options


@cli.command("history")
@run_dir_option
@click.option(
    "--from",
    "start",
    type=click.IntRange(0),
    default=None,
    help="The first step of the range [default: the run's first checkpoint].",
)
@click.option(
    "--to",
    "stop",
    type=click.IntRange(0),
    default=None,
    help="The last step of the range [default: the run's last checkpoint].",
)
@click.option(
    "--batch",
    "batch",
    default=None,
    help="Batch log (.h5) or batch file: its first logged step's batch is the fixed one "
    "[default: batches.h5 or a flight recorder beside the checkpoints].",
)
@click.option(
    "--data",
    "data",
    default=None,
    help="Instead of --batch: the run's training data, its first batch rebuilt as the run drew it.",
)
@click.option(
    "--model",
    "model",
    default=None,
    help="module:factory, path/file.py:factory, or a dir with a config.json (default: what the run recorded).",
)
@device_option("Where the forward passes run (cuda: the first GPU).")
@out_option(" (report.html with module x checkpoint heatmaps)")
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@strict_options("a finding")
@click.pass_context
def history_cmd(
    ctx: click.Context,
    run_dir: Path,
    start: int | None,
    stop: int | None,
    batch: str | None,
    data: str | None,
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Follow every checkpoint of a run: what grew first, where, since when.

    Each checkpoint of the run (or of --from..--to), in step order, is measured on one
    fixed batch of the run (each attention layer's largest logit and entropy, the output
    log Z and largest logit, every module's activation RMS), and each consecutive pair is
    diffed (update/weight ratio, moments, implied gradient energy). Every module's
    trajectory is judged against its own trend; the verdict names the layer whose
    attention logits grew first (attention_logit_growth), the head's log Z drifting
    (output_logit_divergence) or a tensor whose Adam steps climb past a sign-like step
    (adam_instability), and the checkpoint since which it has.

    \b
    Example:
      ckptforensics history --run-dir runs/7b --from 40000 --to 42000 --out hist/
      ckptforensics history --run-dir runs/x --model fixtures/tinygpt.py:factory --json \\
          | jq '.verdict.first_anomalous_module, .history.onset_step'
    """
    if start is not None and stop is not None and stop <= start:
        raise click.BadParameter(f"--to {stop} is not after --from {start}", param_hint="'--to'")
    if batch is not None and data is not None:
        raise click.UsageError("pass --batch or --data, not both")
    with work(ctx), output(out, [run_dir]):
        with progress(0, "history", ctx.obj.quiet) as prog:
            rep = cf.history(
                run_dir=run_dir,
                start=start,
                stop=stop,
                batch=batch,
                data=data,
                progress=prog,
                command=command_line("history"),
                **opts,
            )
        written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)
