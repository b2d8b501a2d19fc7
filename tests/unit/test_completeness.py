"""Each format's rule for a complete checkpoint, on checkpoints the frameworks themselves wrote
(committed under fixtures/data) with one file removed or cut short. No training here; the zoo's
formats (HF Trainer, nanoGPT, Lightning) and DeepSpeed are in tests/test_crash_corpus.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptforensics.checkpoints import completeness, open_checkpoint, require_complete
from ckptforensics.cli import cli
from ckptforensics.core.errors import CheckpointNotFound, IncompleteCheckpoint
from ckptforensics.formats.dcp import read_metadata

DATA = Path(__file__).resolve().parents[2] / "fixtures" / "data"
MCORE = DATA / "megatron-core-0.19"
OLMO = DATA / "olmo-core-3.0" / "run"
LITGPT = DATA / "litgpt-0.5"


def _copy(src: Path, dst: Path, *extra: str) -> Path:
    """The checkpoint dir `src` (and its save dir's files named in `extra`) under `dst`."""
    shutil.copytree(src, dst / src.name, symlinks=True)
    for name in extra:
        shutil.copy(src.parent / name, dst / name)
    return dst / src.name


def _problems(path: Path) -> tuple[str, ...]:
    c = completeness(path)
    assert c.checked
    return c.problems


@pytest.mark.parametrize(
    "path",
    [
        MCORE / "legacy" / "iter_0000020",
        MCORE / "plain" / "iter_0000020",
        MCORE / "distopt" / "iter_0000010",
        OLMO / "step20",
        LITGPT / "step-00000020",
    ],
    ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}",
)
def test_what_the_frameworks_wrote_is_complete(path: Path) -> None:
    assert _problems(path) == ()


def test_megatron_legacy(tmp_path: Path) -> None:
    it = _copy(MCORE / "legacy" / "iter_0000020", tmp_path, "latest_checkpointed_iteration.txt")
    f = it / "mp_rank_00" / "model_optim_rng.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    assert _problems(it) == (
        "mp_rank_00/model_optim_rng.pt: truncated or not a torch file (no zip end record)",
    )
    f.unlink()
    assert _problems(it) == ("mp_rank_00/model_optim_rng.pt missing",)
    f.write_bytes(data)
    (it / "mp_rank_01").mkdir()  # a rank dir outside the parallel grid its args record
    shutil.copy(f, it / "mp_rank_01" / "model_optim_rng.pt")
    assert _problems(it) == (
        "mp_rank_01/ lies outside the 1 x 1 parallel grid the args record: mismatched world sizes",
    )
    shutil.rmtree(it / "mp_rank_01")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(
        "10"
    )  # the tracker lags: this save did not finish
    assert _problems(it) == (
        "newer than ../latest_checkpointed_iteration.txt (10): Megatron writes it once every rank has saved, so this save did not finish",
    )
    (
        tmp_path / "latest_checkpointed_iteration.txt"
    ).unlink()  # an iteration copied on its own: judged by its files
    assert _problems(it) == ()


def test_megatron_tracker_naming_a_missing_iteration(tmp_path: Path) -> None:
    _copy(MCORE / "legacy" / "iter_0000010", tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(
        CheckpointNotFound,
        match="names iteration 20, but iter_0000020/ is not there .found: iter_0000010",
    ):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("run", ["plain", "distopt"])
def test_megatron_torch_dist(tmp_path: Path, run: str) -> None:
    src = MCORE / run / "iter_0000020"
    src = src if src.is_dir() else MCORE / run / "iter_0000010"
    it = _copy(src, tmp_path)
    md = read_metadata(it)
    end = max(int(i.offset) + int(i.length) for i in md.storage_data.values())
    shard = it / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: end - 1])  # the last chunk one byte short
    assert _problems(it) == (
        f"__0_0.distcp: truncated ({end - 1} bytes; .metadata places chunks up to byte {end})",
    )
    shard.unlink()
    assert _problems(it) == ("__0_0.distcp missing (named in .metadata)",)
    shutil.copy(src / "__0_0.distcp", shard)
    (it / "metadata.json").unlink()  # Megatron writes it last
    assert completeness(it).format == "megatron-dist"
    assert _problems(it) == (
        "metadata.json missing (Megatron writes it once every rank has saved)",
    )
    shutil.copy(src / "metadata.json", it / "metadata.json")
    (it / ".metadata").unlink()
    assert _problems(it) == (
        ".metadata missing (written after every rank's files: the save did not finish)",
    )


