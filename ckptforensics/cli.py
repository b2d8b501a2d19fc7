"""Command line: parse, call the library, render.

Exit codes: 0 done, 1 --strict alarm, 2 bad input, 3 internal error. Every failure is one
line on stderr (`errors.one_line`), made in one place for every command (`_Cli.invoke`),
on every torchrun rank alike; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import errno
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any

import click

from . import __version__
from .errors import one_line
from .options import ReplayOptions

log = logging.getLogger("ckptforensics")

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


@contextmanager
def _errors(ctx: click.Context) -> Iterator[None]:
    """The work of a command: anything a library prints (DeepSpeed's import-time
    accelerator notice, say) goes to stderr, for stdout is the report (`--json`) and
    nothing else. Failures are turned into one line by the group (`_Cli.invoke`)."""
    with redirect_stdout(sys.stderr):
        yield


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


@contextmanager
def _progress(total: int, label: str, quiet: bool) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr when it is a terminal (tqdm if installed); silent otherwise."""
    if quiet or not sys.stderr.isatty():
        yield lambda _name: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda _name: None
        return
    bar = tqdm(total=total, desc=label, unit="tensor", file=sys.stderr, leave=False)
    first = [True]

    def step(name: str) -> None:
        if not first[0]:
            bar.update(1)
        first[0] = False
        bar.set_postfix_str(name[-40:], refresh=False)

    try:
        yield step
    finally:
        bar.close()


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


run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Where the trainer wrote its checkpoints; steps are resolved here.",
)


class _FormatName(click.ParamType):
    """A registered reader's name, checked against the registry only when given (the
    registry imports torch; `--help` must not)."""

    name = "format"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from .formats import format_names

        names = format_names()
        if value not in names:
            self.fail(
                f"{value!r} is not a registered format; choose from {', '.join(names)}", param, ctx
            )
        return str(value)


format_option = click.option(
    "--format",
    "fmt",
    type=_FormatName(),
    default=None,
    help="Force a reader instead of sniffing the format (`ckptforensics formats` lists them, plugins included).",
)


