"""The `regress` command: one state and batch under two versions of the code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

import ckptforensics as cf
from ckptforensics.cli.common import command_line, finish, output, progress, work
from ckptforensics.cli.group import cli
from ckptforensics.cli.params import out_option, replay_options, run_dir_option, strict_options
from ckptforensics.core.options import ReplayOptions


def _env(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    """KEY=VALUE pairs, refused before any work when one has no '='."""
    out = {}
    for item in value:
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx, param)
        out[key] = val
    return out


@cli.command("regress")
@click.option(
    "--step",
    "--before",
    "state",
    required=True,
    help="The state: the checkpoint of step S (resolved in --run-dir) or its path; steps S+1 ... S+K are stepped.",
)
@run_dir_option
@click.option(
    "--steps",
    "n_steps",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="How many steps both sides step (K); the first is compared module by module.",
)
@click.option(
    "--against-model",
    default=None,
    help="Side B's model: module:factory or path/file.py:factory (side A is --model).",
)
@click.option(
    "--against-python",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Side B's interpreter (a venv with another torch or transformers): B runs there as a worker process, "
    "exchanging safetensors and JSON (nothing unpickled).",
)
@click.option(
    "--against-env",
    multiple=True,
    callback=_env,
    metavar="KEY=VALUE",
    help="An environment variable set for --against-python's worker (a numerics knob: ATEN_CPU_CAPABILITY=default, "
    "NVIDIA_TF32_OVERRIDE=0, OMP_NUM_THREADS=4); repeat. The worker runs torch on this process's thread count "
    "unless OMP_NUM_THREADS or MKL_NUM_THREADS is set here.",
)
@replay_options
@out_option()
@strict_options(
    why=" (they part: a warning; critical where B goes non-finite): a CI gate for upgrades"
)
@click.pass_context
def regress_cmd(
    ctx: click.Context,
    state: str,
    run_dir: Path,
    n_steps: int,
    against_model: str | None,
    against_python: Path | None,
    against_env: dict[str, str],
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Replay one state and batch under two versions of the code: where do they part?

    Steps the run's batches from the checkpoint under side A (--model) twice, to measure
    A's own run-to-run noise on this device, and under side B (--against-model, or the
    same model in --against-python). Every module's input and output, and the gradient at
    each, are compared element by element (max abs and relative difference, ulps of the
    dtype, bitwise equality); the verdict is bitwise identical, equivalent within A's
    noise, or parted at the first module (forward, then backward) past it. After --steps
    K: the loss, grad norm and parameters of both, and whether B leaves the run's log.
    Under torchrun, as replay: each rank steps its rows on its FSDP2 shards, the figures
    merge across ranks, rank 0 writes the report (--against-python: one process only).

    \b
    Example:
      ckptforensics regress --run-dir runs/7b --step 41950 --batch runs/7b/batches.h5 \\
          --model train.py:build_model --against-model train_new.py:build_model --strict
      ckptforensics regress --run-dir runs/7b --step 41950 --batch runs/7b/batches.h5 \\
          --model train.py:build_model --against-python ../venv-torch-next/bin/python --steps 5
    """
    from ckptforensics.checkpoints import resolve_checkpoint

    with work(ctx):
        pa = resolve_checkpoint(state, run_dir)
        with output(out, [pa]):
            with progress(0, "regress", ctx.obj.quiet) as prog:
                batch = opts.pop("batch")
                try:
                    rep = cf.regress(
                        pa,
                        against_model=against_model,
                        against_python=against_python,
                        against_env=against_env,
                        steps=n_steps,
                        batch=batch,
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=command_line("regress"),
                    )
                except cf.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)