def test_olmo_core(tmp_path: Path) -> None:
    step = _copy(OLMO / "step20", tmp_path)
    (step / ".metadata.json").unlink()
    assert _problems(step) == (
        ".metadata.json missing (OLMo-core writes it last: the save did not finish)",
    )
    shutil.copy(OLMO / "step20" / ".metadata.json", step / ".metadata.json")
    (step / "model_and_optim" / "__0_2.distcp").unlink()
    assert _problems(step) == ("model_and_optim/__0_2.distcp missing (named in .metadata)",)
    shutil.copy(OLMO / "step20" / "model_and_optim" / "__0_2.distcp", step / "model_and_optim")
    (step / "train" / "rank0.pt").write_bytes(b"")
    assert _problems(step) == ("train/rank0.pt: empty (0 bytes)",)
    shutil.copy(OLMO / "step20" / "train" / "rank0.pt", step / "train")
    meta = step / "model_and_optim" / ".metadata"
    meta.write_bytes(meta.read_bytes()[:1000])
    (problem,) = _problems(step)
    assert problem.startswith("model_and_optim/.metadata: unreadable DCP metadata")
    with pytest.raises(
        IncompleteCheckpoint,
        match="incomplete dcp checkpoint: model_and_optim/.metadata: unreadable",
    ):
        open_checkpoint(step)


def test_a_torch_save_file(tmp_path: Path) -> None:
    """LitGPT's lit_model.pth: a torch.save zip whose end record comes last."""
    step = _copy(LITGPT / "step-00000020", tmp_path)
    f = step / "lit_model.pth"
    data = f.read_bytes()
    for cut in (1, len(data) // 2, len(data) - 1):
        f.write_bytes(data[:cut])
        assert _problems(step) == (
            "lit_model.pth: truncated or not a torch file (no zip end record)",
        ), cut
    f.write_bytes(data)
    assert _problems(step) == ()


def test_a_safetensors_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    f = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, 8)}, f)
    data = f.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    expected = {
        0: "w.safetensors: empty (0 bytes)",
        4: "w.safetensors: truncated safetensors file (no header length)",
        header // 2: "w.safetensors: truncated or corrupt safetensors header",
        header: "lies outside the file or disagrees with its shape (truncated file?)",
        len(data) - 1: "lies outside the file or disagrees with its shape (truncated file?)",
    }
    for cut, words in expected.items():
        f.write_bytes(data[:cut])
        (problem,) = _problems(f)
        assert words in problem, (cut, problem)


def test_inspect_says_complete_and_refuses_an_incomplete_checkpoint(tmp_path: Path) -> None:
    ok = CliRunner().invoke(cli, ["inspect", str(OLMO / "step20")])
    assert ok.exit_code == 0 and "  files: complete" in ok.output
    doc = json.loads(CliRunner().invoke(cli, ["inspect", str(OLMO / "step20"), "--json"]).stdout)
    assert doc["completeness"]["complete"] is True and "written last" in doc["completeness"]["rule"]
    step = _copy(OLMO / "step20", tmp_path)
    (step / "model_and_optim" / "__0_1.distcp").unlink()
    bad = CliRunner().invoke(cli, ["inspect", str(step)])
    assert bad.exit_code == 2
    assert bad.stderr.strip().splitlines() == [
        f"error: {step}: incomplete dcp checkpoint: model_and_optim/__0_1.distcp missing (named in .metadata). Pass a complete checkpoint (an earlier step)"
    ]
    with pytest.raises(IncompleteCheckpoint):
        require_complete(step)