def _replay_options(f: Any) -> Any:
    """Options every replay-based command shares."""
    for opt in reversed(
        [
            click.option(
                "--model",
                "model",
                default=None,
                help="module:factory, path/file.py:factory, or an HF config dir (default: the checkpoint's config.json).",
            ),
            click.option(
                "--batch",
                "batch",
                default=None,
                help="Batch log (.h5, one batch per step), a batch file or module:function.",
            ),
            click.option(
                "--data",
                "data",
                default=None,
                help="Instead of --batch: the run's training data, its batches rebuilt as the run drew them and checked "
                "against the log. HF Trainer: a save_to_disk dir or module:function (the Trainer's own sampler, "
                "training_args.bin); Megatron: the dir of the indexed dataset (.idx/.bin) and its GPTDataset caches; "
                "OLMo-core: the dir its dataset.paths are relative to. With a flight recorder's sample-id log "
                "(--batch), the dataset those ids index.",
            ),
            click.option(
                "--collator",
                "collator",
                default=None,
                help="With --data on an HF Trainer run: the collator it passed to Trainer(data_collator=...), as module:obj "
                "(or module:factory taking the run's tokenizer). Default: default_data_collator, "
                "DataCollatorForLanguageModeling(mlm=False) and DataCollatorWithPadding (with the tokenizer saved in the "
                "checkpoint) are tried, and the first whose first step lands on the log is kept.",
            ),
            click.option(
                "--precision",
                type=click.Choice(["auto", "fp32", "bf16", "fp16", "bf16-params"]),
                default="auto",
                show_default=True,
            ),
            click.option(
                "--device",
                type=click.Choice(["cpu", "cuda"]),
                default="cpu",
                show_default=True,
                help="cuda: under torchrun, one GPU a rank (NCCL).",
            ),
            click.option(
                "--checkpoint-activations",
                is_flag=True,
                help="Recompute each block's activations in the backward pass (activation checkpointing per block): long sequences in less memory, the same figures.",
            ),
            click.option(
                "--clip",
                type=float,
                default=None,
                help="Gradient clipping norm (0 = none); default: from the checkpoint, else calibrated.",
            ),
            click.option(
                "--loss",
                "loss",
                default=None,
                help="module:function(logits, batch) -> per-token loss; default causal-LM cross-entropy.",
            ),
            click.option(
                "--labels",
                type=click.Choice(["shifted", "unshifted"]),
                default=None,
                help="What the batches' labels are, where the data cannot tell (it is measured: next-token targets, as Megatron, "
                "nanoGPT, LitGPT and torchtitan feed them, are 'shifted'; HF's labels == input_ids are 'unshifted').",
            ),
            click.option(
                "--allow-mismatch",
                is_flag=True,
                help="Write the report even when the replay does not reproduce the run's own log on its first checked step: "
                "everything the replay measured is withheld and the verdict comes from the checkpoint diff alone.",
            ),
            click.option(
                "--metrics",
                type=click.Path(dir_okay=False, path_type=Path),
                default=None,
                help="Training log (JSONL/CSV); discovered when absent.",
            ),
            click.option(
                "--out",
                type=click.Path(path_type=Path),
                help="Write the report (and skip.json for bisect) here.",
            ),
            click.option(
                "--json", "as_json", is_flag=True, help="Print the report JSON on stdout."
            ),
        ]
    ):
        f = opt(f)
    return f


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
    from .formats import SNIFFERS, format_names, is_builtin

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
@click.pass_context
def inspect(
    ctx: click.Context,
    checkpoint: str,
    run_dir: Path,
    fmt: str | None,
    as_json: bool,
    show_all: bool,
) -> None:
    """Summarise one checkpoint: complete or not, format, step, sizes, optimizer, scaler, headroom.

    CHECKPOINT is a step number (resolved in --run-dir) or a path. First its files are
    checked against its format's rule for a complete save (sizes, headers and end records:
    a save that died half-way leaves a file missing or cut short); an incomplete one is
    refused with what is missing (exit 2).

    \b
    Example:
      ckptforensics inspect --run-dir runs/7b 41950
      ckptforensics inspect runs/7b/checkpoint-41950 --json
    """
    from . import api
    from .formats import require_complete
    from .locate import resolve_checkpoint
    from .report.inspect import render_inspect_text

    with _errors(ctx):
        path = resolve_checkpoint(checkpoint, run_dir)
        require_complete(
            path, fmt
        )  # an incomplete one: exit 2, naming what is missing, before any reading
        with _progress(_count(path, fmt), "inspect", ctx.obj.quiet) as prog:
            rep = api.inspect(path, format=fmt, progress=prog)
    if as_json:
        click.echo(json.dumps(rep.doc, indent=2))
        return
    click.echo(render_inspect_text(rep.doc, show_all), nl=False)


@contextmanager
def _output(out: Path | None, inputs: list[Path], *, file: bool = False) -> Iterator[None]:
    """--out, checked before any work: never inside an input checkpoint, and writable
    (`report.prepare_out`: a file in the way, read-only, no room all fail here, in one
    line). Directories made for it are removed again if the command then fails, so a
    failed command leaves no trace in --out."""
    if out is None:
        yield
        return
    from .report import check_outside, prepare_out, remove_made

    check_outside(out, inputs)

    made = prepare_out(out, file=file)
    try:
        yield
    except BaseException:
        remove_made(made)
        raise


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
@click.option(
    "--out", type=click.Path(path_type=Path), help="Write report.json and report.md here."
)
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@click.option("--strict", is_flag=True, help="Exit 1 when a finding at or above --fail-on exists.")
@click.option(
    "--fail-on", type=click.Choice(["warning", "critical"]), default="warning", show_default=True
)
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
    from . import api
    from .locate import resolve_checkpoint
    from .shard import dist_world

    rank, _ = dist_world()
    with _errors(ctx):
        pa, pb = resolve_checkpoint(before, run_dir), resolve_checkpoint(after, run_dir)
        with _output(out if rank == 0 else None, [pa, pb]):
            with _progress(_count(pa, fmt), "diff", ctx.obj.quiet or rank != 0) as prog:
                try:
                    rep = api.diff(
                        pa,
                        pb,
                        format=fmt,
                        chunk=chunk_elems,
                        progress=prog,
                        workers=workers,
                        command=_command("diff"),
                    )
                except api.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    _finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


