"""accelerate's FSDP checkpoint inside a Trainer's `checkpoint-N/` (`pytorch_model_fsdp_0/`,
`optimizer_0/`, `trainer_state.json` written last): its completeness rule, registered with the
DCP reader."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.formats.base import file_problem
from ckptforensics.formats.dcp import DCP_RULE, dcp_files_problems, register_dcp_layout
from ckptforensics.trainers.hf.checkpoint import is_trainer_checkpoint, save_only_model


def fsdp_layout(path: Path, roots: list[Path]) -> tuple[str, list[str]] | None:
    """accelerate's FSDP checkpoint inside a Trainer's `checkpoint-N/`: its rule and what it
    finds missing, or None for another layout."""
    if not (path / "pytorch_model_fsdp_0").is_dir():
        return None
    rule = (
        "accelerate's FSDP checkpoint: pytorch_model_fsdp_0/ and optimizer_0/, each with "
        + DCP_RULE
        + "; trainer_state.json (written last)"
    )
    problems: list[str] = []
    opt = path / "optimizer_0"
    if opt.is_dir() and opt not in roots:
        problems += dcp_files_problems(opt, path)
    elif not opt.is_dir() and not save_only_model(path):
        problems.append("optimizer_0/ missing")
    bad = file_problem(path / "trainer_state.json", path)
    if bad is not None and is_trainer_checkpoint(path):
        problems.append(
            f"{bad} (the Trainer writes it last: the save did not finish)"
            if bad.endswith("missing")
            else bad
        )
    return rule, problems


register_dcp_layout(fsdp_layout)
