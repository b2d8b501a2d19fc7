"""OLMo-core's `stepN/` around its DCP files: `.metadata.json` (written last), `train/rank*.pt`
and `model_and_optim/`; its completeness rule, registered with the DCP reader."""

from __future__ import annotations

from pathlib import Path

from ckptforensics.formats.base import json_problem
from ckptforensics.formats.dcp import DCP_RULE, register_dcp_layout
from ckptforensics.formats.torchfile import torch_file_problem


def olmo_layout(path: Path, roots: list[Path]) -> tuple[str, list[str]] | None:
    """OLMo-core's rule and what it finds missing, or None for another layout."""
    if not (
        (path / "model_and_optim").is_dir()
        or (path / "train").is_dir()
        or (path / ".metadata.json").exists()
    ):
        return None
    rule = (
        "an OLMo-core checkpoint: .metadata.json (written last), train/rank0.pt, and model_and_optim/ with "
        + DCP_RULE
    )
    problems: list[str] = []
    bad = json_problem(path / ".metadata.json", path)
    if bad is not None:
        problems.append(
            f"{bad} (OLMo-core writes it last: the save did not finish)"
            if bad.endswith("missing")
            else bad
        )
    for f in sorted({path / "train" / "rank0.pt", *(path / "train").glob("rank*.pt")}):
        bad = torch_file_problem(f, path)
        if bad is not None:
            problems.append(bad)
    return rule, problems


register_dcp_layout(olmo_layout)