def _not_rank_zero() -> bool:
    from .shard import dist_world

    return dist_world()[0] != 0


def _command(name: str) -> str:
    return "ckptforensics " + " ".join(sys.argv[1:]) if sys.argv[1:] else f"ckptforensics {name}"


def _count(path: Path, fmt: str | None) -> int:
    """Tensors to stream (for the progress bar); 0 when unknown."""
    if not sys.stderr.isatty():
        return 0
    from .formats import open_checkpoint

    with open_checkpoint(path, fmt) as ck:
        return len(ck.names())


def _finish(
    ctx: click.Context,
    doc: dict[str, Any],
    findings: list[Any],
    as_json: bool,
    written: list[Path],
    strict: bool,
    fail_on: str,
) -> None:
    from .detectors import SEVERITIES
    from .report import to_json

    if as_json:
        click.echo(to_json(doc), nl=False)
    else:
        _echo_verdict(doc)
        for p in written:
            click.echo(f"wrote {p}")
    if strict:
        floor = SEVERITIES.index(fail_on)
        if any(SEVERITIES.index(f.severity) >= floor for f in findings):
            ctx.exit(1)


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
@_replay_options
@click.option("--strict", is_flag=True, help="Exit 1 when a finding at or above --fail-on exists.")
@click.option(
    "--fail-on", type=click.Choice(["warning", "critical"]), default="warning", show_default=True
)
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
    from . import api
    from .locate import resolve_checkpoint

    with _errors(ctx):
        pa = resolve_checkpoint(before, run_dir)
        pb = resolve_checkpoint(after, run_dir) if after is not None else None
        with _output(None if _not_rank_zero() else out, [p for p in (pa, pb) if p is not None]):
            with _progress(0, "replay", ctx.obj.quiet or _not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = api.replay(
                        pa,
                        pb,
                        batch=batch,
                        step=opts.pop("step"),
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=_command("replay"),
                    )
                except api.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    _finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


@cli.command("bisect")
@click.option("--before", "before", required=True, help="Step or path of the healthy checkpoint.")
@click.option(
    "--after", "after", required=True, help="Step or path after the spike (the window's end)."
)
@run_dir_option
@_replay_options
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="HF tokenizer directory: the culprit rows are decoded into the report.",
)
@click.pass_context
def bisect_cmd(
    ctx: click.Context,
    before: str,
    after: str,
    run_dir: Path,
    out: Path | None,
    as_json: bool,
    tokenizer: Path | None,
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
    from . import api
    from .locate import resolve_checkpoint

    with _errors(ctx):
        pa, pb = resolve_checkpoint(before, run_dir), resolve_checkpoint(after, run_dir)
        with _output(None if _not_rank_zero() else out, [pa, pb]):
            with _progress(0, "bisect", ctx.obj.quiet or _not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = api.bisect(
                        pa,
                        pb,
                        batch=batch,
                        tokenizer=tokenizer,
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=_command("bisect"),
                    )
                except api.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    _finish(ctx, rep.doc, rep.findings, as_json, written, False, "warning")


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
@_replay_options
@click.pass_context
def whatif_cmd(
    ctx: click.Context,
    before: str,
    n_steps: int,
    tries: tuple[str, ...],
    run_dir: Path,
    out: Path | None,
    as_json: bool,
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
    from . import api
    from .locate import resolve_checkpoint

    with _errors(ctx):
        pa = resolve_checkpoint(before, run_dir)
        with _output(None if _not_rank_zero() else out, [pa]):
            with _progress(0, "whatif", ctx.obj.quiet or _not_rank_zero()) as prog:
                try:
                    batch = opts.pop("batch")
                    rep = api.whatif(
                        pa,
                        steps=n_steps,
                        tries=list(tries),
                        batch=batch,
                        options=ReplayOptions(**opts),
                        progress=prog,
                        command=_command("whatif"),
                    )
                except api.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                    return
            written = rep.save(out) if out else []
    _finish(ctx, rep.doc, rep.findings, as_json, written, False, "warning")


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
@_replay_options
@click.option(
    "--try",
    "tries",
    multiple=True,
    help="A mitigation to replay instead of those the cause calls for (as whatif --try); repeat.",
)
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
    from . import api
    from .locate import resolve_checkpoint

    given = [k for k in ("batch", "data", "collator", "model") if opts.get(k)]
    if reports and (before or after or given or tries):
        raise click.UsageError(
            "pass reports already written, or --before/--after with the replay's options; not both"
        )
    if not reports and not (before and after):
        raise click.UsageError(
            "pass --before and --after (the incident's window), or the reports already written for it"
        )
    with _errors(ctx):
        if reports:
            with _output(out, []):
                rep = api.plan_from(list(reports))
                written = rep.save(out) if out else []
        else:
            pa, pb = (
                resolve_checkpoint(str(before), run_dir),
                resolve_checkpoint(str(after), run_dir),
            )
            with _output(None if _not_rank_zero() else out, [pa, pb]):
                with _progress(0, "plan", ctx.obj.quiet or _not_rank_zero()) as prog:
                    try:
                        batch = opts.pop("batch")
                        rep = api.plan(
                            pa,
                            pb,
                            batch=batch,
                            tries=list(tries) or None,
                            options=ReplayOptions(**opts),
                            progress=prog,
                            command=_command("plan"),
                        )
                    except api.NotRankZero:  # a torchrun rank other than 0: rank 0 reports
                        return
                written = rep.save(out) if out else []
    if as_json:
        from .report import to_json

        click.echo(to_json(rep.doc), nl=False)
        return
    from .report.markdown import plan_lines

    click.echo(rep.doc["verdict"]["summary"])
    click.echo("")
    for line in plan_lines(rep.plan, None if reports else str(run_dir)) or ["no plan"]:
        click.echo(line)
    for p in written:
        click.echo(f"wrote {p}")


@cli.command("recovery")
@run_dir_option
@click.option(
    "--resumed-from",
    "resumed_from",
    type=click.IntRange(0),
    required=True,
    help="The step of the checkpoint the run resumed from.",
)
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="The plan the resume followed (its report.json or directory): its LR, clip, precision and skip list are checked.",
)
@click.option(
    "--metrics",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Training log; discovered in --run-dir when absent (a restart's legs split where steps go back).",
)
@click.option(
    "--flight",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The resumed run's flight recorder (default RUN/flight): the sample ids it saw.",
)
@click.option(
    "--checkpoint",
    default=None,
    help="The first checkpoint the resumed run wrote (step or path); default: the first complete one after --resumed-from.",
)
@click.option(
    "--window",
    type=click.IntRange(2),
    default=8,
    show_default=True,
    help="Steps per window judged against the trajectory.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Write report.json, report.md, report.html (with the plot) and evidence.h5 here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 unless recovered with every check that could be read passed.",
)
@click.pass_context
def recovery_cmd(
    ctx: click.Context, run_dir: Path, resumed_from: int, plan_path: Path | None, metrics: Path | None, flight: Path | None, checkpoint: str | None,
    window: int, out: Path | None, as_json: bool, strict: bool,
) -> None:  # fmt: skip
    """Did the resumed run recover? Its log against the pre-incident trajectory, and the plan.

    Reads the run's log (a restart's legs: the steps before the resume, the incident leg's,
    the resumed leg's), fits the pre-incident trajectory on the steps before the onset
    (Theil-Sen on log loss against log step, as triage judges a curve against its trend),
    and judges the resumed leg in windows: loss against the trajectory (ratio, z), grad
    norm against its pre-incident level, new onsets (triage's detectors). The verdict:
    recovered at step S, recovering (the gap closing), not recovered, or relapsed at step S.
    Beside it, that the resume was the plan: the optimizer state came back (Adam's step
    counter in the first checkpoint after the resume against the trainer's), the LR, clip,
    precision and loss scale the new leg runs with, and the skipped samples not seen again.

    \b
    Example:
      ckptforensics recovery --run-dir runs/7b --resumed-from 41950 --plan plan/ --out recovery/
      ckptforensics recovery --run-dir runs/hf --resumed-from 45 --json | jq .recovery.status
    """
    from . import api

    with _errors(ctx), _output(out, []):
        rep = api.recovery(
            run_dir,
            resumed_from,
            metrics=metrics,
            plan=plan_path,
            flight=flight,
            checkpoint=checkpoint,
            window=window,
            command=_command("recovery"),
        )
        written = rep.save(out) if out else []
    r = rep.doc["recovery"]
    if as_json:
        from .report import to_json

        click.echo(to_json(rep.doc), nl=False)
    else:
        click.echo(rep.verdict["summary"])
        for c in r["checks"]:
            click.echo(f"  [{c['status']}] {c['name']}: {c['message']}")
        for w in r["windows"]:
            click.echo(
                f"  steps {w['first']}-{w['last']}: loss {_fmt(w['ratio'])}x the trajectory (z {_fmt(w['z'])}), grad norm {_fmt(w['grad_ratio'])}x "
                f"its level{', onset at ' + ', '.join(map(str, w['onsets'])) if w['onsets'] else ''}"
            )
        for p in written:
            click.echo(f"wrote {p}")
    if strict and (r["status"] != "recovered" or any(c["status"] == "failed" for c in r["checks"])):
        ctx.exit(1)


def _fmt(x: Any) -> str:
    return "—" if x is None else f"{x:.3g}"


@cli.command("audit")
@click.argument("step", required=False)
@run_dir_option
@click.option(
    "--compare",
    default=None,
    help="An earlier step or path for the rows that compare two checkpoints [default: the checkpoint before STEP; 'none': skip them].",
)
@click.option(
    "--model",
    "model",
    default=None,
    help="module:factory, path/file.py:factory, or an HF config dir (default: what the run recorded).",
)
@click.option(
    "--batch",
    "batch",
    default=None,
    help="Batch log or batch file to probe with (default: batches.h5 or a flight recorder beside the checkpoints; else random token ids).",
)
@click.option(
    "--metrics",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Training log (JSONL/CSV/...); discovered when absent.",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Write report.json, report.md, report.html and evidence.h5 here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@click.option(
    "--strict", is_flag=True, help="Exit 1 when a risk at or above --fail-on exists (a CI gate)."
)
@click.option(
    "--fail-on", type=click.Choice(["warning", "critical"]), default="warning", show_default=True
)
@click.pass_context
def audit_cmd(
    ctx: click.Context,
    step: str | None,
    run_dir: Path,
    compare: str | None,
    out: Path | None,
    as_json: bool,
    strict: bool,
    fail_on: str,
    **opts: Any,
) -> None:
    """Audit a run for known instability risks before the next spike.

    From the checkpoint, the configuration and log the run recorded, and one probed
    forward pass on a batch of the run: the architecture (norm placement and QK-norm read
    from the module graph, z-loss or soft-capping, tied embeddings, embedding scale),
    numerics (fp16 without a loss scaler, bf16 without fp32 master weights, loss-scale
    backoffs), the optimizer (eps-dominated moments, beta2, weight decay on norms and
    embeddings, clipping, warm-up), headroom now (attention and output logits, activation
    growth since the previous checkpoint) and observability. Each row: the figure
    measured, the level it is judged against and its source; risks first, by severity.

    STEP is a step (resolved in --run-dir) or a path; default: the latest checkpoint.

    \b
    Example:
      ckptforensics audit --run-dir runs/7b 41950
      ckptforensics audit --run-dir runs/7b --json | jq .architecture.norm_placement
      ckptforensics audit --run-dir runs/7b --strict --fail-on critical   # CI gate
    """
    from . import api

    with _errors(ctx):
        from .audit import default_checkpoint

        path = api.resolve(step, run_dir) if step is not None else default_checkpoint(run_dir)
        with _output(out, [path]):
            with _progress(0, "audit", ctx.obj.quiet) as prog:
                rep = api.audit(
                    path,
                    run_dir=run_dir,
                    compare=compare,
                    progress=prog,
                    command=_command("audit"),
                    **opts,
                )
            written = rep.save(out) if out else []
    _finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on)


@cli.command("triage")
@click.option(
    "--metrics",
    type=click.Path(path_type=Path),
    default=None,
    help="Training log: a file, a folder of its files (a restarted run's legs merge, the latest winning) or a quoted glob. "
    "JSONL, CSV, trainer_state.json, Megatron's printed log, TensorBoard events, W&B offline runs, MLflow mlruns/ or mlflow.db. "
    "Discovered in --run-dir when absent.",
)
@run_dir_option
@click.option("--loss-key", default="loss", show_default=True, help="Column holding the loss.")
@click.option(
    "--grad-key",
    default="grad_norm",
    show_default=True,
    help="Column holding the (pre-clip) grad norm.",
)
@click.option("--lr-key", default="lr", show_default=True, help="Column holding the learning rate.")
@click.option(
    "--window",
    type=click.IntRange(4),
    default=128,
    show_default=True,
    help="Steps of history each step is judged against.",
)
@click.option(
    "--z", "z", type=float, default=6.0, show_default=True, help="Robust z that marks a spike."
)
@click.option(
    "--margin",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Steps the rollback checkpoint must precede the onset by.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Write triage.json, triage.md and triage.html (with a timeline) here.",
)
@click.pass_context
def triage_cmd(
    ctx: click.Context,
    metrics: Path | None,
    run_dir: Path,
    loss_key: str,
    grad_key: str,
    lr_key: str,
    window: int,
    z: float,
    margin: int,
    as_json: bool,
    out: Path | None,
) -> None:
    """Find the spike onset in the training log and the checkpoint to roll back to.

    Reads the log as its trainer wrote it: JSONL, CSV (Lightning, LitGPT),
    trainer_state.json, OLMo-core's metrics_step*.json, Megatron's printed log (a pasted
    excerpt too), TensorBoard events, W&B offline runs, MLflow's mlruns/ or mlflow.db. A restarted run's
    files (or Megatron's appended log) merge by step, the latest leg winning; the report lists
    every file and leg read.

    Robust z of the grad norm (the first signal to move) and the loss against their own trend,
    LR jumps (the main LR and any per-group LR: "optim/LR (group N)", "lr-AdamW/pgN"),
    loss-scale backoffs, and a parameter whose gradient comes back after vanishing
    ("optim/grad/<param>.norm"). On a noisy log a loss blip that recovers within two steps is
    an onset only when the log has no other blips like it; a pasted excerpt's first lines are
    judged by ratio rules (Megatron's 10x, Lightning's rtol 2). The report names the rule that
    decided and how noisy the log is; then the last checkpoint before the onset, and the
    diff/replay/bisect commands to run next.

    \b
    Example:
      ckptforensics triage --run-dir runs/7b
      ckptforensics triage --metrics runs/7b/metrics.csv --grad-key train/grad_norm --json
      ckptforensics triage --metrics 'logs/slurm-*.out' --run-dir /ckpt/7b
      ckptforensics triage --metrics pasted.txt        # a few Megatron iteration lines
    """
    from . import api
    from .triage import TriageConfig

    with _errors(ctx), _output(out, [run_dir] if run_dir is not None else []):
        rep = api.triage(
            metrics,
            run_dir=run_dir,
            config=TriageConfig(window=window, z=z, margin=margin),
            keys={"loss": loss_key, "grad_norm": grad_key, "lr": lr_key},
        )
        res = rep.result
        written = rep.save(out) if out is not None else []
    if as_json:
        click.echo(json.dumps(rep.doc, indent=2))
        return
    click.echo(f"read {res.metrics_file} ({res.steps} steps, {res.log_format})")
    if len(res.files) > 1 or len(res.legs) > 1:
        for leg in res.legs:
            redone = (
                f"; {leg['superseded']} of them logged again by a later leg"
                if leg["superseded"]
                else ""
            )
            click.echo(f"  leg {leg['source']}: steps {leg['first']}-{leg['last']}{redone}")
    n = res.noise
    if n:
        cols = (
            f"; ignored columns: {n['ignored_columns']} (0 on every row: never computed)"
            if n.get("ignored_columns")
            else ""
        )
        click.echo(
            f"log noise: {n['kind']} (loss moves {n['loss_noise_pct_per_step']}% a step; {n['steps_over_z']} steps over z where normal noise "
            f"gives {n['expected_over_z_if_normal']:.2g}; {n['recovering_blips']} blips that recover){cols}"
        )
    if res.resumed is not None:
        click.echo(
            f"rolled back already: the latest leg resumed at step {res.resumed['from']}; the onsets below read it (a later leg wins)"
        )
        click.echo(
            f"  did it recover? ckptforensics recovery --run-dir {run_dir} --resumed-from {res.resumed['from']}"
        )
    if res.first_bad_step is None:
        click.echo(
            f"no spike onset called: {res.undecided}" if res.undecided else "no spike onset found"
        )
        for w in written:
            click.echo(f"wrote {w}")
        return
    click.echo(f"first bad step: {res.first_bad_step} (rule: {res.rule})")
    for o in res.onsets[:8]:
        click.echo(f"  {o.message}")
    if res.drift:
        click.echo(f"  {res.drift}")
    click.echo(f"rollback checkpoint: {res.rollback or 'none complete before the onset'}")
    for note in res.skipped:
        click.echo(f"  {note}")
    for c in res.commands:
        click.echo(f"  {c}")
    for w in written:
        click.echo(f"wrote {w}")


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
    from .report import atomic_write, render_markdown, to_json
    from .report.evidence import load_report
    from .report.html import render_html

    with _errors(ctx), _output(out, [], file=True):
        doc = load_report(source)
        text = {"md": render_markdown, "html": render_html, "json": to_json}[out_format](doc)
        if out is not None:
            atomic_write(out, text)
    if out is None:
        click.echo(text, nl=False)
    else:
        click.echo(f"wrote {out}")


def _echo_verdict(doc: dict[str, Any]) -> None:
    v = doc["verdict"]
    click.echo(v["summary"])
    causes = ", ".join(f"{c['cause']} ({c['confidence']:.0%})" for c in v["causes"])
    click.echo(f"causes: {causes}")
    for f in doc["findings"][:8]:
        click.echo(f"  [{f['severity']}] {f['id']} {f['kind']}: {f['message']}")
    if len(doc["findings"]) > 8:
        click.echo(f"  ... {len(doc['findings']) - 8} more findings in the report")


def main() -> None:
    cli(prog_name="ckptforensics")


if __name__ == "__main__":
    main()
