"""Sharing a diff's tensors: across worker processes (`--workers`), and across
torchrun ranks, where each rank streams its share and rank 0 gathers the statistics.

Tensors are independent, so the work splits by tensor: a balanced partition by bytes
(largest first onto the least-loaded share) keeps the shares within one tensor of each
other. Every worker opens the checkpoints itself (read-only, lazily); only the small
per-tensor statistics travel back.
"""

from __future__ import annotations

import heapq
import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

from ckptforensics.checkpoints import open_checkpoint, settle_pair
from ckptforensics.core.errors import Failed, ForensicsError, doing, one_line
from ckptforensics.engine.diff import diff_tensor

__all__ = [
    "balanced",
    "dist_world",
    "init_process_group",
    "destroy_process_group",
    "joined_a_group",
    "leave_rank",
    "default_workers",
    "checkpoint_bytes",
    "single_threaded",
    "diff_in_workers",
    "gather_to_rank0",
]

log = logging.getLogger(__name__)


def default_workers(total_bytes: int) -> int:
    """Worker processes when --workers is not given: one per core (at most 8) for pairs
    of 512 MiB and more; below that, starting processes costs more than it saves."""
    return max(1, min(8, os.cpu_count() or 1)) if total_bytes >= 512 << 20 else 1


def checkpoint_bytes(path: Path) -> int:
    """Size on disk of a checkpoint file or directory (what `default_workers` weighs)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@contextmanager
def single_threaded() -> Iterator[None]:
    """torch on one thread while diffing: a sum's rounding depends on how many threads
    split it, and a report must not depend on --workers or the number of ranks.
    Parallelism comes from processes instead."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def balanced(names: Sequence[str], sizes: Sequence[int], parts: int) -> list[list[str]]:
    """Split `names` into `parts` shares of near-equal total size; each share keeps the
    checkpoint's order (so its reads stay sequential)."""
    heap = [(0, i) for i in range(parts)]
    owner: dict[str, int] = {}
    for size, name in sorted(zip(sizes, names, strict=True), key=lambda x: -x[0]):
        load, i = heapq.heappop(heap)
        owner[name] = i
        heapq.heappush(heap, (load + size, i))
    return [[n for n in names if owner[n] == i] for i in range(parts)]


def dist_world() -> tuple[int, int]:
    """(rank, world size) under torchrun (its environment variables), else (0, 1)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0, 1
    return (rank, world) if world > 1 else (0, 1)


def compute_device(device: str) -> str:
    """Where a diff's statistics (or a replay) are computed: 'cpu', or 'cuda' as this
    process's GPU (under torchrun, its LOCAL_RANK's). A CUDA device torch cannot use is bad
    input, said before anything is read."""
    if not device.startswith("cuda"):
        return device
    import torch

    if not torch.cuda.is_available():
        raise ForensicsError(
            f"--device {device}: this torch ({torch.__version__}) sees no CUDA device; "
            "run without it (the CPU path) or on a machine with a GPU"
        )
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def init_process_group(backend: str, **kwargs: Any) -> None:
    """`torch.distributed.init_process_group`, with the modules that capture the default
    group imported first.

    Reading DCP metadata imports `torch.distributed.checkpoint`, and through it
    `torch.distributed.nn`, whose functions take `group=group.WORLD` as a default evaluated
    at import. Imported after the group exists, they hold it: `destroy_process_group` then
    cannot free it, and its gloo worker threads outlive the interpreter. A worker still
    releasing a collective's tensors while Python finalises is a `std::terminate`
    (SIGABRT) at exit, about one torchrun diff in 16 on a loaded 2-core machine.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401 - see the docstring

    dist.init_process_group(backend, **kwargs)
    _JOINED[0] = True


_JOINED = [False]  # whether this process created a process group (see `leave_rank`)


def joined_a_group() -> bool:
    """Whether this process created a torch.distributed process group (`init_process_group`)."""
    return _JOINED[0]


def leave_rank(code: object) -> NoReturn:
    """End a torchrun rank's process with exit status `code` (as `sys.exit` reads it), after
    the `atexit` handlers and a flush of its streams, without Python's finalisation.

    `destroy_process_group` does not stop gloo's worker threads; only freeing the group
    does, and a sharded model's meshes stay in DTensor's sharding caches until the
    interpreter ends. Finalisation then ends any worker that still holds a collective's
    tensors and needs the GIL to drop them: `std::terminate`, SIGABRT, a failed rank after
    a finished job (CI saw it in two runs). The work is done and written by now: skipping
    finalisation loses nothing the atexit handlers and the flush do not cover.
    """
    import atexit
    import sys

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message to stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):  # closed, or a broken pipe: nothing to say
                stream.flush()
        os._exit(status)


