"""Pairwise streaming diff of two checkpoints: per-tensor statistics of weights and Adam moments.

Tensors are streamed in flat chunks, so memory stays near a few chunks whatever the
checkpoint size; every statistic is a sum, count or max that composes across chunks.
Element-level evidence (bound violations) keeps at most `max_candidates` per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptforensics.core.errors import IncompatibleCheckpoints, doing
from ckptforensics.engine.diff import (
    Candidate,
    DiffConfig,
    DiffResult,
    PairInfo,
    TensorDiff,
    diff_tensor,
    load_kernels,
    prefetch,
    scalar,
    shard,
    tensor_role,
)
from ckptforensics.engine.diff.records import optimizer_steps
from ckptforensics.formats import integrity
from ckptforensics.formats.base import Checkpoint
from ckptforensics.formats.optstate import FAMILIES
from ckptforensics.optim import bnb
from ckptforensics.trainers import skip_optimizer
from ckptforensics.trainers.fused import experts_from_config, heads_from_config

__all__ = [
    "DiffConfig",
    "Candidate",
    "TensorDiff",
    "PairInfo",
    "DiffResult",
    "diff_checkpoints",
    "tensor_role",
]

log = logging.getLogger(__name__)


def _pair_info(a: Checkpoint, b: Checkpoint) -> PairInfo:
    oa, ob = a.optimizer, b.optimizer
    notes = [f"before: {n}" for n in a.notes] + [f"after: {n}" for n in b.notes]
    if (oa is None) != (ob is None):
        notes.append("optimizer state present on one side only: weights-only diff")
    weights_only = oa is None or ob is None
    unknown = [o.kind for o in (oa, ob) if o is not None and not _known(o.kind)]
    if unknown:
        # An optimizer the tool does not know: its state is read but not judged; the
        # weights are still compared among peers (isolated changes located by bit flips).
        notes.append(
            f"optimizer {unknown[0].removeprefix('unknown:')!r} is not one the tool knows (known: {', '.join(FAMILIES)}): "
            "weights-only diff, its state not checked against any update bound"
        )
        weights_only = True
    if not weights_only and oa.kind != ob.kind:  # type: ignore[union-attr]
        raise IncompatibleCheckpoints(
            f"optimizer kinds differ: {a.path} has {oa.kind}, {b.path} has {ob.kind}; "  # type: ignore[union-attr]
            "compare checkpoints of the same run"
        )
    if not weights_only and len(oa.groups) != len(ob.groups):  # type: ignore[union-attr]
        raise IncompatibleCheckpoints(
            f"param groups differ: {len(oa.groups)} in {a.path}, {len(ob.groups)} in {b.path}"  # type: ignore[union-attr]
        )

    if not weights_only and ob is not None and any(g.family == "adam8bit" for g in ob.groups):
        notes.append(_quantised_note(ob))

    betas = ob.groups[0].betas if ob and ob.groups else None
    base = tuple(g.max_lr or g.initial_lr for g in (ob.groups if ob else []))
    if ob and all(x is None for x in base):
        peak = (b.scalars.get("train_config") or {}).get("learning_rate")
        if isinstance(peak, (int, float)):
            base = tuple(float(peak) for _ in ob.groups)
    return PairInfo(
        step_a=a.step,
        step_b=b.step,
        adam_step_a=optimizer_steps(oa),
        adam_step_b=optimizer_steps(ob),
        loss_scale_a=scalar(a.scalars.get("loss_scale")),
        loss_scale_b=scalar(b.scalars.get("loss_scale")),
        lr_a=tuple(g.lr for g in oa.groups) if oa else (),
        lr_b=tuple(g.lr for g in ob.groups) if ob else (),
        base_lr=base,
        warmup_iters=_warmup(b),
        optimizer=ob.kind if ob else None,
        betas=betas,
        weights_only=weights_only,
        notes=tuple(notes),
        skip_optimizer=skip_optimizer(b),
        scheduler_a=_dict(a.scalars.get("scheduler")),
        scheduler_b=_dict(b.scalars.get("scheduler")),
        scaler_a=_dict(a.scalars.get("scaler")),
        scaler_b=_dict(b.scalars.get("scaler")),
        heads=heads_from_config(b.config if isinstance(b.config, dict) else None),
        n_experts=experts_from_config(b.config if isinstance(b.config, dict) else None),
    )


def _quantised_note(o: Any) -> str:
    """What the diff does with bitsandbytes' 8-bit state (formats.bnb)."""

    quant = [n for n, st in o.state.items() if bnb.is_quantised(st)]
    lost = [n for n in quant if "exp_avg_sq" not in o.state[n]]
    if lost:
        return (
            f"bitsandbytes 8-bit optimizer state: {len(lost)} of {len(quant)} quantised tensors could not be dequantised "
            f"(first: {lost[0]}; no qmap, or absmax that fits no block size): those are compared weights-only"
        )
    return (
        f"bitsandbytes 8-bit optimizer state: {len(quant)} quantised tensors' moments dequantised (qmap[code] x blockwise absmax); "
        "their second-moment floor allows k code gaps of the block's absmax, their weights have no per-element bound "
        "(located among the tensor's own changes); tensors under min_8bit_size keep Adam's bounds"
    )


