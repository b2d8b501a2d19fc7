"""Options several commands share: --run-dir, --format, --out, --strict, and the replay's options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

__all__ = [
    "device_option",
    "format_option",
    "out_option",
    "replay_options",
    "run_dir_option",
    "strict_options",
]


def out_option(also: str = "", h5: bool = True) -> Any:
    """--out: the directory the report's files are written to (`also`: what the command
    adds, said in its help; `h5`: whether it writes evidence.h5)."""
    files = (
        "report.json, report.md, report.html and evidence.h5"
        if h5
        else ("report.json, report.md and report.html")
    )
    return click.option(
        "--out",
        type=click.Path(path_type=Path),
        metavar="DIR",
        help=f"Write the report to this directory: {files}{also}.",
    )


def strict_options(what: str = "a finding", why: str = "") -> Any:
    """--strict and --fail-on: exit 1 when the report holds `what` at or above --fail-on."""

    def add(f: Any) -> Any:
        f = click.option(
            "--fail-on",
            type=click.Choice(["warning", "critical"]),
            default="warning",
            show_default=True,
            help="The least severity --strict exits 1 on.",
        )(f)
        return click.option(
            "--strict", is_flag=True, help=f"Exit 1 when {what} at or above --fail-on exists{why}."
        )(f)

    return add


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
        from ckptforensics.checkpoints import format_names

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


def device_option(help: str) -> Any:
    """--device: where the command's tensor work runs (cpu, or cuda: a GPU), as `help` says."""
    return click.option(
        "--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True, help=help
    )


def replay_options(f: Any) -> Any:
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
                help="The precision the run trained in: fp16/bf16 autocast over fp32 weights; "
                "bf16-params bf16 weights on fp32 master weights (as FSDP2's bf16 policy keeps them). "
                "auto: read from the checkpoint and the run's config.",
            ),
            device_option(
                "Where the replay runs; cuda: one GPU (under torchrun, one GPU a rank, NCCL)."
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
                "--json", "as_json", is_flag=True, help="Print the report JSON on stdout."
            ),
        ]
    ):
        f = opt(f)
    return f
