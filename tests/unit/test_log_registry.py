"""The log registry: the formats `read_file` asks and the places `find_logs` looks, in the order
that is their contract, each trainer's among the generic ones; a second entry under one name
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptforensics import trainers  # noqa: F401  (every trainer's entries registered)
from ckptforensics.core.errors import ForensicsError
from ckptforensics.logs import (
    discover_metrics,
    register_finder,
    register_format,
    register_log_names,
    register_rows,
    register_step_key,
    register_step_rule,
)
from ckptforensics.logs.registry import FINDERS, FORMATS, fix_rows


def test_the_formats_are_asked_in_their_order() -> None:
    """A file is its first claimant's: by name first (event files, a metrics_step file), then by
    suffix, then a printed log by its lines, and JSONL takes what is left."""
    assert [(f.name, f.shared) for f in FORMATS] == [
        ("tensorboard", True),
        ("mlflow", False),
        ("wandb", True),
        ("olmo-core", False),
        ("csv", True),
        ("trainer_state", True),
        ("megatron", True),
        ("jsonl", True),
    ]


def test_the_places_are_asked_in_their_order(tmp_path: Path) -> None:
    assert [f.name for f in FINDERS] == [
        "metrics",
        "lightning-checkpoints",
        "lightning",
        "litgpt",
        "trainer_state",
        "olmo-core",
        "megatron",
        "tensorboard",
        "wandb",
        "mlflow",
        "mlflow.db",
    ]
    with pytest.raises(ForensicsError) as e:
        discover_metrics(tmp_path)
    assert str(e.value) == (
        f"no training log in {tmp_path} (looked for metrics.jsonl / .csv, lightning_logs, LitGPT logs/csv, "
        "trainer_state.json, OLMo-core metrics_step*.json, Megatron's printed log (*.log, *.out, *.txt), "
        "TensorBoard events (tb/, runs/, --tensorboard-dir), wandb/latest-run, mlruns/); pass --metrics"
    )


def test_a_second_entry_under_one_name_is_refused() -> None:
    with pytest.raises(ValueError, match="megatron"):
        register_format("megatron", lambda p: False, lambda p: [], order=0)
    with pytest.raises(ValueError, match="litgpt"):
        register_finder("litgpt", lambda run: [], order=0)
    with pytest.raises(ValueError, match="megatron-lr"):
        register_rows("megatron-lr", lambda rows: rows)
    with pytest.raises(ValueError, match="train/global_step"):
        register_step_key("train/global_step", 0, order=0)
    with pytest.raises(ValueError, match="lightning"):
        register_step_rule("lightning", lambda path, fmt, cols: None, order=0)
    with pytest.raises(ValueError, match="los"):
        register_log_names({"los": ("train/loss",)})


def test_a_shared_formats_rows_follow_every_trainers_convention() -> None:
    """Megatron-LM's LR column holds the LR of the step after it."""
    rows = {1: {"learning rate": 1.0}, 2: {"learning rate": 2.0}, 3: {"loss": 3.0}}
    assert fix_rows(rows) == {
        1: {"learning rate": 1.0},
        2: {"learning rate": 2.0, "lr": 1.0},
        3: {"loss": 3.0, "lr": 2.0},
    }
