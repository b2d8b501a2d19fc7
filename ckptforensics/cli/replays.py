"""Commands that replay steps of the run: replay, bisect, whatif, plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

import ckptforensics as cf
from ckptforensics.cli.common import (
    command_line,
    echo_verdict,
    finish,
    not_rank_zero,
    output,
    progress,
    work,
)
from ckptforensics.cli.group import cli
from ckptforensics.cli.params import out_option, replay_options, run_dir_option, strict_options
from ckptforensics.cli.terminal import plain_lines
from ckptforensics.core.options import ReplayOptions


@cli.command()
@click.option(
    "--before",
    "before",
    required=True,
    help="Step (resolved in --run-dir) or path of the healthy checkpoint.",
)
@click.option(
    "--after",
    "after",
    default=None,
    help="Step or path after the spike: replay the whole window and compare.",
)
@run_dir_option
@click.option(
    "--step",
    type=int,
    default=None,
    help="The step to replay when there is no --after (default: before + 1).",
)
@replay_options
@out_option()
@strict_options()
@click.pass_context
def replay(
    ctx: click.Context,
    before: str,
    after: str | None,
    run_dir: Path,
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Replay the suspect step(s) from the before state with probes on every module.

    Rebuilds model and optimizer from BEFORE, replays each step of the window in the
    run's precision (and in fp32), and reports the first bad step, the first module
    to go anomalous, overflowing tensors, the rows that drive the spike, and whether
    the replay reproduces AFTER (no: a hardware fault, located to the element).

    \b
    Example:
      ckptforensics replay --run-dir runs/7b --before 41950 --after 42000 \\
          --batch runs/7b/batches.h5 --model train.py:build_model --out incident/
      ckptforensics replay --run-dir runs/hf --before 45 --after 50 --data data/train
      ckptforensics replay --run-dir runs/hf --before 45 --after 50 --data data/train \\
          --collator collate.py:make_collator

    Models that do not fit one process: run it under torchrun; each rank holds an FSDP2
    shard of the model and its Adam state and replays its rows of every batch.

    \b
      torchrun --nnodes 2 --nproc-per-node 8 ... -m ckptforensics.cli replay --device cuda \\
          --run-dir runs/7b --before 41950 --after 42000 --batch runs/7b/flight --out incident/
    """
    from ckptforensics.checkpoints import resolve_checkpoint

    with work(ctx):
        pa = resolve_checkpoint(before, run_dir)
        pb = resolve_checkpoint(after, run_dir) if after is not None else None
        with output(None if not_rank_zero() else out, [p for p in (pa, pb) if p is not None]):
            with progress(0, "replay", ctx.obj.quiet or not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = cf.replay(
                        pa,
                        pb,
                        batch=batch,
                        step=opts.pop("step"),
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=command_line("replay"),
                    )
                except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


@cli.command("bisect")
@click.option("--before", "before", required=True, help="Step or path of the healthy checkpoint.")
@click.option(
    "--after", "after", required=True, help="Step or path after the spike (the window's end)."
)
@run_dir_option
@replay_options
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="HF tokenizer directory: the culprit rows are decoded into the report.",
)
@out_option(", plus skip.json (the bad step and its culprit sample ids)")
@strict_options()
@click.pass_context
def bisect_cmd(
    ctx: click.Context,
    before: str,
    after: str,
    run_dir: Path,
    out: Path | None,
    as_json: bool,
    tokenizer: Path | None,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Find the first bad step of the window and the rows of its batch that cause it.

    Replays the window, takes the first robust outlier against the run's own history
    as the bad step, then bisects its batch from the state just before it: rows are
    swapped for rows of the last healthy batch until the smallest set whose removal
    removes the spike is found (seeded by per-sample gradient shares, so a handful of
    evaluations). Writes skip.json ({steps, sample_ids}) for the trainer to resume past it.

    \b
    Example:
      ckptforensics bisect --run-dir runs/7b --before 41950 --after 42000 \\
          --batch runs/7b/batches.h5 --model train.py:build_model --out incident/
    """
    from ckptforensics.checkpoints import resolve_checkpoint

    with work(ctx):
        pa, pb = resolve_checkpoint(before, run_dir), resolve_checkpoint(after, run_dir)
        with output(None if not_rank_zero() else out, [pa, pb]):
            with progress(0, "bisect", ctx.obj.quiet or not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = cf.bisect(
                        pa,
                        pb,
                        batch=batch,
                        tokenizer=tokenizer,
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=command_line("bisect"),
                    )
                except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


@cli.command("whatif")
@click.option(
    "--before",
    "before",
    required=True,
    help="Step or path to replay from (the rollback checkpoint).",
)
@click.option(
    "--steps", "n_steps", type=click.IntRange(1), required=True, help="How many steps to replay."
)
@click.option(
    "--try",
    "tries",
    multiple=True,
    required=True,
    help="A mitigation: clip=1.0, precision=bf16|fp32, lr_scale=0.5, skip_samples=auto|ID+ID, skip_step=S, eps=1e-6, reset_moments=GLOB; combine with commas. Repeat --try.",
)
@run_dir_option
@replay_options
@out_option()
@strict_options()
@click.pass_context
def whatif_cmd(
    ctx: click.Context,
    before: str,
    n_steps: int,
    tries: tuple[str, ...],
    run_dir: Path,
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Replay from BEFORE under each mitigation and say which keeps the run on track.

    The baseline (no mitigation) is replayed first. A run is on track when every step
    stays finite (no overflow skips) and its loss and grad norm stay under the
    pre-spike level plus a robust band from the training log. The least invasive
    mitigation on track is recommended (clip < eps < lr_scale < precision <
    skip_samples < skip_step < reset_moments).

    \b
    Example:
      ckptforensics whatif --run-dir runs/7b --before 41950 --steps 50 \\
          --batch runs/7b/batches.h5 --model train.py:build_model \\
          --try clip=1.0 --try precision=bf16 --try lr_scale=0.5 --try skip_samples=auto
    """
    from ckptforensics.checkpoints import resolve_checkpoint

    with work(ctx):
        pa = resolve_checkpoint(before, run_dir)
        with output(None if not_rank_zero() else out, [pa]):
            with progress(0, "whatif", ctx.obj.quiet or not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = cf.whatif(
                        pa,
                        steps=n_steps,
                        tries=list(tries),
                        batch=batch,
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=command_line("whatif"),
                    )
                except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


@cli.command("plan")
@click.argument("reports", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option(
    "--before",
    "before",
    default=None,
    help="Step or path of the healthy checkpoint (with --after: replay the window, then the mitigations).",
)
@click.option(
    "--after", "after", default=None, help="Step or path after the spike (the window's end)."
)
@run_dir_option
@replay_options
@click.option(
    "--try",
    "tries",
    multiple=True,
    help="A mitigation to replay instead of those the cause calls for (as whatif --try); repeat.",
)
@out_option(", plus skip.json when the plan skips data")
@strict_options()
@click.pass_context
def plan_cmd(
    ctx: click.Context,
    reports: tuple[Path, ...],
    before: str | None,
    after: str | None,
    run_dir: Path,
    out: Path | None,
    as_json: bool,
    tries: tuple[str, ...],
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """The resume plan, in the trainer's own terms: roll back to, skip, change, resume.

    Replays the window (the verdict: the cause and the first bad step), then replays from
    the last complete checkpoint before the onset the mitigations the cause calls for (a
    poisoned batch: skip its rows or its step; an LR jump: the LR before it; fp16 overflow:
    bf16; ...), and writes the plan for the trainer that wrote the run: HF TrainingArguments
    fields, Lightning Trainer arguments, Megatron-LM flags, OLMo-core and torchtitan config
    keys, DeepSpeed ds_config keys, a plain loop's lines, each a diff of the run's own
    settings where its checkpoint records them; the skip list in the trainer's format
    (Megatron's --iterations-to-skip, HF dataset indices, skip.json otherwise). Each change
    is marked verified by the what-if, with the replayed figures, or not replayed.

    REPORTS: instead of --before/--after, reports already written for this incident (a
    replay or bisect report, a what-if report; directories or report.json): the plan is
    made from them without replaying anything.

    \b
    Example:
      ckptforensics plan --run-dir runs/7b --before 41950 --after 42000 \\
          --batch runs/7b/batches.h5 --model train.py:build_model --out plan/
      ckptforensics plan --run-dir runs/hf --before 45 --after 50 --data data/train --json
      ckptforensics plan incident/ whatif/ --out plan/
    Then resume as it says, and once the run has trained a while:
      ckptforensics recovery --run-dir runs/7b --resumed-from 41950 --plan plan/
    """
    from ckptforensics.checkpoints import resolve_checkpoint

    given = [k for k in ("batch", "data", "collator", "model") if opts.get(k)]
    if reports and (before or after or given or tries):
        raise click.UsageError(
            "pass reports already written, or --before/--after with the replay's options; not both"
        )
    if not reports and not (before and after):
        raise click.UsageError(
            "pass --before and --after (the incident's window), or the reports already written for it"
        )
    with work(ctx):
        if reports:
            with output(out, []):
                rep = cf.plan_from(list(reports))
                written = rep.save(out) if out else []
        else:
            pa, pb = (
                resolve_checkpoint(str(before), run_dir),
                resolve_checkpoint(str(after), run_dir),
            )
            with output(None if not_rank_zero() else out, [pa, pb]):
                with progress(0, "plan", ctx.obj.quiet or not_rank_zero()) as prog:
                    try:
                        batch = opts.pop("batch")
                        rep = cf.plan(
                            pa,
                            pb,
                            batch=batch,
                            tries=list(tries) or None,
                            options=ReplayOptions(**opts),
                            progress=prog,
                            command=command_line("plan"),
                        )
                    except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                        return
                written = rep.save(out) if out else []
    if not as_json:  # the verdict, as every command prints it, then the plan in plain words
        from ckptforensics.report.plan import plan_blocks

        echo_verdict(rep.doc)
        click.echo("")
        rd = None if reports else str(run_dir)
        for line in plain_lines(plan_blocks(rep.plan, rd, str(out) if out else None)):
            click.echo(line)
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on, verdict=False)
