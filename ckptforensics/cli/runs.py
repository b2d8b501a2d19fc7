"""Commands on a whole run, its log and its latest checkpoint: recovery, audit, triage."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click

import ckptforensics as cf
from ckptforensics.cli.common import command_line, echo_verdict, finish, output, progress, work
from ckptforensics.cli.group import cli
from ckptforensics.cli.params import device_option, out_option, run_dir_option, strict_options


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
@out_option(" (report.html with the plot)")
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

    with work(ctx), output(out, []):
        rep = cf.recovery(
            run_dir,
            resumed_from,
            metrics=metrics,
            plan=plan_path,
            flight=flight,
            checkpoint=checkpoint,
            window=window,
            command=command_line("recovery"),
        )
        written = rep.save(out) if out else []
    r = rep.doc["recovery"]
    if as_json:
        from ckptforensics.report import to_json

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
@device_option("Where the probed forward and backward pass runs (cuda: the first GPU).")
@out_option()
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@strict_options("a risk", " (a CI gate)")
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
    The model is built from what the run recorded (an HF config.json) or from --model;
    without either, the checks that need the traced pass are left out, and the summary
    says which and what to pass.

    \b
    Example:
      ckptforensics audit --run-dir runs/7b 41950
      ckptforensics audit --run-dir runs/7b --json | jq .architecture.norm_placement
      ckptforensics audit --run-dir runs/7b --strict --fail-on critical   # CI gate
    """

    with work(ctx):
        from ckptforensics.commands.audit import default_checkpoint

        path = cf.resolve(step, run_dir) if step is not None else default_checkpoint(run_dir)
        with output(out, [path]):
            with progress(0, "audit", ctx.obj.quiet) as prog:
                rep = cf.audit(
                    path,
                    run_dir=run_dir,
                    compare=compare,
                    progress=prog,
                    command=command_line("audit"),
                    **opts,
                )
            written = rep.save(out) if out else []
    if not as_json:
        echo_verdict(rep.doc)
        for line in unchecked_lines(rep.doc["audit"]["rows"]):
            click.echo(line)
    finish(ctx, rep.doc, rep.findings, as_json, written, strict, fail_on, verdict=False)


def unchecked_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The audit's checks it could not make, grouped by what would make them: the option
    to pass where the row names one ("10 checks need --model module:factory (no
    config.json to build the model from): norm_placement, ..."), else the row's reason."""
    need: dict[tuple[str, str], list[str]] = {}
    other: list[str] = []
    for r in rows:
        if r["status"] != "unknown":
            continue
        hint = re.search(r"([^:;(]*); pass (--[\w-]+(?: [^;),]+)?)", r["message"])
        if hint:
            need.setdefault((hint.group(2), hint.group(1).strip()), []).append(r["id"])
        else:
            other.append(f"{r['id']} ({r['message']})")
    lines = [
        f"  {len(ids)} check{'s' if len(ids) > 1 else ''} need {opt} ({why}): {', '.join(ids)}"
        for (opt, why), ids in need.items()
    ]
    if other:
        lines.append(f"  not checkable from what the run recorded: {'; '.join(other)}")
    return lines


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
@click.option("--json", "as_json", is_flag=True, help="Print the report JSON on stdout.")
@out_option(" (report.html with the log's timeline)", h5=False)
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
    from ckptforensics.engine.triage import TriageConfig

    with work(ctx), output(out, [run_dir] if run_dir is not None else []):
        rep = cf.triage(
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
    if res.rollback_caveat:
        click.echo(f"  caveat: {res.rollback_caveat}")
    for note in res.skipped:
        click.echo(f"  {note}")
    for c in res.commands:
        click.echo(f"  {c}")
    for w in written:
        click.echo(f"wrote {w}")
