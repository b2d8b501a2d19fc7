"""`diff`: the pair's weights and optimizer moments streamed and scored, one verdict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptforensics.checkpoints import open_checkpoint, open_pair
from ckptforensics.commands.common import (
    NotRankZero,
    Progress,
    Report,
    window,
)
from ckptforensics.detectors import Finding, diff_findings
from ckptforensics.engine.diff.pair import DiffConfig, DiffResult, diff_checkpoints
from ckptforensics.engine.diff.shard import (
    checkpoint_bytes,
    compute_device,
    default_workers,
    destroy_process_group,
    dist_world,
    init_process_group,
)
from ckptforensics.engine.replay import distributed
from ckptforensics.report import (
    build_report,
)
from ckptforensics.verdict import decide


def diff(
    before: str | int | Path,
    after: str | int | Path,
    *,
    run_dir: str | Path | None = None,
    format: str | None = None,
    chunk: int = 1 << 19,
    workers: int | None = None,
    progress: Progress | None = None,
    command: str = "ckptforensics.diff",
    device: str = "cpu",
) -> Report:
    """Diff weights and Adam moments of two checkpoints and score every tensor (`workers`
    processes; None: one per core, at most 8, for pairs of 512 MiB and more, else one: the
    report does not depend on it). `device` 'cuda': the statistics on this process's GPU,
    each chunk read on the host and staged through a pinned buffer (one process feeds it;
    under torchrun, each rank its LOCAL_RANK's GPU)."""

    dev = compute_device(device)
    pa, pb = window(before, after, run_dir)
    n = (
        1
        if dev != "cpu"
        else workers or default_workers(checkpoint_bytes(pa) + checkpoint_bytes(pb))
    )
    got = run_diff(
        pa, pb, command=command, fmt=format, chunk=chunk, progress=progress, workers=n, device=dev
    )
    if got is None:
        raise NotRankZero("diff under torchrun: rank 0 returns the report")
    return Report(*got)


def _diff(
    a_path: Path,
    b_path: Path,
    fmt: str | None,
    chunk: int,
    progress: Progress | None,
    workers: int = 1,
    device: str = "cpu",
) -> tuple[Any, Any, DiffResult, list[Finding]]:
    a, b = open_pair(a_path, b_path, fmt)
    result = diff_checkpoints(
        a, b, DiffConfig(chunk_elems=chunk, device=device), progress=progress, workers=workers
    )
    assert result is not None
    return a, b, result, diff_findings(result)


def run_diff(
    a_path: Path,
    b_path: Path,
    *,
    command: str,
    fmt: str | None = None,
    chunk: int = 1 << 19,
    progress: Progress | None = None,
    workers: int = 1,
    device: str = "cpu",
) -> tuple[dict[str, Any], list[Finding]] | None:
    """`ckptforensics diff`: the report document and its findings (`device`: where the
    statistics are computed, `shard.compute_device`'s; a GPU is fed by one process).

    Under torchrun (WORLD_SIZE > 1) every rank streams its share of the tensors and
    rank 0 gathers the statistics and returns the report; the other ranks return None.
    """

    rank, world = dist_world()
    if world == 1:
        a, b, result, findings = _diff(a_path, b_path, fmt, chunk, progress, workers, device)
    else:
        own = not dist.is_initialized()
        if own:
            init_process_group("gloo")
        settled = False
        try:
            a, b = open_pair(a_path, b_path, fmt)
            got = diff_checkpoints(
                a,
                b,
                DiffConfig(chunk_elems=chunk, device=device),
                progress=progress,
                workers=workers,
                distributed=True,
            )
            settled = True
        finally:
            if own:
                destroy_process_group(settled=settled)
        if got is None:
            a.close()
            b.close()
            return None
        result, findings = got, diff_findings(got)
    try:
        before_ok = not any(t.nonfinite_a for t in result.tensors)
        verdict = decide(
            findings,
            before=str(a_path),
            after=str(b_path),
            before_healthy=before_ok,
            weights_only=result.pair.weights_only,
        )
        doc = build_report(
            command=command, before=a, after=b, verdict=verdict, findings=findings, diff=result
        )
    finally:
        a.close()
        b.close()
    return doc, findings


# The pair's diff under torchrun on ranks other than 0, which gather nothing.
NOT_RANK_ZERO: Any = object()


def pair_diff(cfg: Any) -> tuple[Any, Any, Any, list[Finding]]:
    """The window's checkpoints, open, and their diff (None without *after*; under
    torchrun the ranks share its tensors and the others than rank 0 get `NOT_RANK_ZERO`)."""

    if cfg.after is None:
        a = open_checkpoint(cfg.before)
        return a, a, None, []
    if distributed.current() is None:
        return _diff(cfg.before, cfg.after, None, 1 << 19, None)
    a, b = open_pair(cfg.before, cfg.after)
    got = diff_checkpoints(a, b, DiffConfig(chunk_elems=1 << 19), distributed=True)
    return (a, b, NOT_RANK_ZERO, []) if got is None else (a, b, got, diff_findings(got))