def _dict(x: Any) -> dict[str, Any] | None:
    return dict(x) if isinstance(x, dict) else None


def _known(kind: str) -> bool:
    """Every family of a (possibly '+'-joined) optimizer kind is one the tool knows."""
    return all(k in FAMILIES or k == "none" for k in kind.split("+"))


def _check_compatible(a: Checkpoint, b: Checkpoint) -> list[str]:
    na, nb = set(a.names()), set(b.names())
    if na != nb:
        missing = sorted(na - nb)
        extra = sorted(nb - na)
        parts = []
        if missing:
            parts.append(f"{len(missing)} only in before (first: {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} only in after (first: {extra[0]})")
        raise IncompatibleCheckpoints(
            f"parameter sets differ between {a.path} and {b.path}: {'; '.join(parts)}; "
            "compare two checkpoints of the same model"
        )
    for n in a.names():
        ma, mb = a.meta(n), b.meta(n)
        if ma.shape != mb.shape:
            raise IncompatibleCheckpoints(
                f"{n}: shape {list(ma.shape)} in {a.path} but {list(mb.shape)} in {b.path}"
            )
    return a.names()


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    config: DiffConfig | None = None,
    progress: Callable[[str], None] | None = None,
    *,
    workers: int = 1,
    distributed: bool = False,
) -> DiffResult | None:
    """Diff two checkpoints tensor by tensor.

    Args:
        a: the *before* checkpoint.
        b: the *after* checkpoint.
        config: options; defaults suit multi-GB pairs.
        progress: called with each tensor's name as it is streamed (or finished).
        workers: processes sharing the tensors (1: this process only).
        distributed: this process is one torchrun rank (torch.distributed initialised):
            it diffs its share, and rank 0 gathers everything.

    Returns:
        DiffResult with pair info and one TensorDiff per tensor, in checkpoint order;
        None on the ranks other than 0.

    Raises:
        IncompatibleCheckpoints: different parameter sets, shapes or optimizers.
    """

    cfg = config or DiffConfig()
    names = _check_compatible(a, b)
    pair = _pair_info(a, b)
    mine = names
    if distributed:
        import torch.distributed as dist

        mine = shard.balanced(names, [a.meta(n).numel for n in names], dist.get_world_size())[
            dist.get_rank()
        ]
    load_kernels(cfg)  # compiled (or loaded from the cache) once, before workers fork
    error: Exception | None = None
    local: list[TensorDiff] = []
    try:
        if workers > 1 and len(mine) > 1:
            local = shard.diff_in_workers(a, b, mine, pair, cfg, min(workers, len(mine)), progress)
        else:
            with shard.single_threaded():
                local = _diff_serial(a, b, mine, pair, cfg, progress)
        # The zip members no chunk finished: one flat buffer read in part by several
        # tensors, Adam's step counters read as numbers (`integrity.settle`).
        integrity.settle([a.path, b.path])
    except Exception as e:  # under torchrun, any failure goes to every rank (`gather_to_rank0`)
        if not distributed:
            raise
        error = e
    if distributed:
        gathered = shard.gather_to_rank0(local, error, names)
        if gathered is None:
            return None
        local = gathered
    return DiffResult(pair=pair, tensors=local)


def _diff_serial(
    a: Checkpoint,
    b: Checkpoint,
    names: list[str],
    pair: PairInfo,
    cfg: DiffConfig,
    progress: Callable[[str], None] | None,
) -> list[TensorDiff]:
    out = []
    # A helper thread asks the OS to read the next tensors while this one is computed
    # on; the main thread never waits for it (a page not yet read simply faults in).
    ahead = 1
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch") as pool:
        for n in names[:ahead]:
            pool.submit(prefetch, a, b, n)
        for i, name in enumerate(names):
            if progress is not None:
                progress(name)
            if i + ahead < len(names):
                pool.submit(prefetch, a, b, names[i + ahead])
            with doing(f"diffing tensor {name}"):
                out.append(diff_tensor(a, b, name, pair, cfg))
    return out


def _warmup(ck: Checkpoint) -> int | None:
    """The warmup length the run's config records (nanoGPT `warmup_iters`; HF and Megatron
    readers normalise theirs to it)."""
    w = (ck.scalars.get("train_config") or {}).get("warmup_iters")
    return int(w) if isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 else None
