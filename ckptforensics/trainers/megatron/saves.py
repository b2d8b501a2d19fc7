"""Megatron's saves as they lie on disk: the rule for a complete legacy or torch_dist save, the
tracker file (`latest_checkpointed_iteration.txt`) and the save dir that stands for the
iteration it names; the readers registered with `formats`."""

from __future__ import annotations

import re
from pathlib import Path

from ckptforensics.core.errors import (
    CheckpointNotFound,
    ForensicsError,
)
from ckptforensics.formats import register, register_resolver
from ckptforensics.formats.base import (
    Completeness,
    json_problem,
)
from ckptforensics.formats.dcp import dcp_files_problems
from ckptforensics.formats.torchfile import load_torch_file, torch_file_problem
from ckptforensics.trainers.megatron.checkpoint import (
    TRACKER,
    is_megatron_dir,
    is_megatron_dist_dir,
    iter_of,
    open_megatron,
    open_megatron_dist,
)

_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?$")
_LEGACY_RULE = (
    "a Megatron checkpoint: model_optim_rng.pt (and distrib_optim.pt, with the distributed optimizer) in every "
    "mp_rank_TT[_PPP] dir of the tensor x pipeline parallel grid its args record, each a whole torch.save file; "
    f"{TRACKER}, written once every rank has saved, naming this iteration or a later one"
)
_DIST_RULE = (
    "a Megatron torch_dist checkpoint: metadata.json, .metadata and every __R_I.distcp it names, as long as the "
    f"chunks it places there (common.pt, where there is one, whole); {TRACKER} naming this iteration or a later one"
)


def megatron_completeness(path: Path) -> Completeness:
    """Legacy `iter_N/mp_rank_*/model_optim_rng.pt`: the whole TP x PP grid of rank dirs,
    each file whole (zip end records), and a tracker that does not lag behind."""
    problems = _tracker_problems(path)
    dirs = {
        (int(m.group(1)), int(m.group(2) or 0)): d
        for d in path.iterdir()
        if (m := _RANK_DIR.match(d.name)) and d.is_dir()
    }
    whole = [
        b
        for d in sorted(dirs.values())
        if (b := torch_file_problem(d / "model_optim_rng.pt", path))
    ]
    problems += whole
    distrib = any((d / "distrib_optim.pt").exists() for d in dirs.values())
    if distrib:
        problems += [
            b
            for d in sorted(dirs.values())
            if (b := torch_file_problem(d / "distrib_optim.pt", path))
        ]
    tp, pp = 1 + max((t for t, _ in dirs), default=0), 1 + max((p for _, p in dirs), default=0)
    first = dirs.get((0, 0))
    if first is not None and not whole:
        try:
            obj, _ = load_torch_file(first / "model_optim_rng.pt")  # memory-mapped: the pickle only
            args = obj.get("args") if isinstance(obj, dict) else None
            tp = int(getattr(args, "tensor_model_parallel_size", tp) or tp)
            pp = int(getattr(args, "pipeline_model_parallel_size", pp) or pp)
        except ForensicsError as e:
            problems.append(str(e))
    pipelined = pp > 1 or any(d.name.count("_") == 3 for d in dirs.values())
    for t in range(tp):
        for p in range(pp):
            if (t, p) not in dirs:
                name = f"mp_rank_{t:02d}_{p:03d}" if pipelined else f"mp_rank_{t:02d}"
                problems.append(
                    f"{name}/ missing (tensor x pipeline parallel {tp} x {pp} in the args)"
                )
    extra = sorted(k for k in dirs if k[0] >= tp or k[1] >= pp)
    if extra:
        problems.append(
            f"{dirs[extra[0]].name}/ lies outside the {tp} x {pp} parallel grid the args record: mismatched world sizes"
        )
    return Completeness("megatron", _LEGACY_RULE, tuple(problems))


def megatron_dist_completeness(path: Path) -> Completeness:
    """torch_dist `iter_N/`: metadata.json (written last), the DCP files, common.pt whole
    where there is one, and a tracker that does not lag behind."""

    problems = _tracker_problems(path)
    bad = json_problem(path / "metadata.json", path)
    if bad is not None:
        problems.append(
            f"{bad} (Megatron writes it once every rank has saved)"
            if bad.endswith("missing")
            else bad
        )
    files = dcp_files_problems(path, path)
    problems += files
    common = (
        path / "common.pt"
    )  # megatron-core <= 0.18 (0.19 keeps it in .metadata); the reader does without
    if common.exists() or common.is_symlink():
        bad = torch_file_problem(common, path)
        if bad is not None:
            problems.append(bad)
    return Completeness("megatron-dist", _DIST_RULE, tuple(problems))


def _tracker_problems(iter_dir: Path) -> list[str]:
    """The save dir's tracker must name this iteration or a later one: Megatron writes it
    once every rank has saved. Without one (an iteration dir copied on its own) the
    iteration is judged by its own files."""
    it = iter_of(iter_dir)
    tracker = iter_dir.parent / TRACKER
    if it is None or not tracker.is_file():
        return []
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return [f"../{TRACKER}: unreadable"]
    if text.isdigit() and int(text) < it:
        return [
            f"newer than ../{TRACKER} ({int(text)}): Megatron writes it once every rank has saved, so this save did not finish"
        ]
    return []


def _megatron_latest(path: Path) -> Path:
    """A Megatron save dir stands for its latest iteration (`latest_checkpointed_iteration.txt`),
    as a DeepSpeed save dir stands for the tag in `latest`.

    Raises:
        CheckpointNotFound: the tracker names an iteration that is not there.
    """
    marker = path / TRACKER
    if path.is_dir() and marker.is_file():
        text = marker.read_text().strip()
        if text.isdigit():
            it = path / f"iter_{int(text):07d}"
            if not it.is_dir():
                have = sorted(d.name for d in path.glob("iter_*") if d.is_dir())
                raise CheckpointNotFound(
                    f"{marker} names iteration {int(text)}, but {it.name}/ is not there (found: {', '.join(have[-6:]) or 'no iter_* dirs'}); "
                    "pass one of the iterations that are"
                )
            return it
    return path


register(
    "megatron-dist",
    open_megatron_dist,
    lambda p: p.is_dir() and is_megatron_dist_dir(p),
    order=10,
    complete=megatron_dist_completeness,
)
register(
    "megatron",
    open_megatron,
    lambda p: p.is_dir() and is_megatron_dir(p),
    order=40,
    complete=megatron_completeness,
)
register_resolver(_megatron_latest)
