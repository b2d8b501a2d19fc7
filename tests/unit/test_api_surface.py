"""The library's surface without training: one argument order, the replay's options as one
record, every command a `Report` (inspect's and triage's too), and `Report.save` refusing a
directory inside a checkpoint it read, as the CLI does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptforensics as cf
from ckptforensics.core.errors import ForensicsError
from ckptforensics.core.options import ReplayOptions, replay_options


def test_options_by_name_or_as_a_record_and_an_unknown_name_is_named() -> None:
    base = ReplayOptions(model="m.py:f", clip=1.0)
    got = replay_options(base, precision="bf16")
    assert (got.model, got.clip, got.precision) == (
        "m.py:f",
        1.0,
        "bf16",
    ) and base.precision == "auto"
    with pytest.raises(TypeError, match="unknown replay option.*modle"):
        replay_options(modle="m.py:f")
    from ckptforensics.engine.replay.run import ReplayConfig

    cfg = ReplayConfig(before=Path("a"), batch="b.h5", **got.as_kwargs())
    assert isinstance(cfg, ReplayOptions) and cfg.precision == "bf16"


def _checkpoint(tmp_path: Path) -> Path:
    w = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(w.parameters(), lr=1e-3)
    w(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "run" / "step_5.pt"
    path.parent.mkdir()
    torch.save({"model": w.state_dict(), "optimizer": opt.state_dict(), "step": 5}, path)
    return path


def test_inspect_is_a_report_with_its_own_document(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    rep = cf.inspect(5, run_dir=path.parent)
    assert rep.kind == "inspect" and rep.doc["step"] == 5 and rep.doc["completeness"]["complete"]
    assert rep.result.parameters == 20
    assert rep.to_markdown().startswith(f"{path}:")
    written = rep.save(tmp_path / "out")
    assert (
        json.loads((tmp_path / "out" / "inspect.json").read_text())["schema"]
        == "ckptforensics.inspect/1"
    )
    assert {p.name for p in written} == {"inspect.json", "inspect.md"}
    with pytest.raises(AttributeError, match="no verdict"):
        _ = rep.cause


def test_a_report_is_never_saved_inside_a_checkpoint_it_read(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-10"
    ck.mkdir()
    doc = {
        "schema": "ckptforensics.report/1",
        "incident": {
            "before": {"path": str(ck)},
            "after": {"path": str(tmp_path / "checkpoint-20")},
        },
    }
    with pytest.raises(ForensicsError, match="inside the input checkpoint"):
        cf.Report(doc).save(ck / "report")
    assert not (ck / "report").exists()