def destroy_process_group(*, settled: bool) -> None:
    """`torch.distributed.destroy_process_group`, after a barrier when every rank got here
    (`settled`).

    A gloo worker thread drops its last collective's tensors after the caller has its
    result; if those tensors' Python objects are gone by then, the drop needs the GIL, and
    a process already finalising ends the thread there: `std::terminate`, SIGABRT at exit.
    A barrier as the last collective leaves the workers only itself to drop, which holds
    no tensors. On a failure path a rank may be gone, so there is no barrier to wait on.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if settled:
        try:
            dist.barrier()
        except RuntimeError as e:  # a rank that failed after its last collective left
            log.debug("barrier before leaving the process group: %s", e)
    dist.destroy_process_group()


# ------------------------------------------------------------------ worker processes
_STATE: dict[str, Any] = {}


def _init(a: tuple[str, str], b: tuple[str, str], pair: Any, cfg: Any) -> None:
    import torch

    torch.set_num_threads(1)
    ca, cb = open_checkpoint(a[0], a[1]), open_checkpoint(b[0], b[1])
    settle_pair(ca, cb)
    _STATE.update(a=ca, b=cb, pair=pair, cfg=cfg)


def _init_forked() -> None:
    import torch

    torch.set_num_threads(1)


def _one(name: str) -> tuple[str, Any, str | None]:

    try:
        with doing(f"diffing tensor {name}"):
            return (
                name,
                diff_tensor(_STATE["a"], _STATE["b"], name, _STATE["pair"], _STATE["cfg"]),
                None,
            )
    except ForensicsError as e:  # errors cross the process boundary as text
        return name, None, str(e)


def diff_in_workers(
    a: Any,
    b: Any,
    names: Sequence[str],
    pair: Any,
    cfg: Any,
    workers: int,
    progress: Callable[[str], None] | None = None,
) -> list[Any]:
    """TensorDiffs for `names` (in that order), computed by `workers` processes."""
    sizes = {n: a.meta(n).numel for n in names}
    log.info("diffing %d tensors in %d worker processes", len(names), workers)
    if "fork" in mp.get_all_start_methods():
        # Forked workers inherit the open, memory-mapped checkpoints (no re-open, no
        # re-import); each sets torch to one thread first, as DataLoader workers do.
        _STATE.update(a=a, b=b, pair=pair, cfg=cfg)
        ctx, init, initargs = mp.get_context("fork"), _init_forked, ()
    else:
        ctx, init, initargs = (
            mp.get_context("spawn"),
            _init,
            ((str(a.path), a.format), (str(b.path), b.format), pair, cfg),
        )
    try:
        return _run_pool(ctx, init, initargs, names, sizes, workers, progress)
    except BrokenProcessPool:
        raise ForensicsError(
            f"a diff worker process died (killed by a signal, or out of memory) diffing {a.path} and {b.path}; rerun with --workers 1"
        ) from None
    finally:
        _STATE.clear()


def _run_pool(
    ctx: Any,
    init: Any,
    initargs: tuple,
    names: Sequence[str],
    sizes: dict[str, int],
    workers: int,
    progress: Callable[[str], None] | None,
) -> list[Any]:
    out: dict[str, Any] = {}
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=init, initargs=initargs) as pool:
        # Largest first, so no worker is left with a big tensor at the end.
        futs = [pool.submit(_one, n) for n in sorted(names, key=lambda n: -sizes[n])]
        pending = set(futs)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                name, td, err = f.result()
                if err is not None:
                    for p in pending:
                        p.cancel()
                    raise ForensicsError(err)
                out[name] = td
                if progress is not None:
                    progress(name)
    return [out[n] for n in names]


# ------------------------------------------------------------------ torchrun ranks
def gather_to_rank0(
    local: list[Any], error: BaseException | None, names: Sequence[str]
) -> list[Any] | None:
    """Rank 0: every rank's TensorDiffs in checkpoint order; other ranks: None.

    A rank that failed (bad input or a fault) sends its one line (`errors.one_line`)
    instead; every rank then raises the first one, so no rank waits forever on one that
    stopped, and every rank prints the same line with the same exit code.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = one_line(error) if error is not None else None
    parts: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object((local if error is None else [], mine), parts if rank == 0 else None, dst=0)
    # Rank 0 tells everyone whether the whole diff succeeded.
    errors = [e for _, e in parts if e] if rank == 0 else []
    verdict = [errors[0] if errors else None]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        code, line = verdict[0]
        if error is not None and (code, line) == mine:
            raise error  # this rank's own failure: its traceback stays for --debug
        raise Failed(line, code)
    if rank != 0:
        return None
    by_name = {t.name: t for tensors, _ in parts for t in tensors}
    return [by_name[n] for n in names]
