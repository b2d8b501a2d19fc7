"""Replay across torchrun ranks: the model sharded with FSDP2, each rank's rows, one gather a pass.

Under `torchrun` every rank builds the model with its parameters on the meta device,
shards it with PyTorch's own FSDP2 (`fully_shard` on every block, then the root) and reads
into its shards only the rows of *before* it owns (dim 0, as FSDP2 splits it), weights and
Adam moments alike, so no rank ever holds the whole model or its optimizer state. Each rank
takes a contiguous block of the step's global batch (the order in which the flight recorder
and the Trainer's distributed sampler lay out rank 0's rows first). Gradients are summed
across ranks (FSDP2's divide factor set to 1): every rank scales its loss by the *global*
denominator, so the summed gradient is the single-process one.

Statistics stay per rank until the end of a pass, then travel in one collective.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch import nn

from ckptforensics.core.errors import Failed, one_line
from ckptforensics.engine.diff.shard import destroy_process_group, dist_world, init_process_group

__all__ = [
    "Ranks",
    "OneProcess",
    "World",
    "world_of",
    "current",
    "start",
    "stop",
    "joined",
    "agree",
    "params_on_meta",
    "checkpoint_blocks",
    "shard_model",
    "materialize",
    "local_rows",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place among the torchrun ranks.

    Attributes:
        rank, world: this rank and the number of ranks.
        mesh: the one-dimensional device mesh FSDP2 shards over.
        device: this rank's device (cpu, or cuda:LOCAL_RANK).
    """

    rank: int
    world: int
    mesh: Any
    device: torch.device

    def row_range(self, n: int) -> tuple[int, int]:
        """[start, stop) of dim 0 this rank owns of a length-n dimension: FSDP2's split
        (torch.chunk: ceil(n / world) rows a rank, the last ranks short or empty)."""
        per = -(-n // self.world)
        start = min(self.rank * per, n)
        return start, min(start + per, n)

    def my_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's contiguous block of the global batch's rows (rank 0's first, as the
        run's ranks consumed them)."""
        b = next(iter(batch.values())).shape[0]
        lo, hi = row_block(b, self.world, self.rank)
        return {k: v[lo:hi] for k, v in batch.items()}

    def describe(self) -> dict[str, Any]:
        return {
            "world_size": self.world,
            "rows": "each rank a contiguous block of the global batch, rank 0's first",
            "parameters": "FSDP2 fully_shard per block, then the root; dim-0 shards, gradients summed",
            "backend": "nccl" if self.device.type == "cuda" else "gloo",
        }

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """Every rank's `flat` (1-D, same length everywhere) as [world, n]: one collective
        (on this rank's device, as NCCL needs; returned where `flat` was)."""
        import torch.distributed as dist

        x = flat.to(self.device).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        return torch.stack(parts).to(flat.device)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` summed (one all-reduce), returned where `x` was."""
        import torch.distributed as dist

        y = x.to(self.device, copy=True)
        dist.all_reduce(y)
        return y.to(x.device)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x`, elementwise maximum (one all-reduce), returned where `x` was."""
        import torch.distributed as dist

        y = x.to(self.device, copy=True)
        dist.all_reduce(y, op=dist.ReduceOp.MAX)
        return y.to(x.device)

    def objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, rank order (small records only)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


@dataclass(frozen=True, slots=True)
class OneProcess:
    """One process as a world of one rank: `Ranks`'s rows and reductions, each the
    identity, so that a replay step is written once and meets the other ranks' figures
    only at its reductions (as torchtitan writes a training step)."""

    device: torch.device
    rank: int = 0
    world: int = 1

    def row_range(self, n: int) -> tuple[int, int]:
        return 0, n

    def my_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.unsqueeze(0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def objects(self, obj: Any) -> list[Any]:
        return [obj]


# Whom a replay's reductions run over: the torchrun ranks, or one process.
World = Ranks | OneProcess


def world_of(device: str | torch.device) -> World:
    """The torchrun ranks this process replays with, or one process on `device`."""
    return current() or OneProcess(torch.device(device))


def row_block(n: int, world: int, rank: int) -> tuple[int, int]:
    """Contiguous, near-equal blocks: the first n % world ranks take one row more."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


_CURRENT: list[Ranks] = []


def current() -> Ranks | None:
    """The ranks this process replays with (None: one process)."""
    return _CURRENT[0] if _CURRENT else None


def start(device: str) -> Ranks | None:
    """Join the torchrun job when WORLD_SIZE > 1 (gloo on CPU, NCCL with one GPU a rank).

    Returns None outside torchrun. The process group is this module's until `stop()`.
    """

    rank, world = dist_world()
    if world == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # A rank that stops without a word must not leave the others waiting for long.
        init_process_group(
            backend,
            timeout=timedelta(minutes=int(os.environ.get("CKPTFORENSICS_DIST_TIMEOUT_MIN", "30"))),
        )
    mesh = init_device_mesh(dev.type, (world,))
    _return_freed_memory()
    ranks = Ranks(rank=rank, world=world, mesh=mesh, device=dev)
    _CURRENT[:] = [ranks]
    log.info("rank %d of %d on %s (%s)", rank, world, dev, backend)
    return ranks


# glibc's M_MMAP_THRESHOLD (mallopt parameter -3).
_M_MMAP_THRESHOLD = -3


def _return_freed_memory() -> None:
    """Have glibc give freed tensors' memory back to the system at once.

    glibc raises its mmap threshold (up to 32 MiB) each time a block above it is freed;
    from then on tensors of that size come from the heap, and memory they free stays with
    the process. A rank lives in a memory budget: on bench/scale.py's 143 M-parameter model
    this kept 240 MiB more per rank after a step and raised its peak by 290 MiB (1912 vs
    1622 MiB). A fixed 1 MiB threshold maps every large tensor and unmaps it when freed.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
    except OSError:  # not glibc: nothing to tune
        pass


@contextlib.contextmanager
def joined(device: str) -> Iterator[Ranks | None]:
    """`start` for the length of a command, then `stop` (None and nothing to stop outside torchrun)."""
    ranks = start(device)
    settled = False
    try:
        yield ranks
        settled = True
    finally:
        if ranks is not None:
            stop(settled=settled)


def stop(*, settled: bool = False) -> None:
    """Leave the process group: after a barrier when every rank finished (`settled`),
    at once on a failure path (`shard.destroy_process_group`)."""

    _CURRENT.clear()
    destroy_process_group(settled=settled)


def agree(ranks: Ranks | None, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it failed on any rank (bad input or a fault), raise the
    first failing rank's one line (`errors.one_line`) on every rank, so that no rank waits
    forever on one that stopped and every rank prints the same line and exit code."""
    if ranks is None:
        return fn()
    err: tuple[int, str] | None = None
    out: Any = None
    try:
        out = fn()
    except Exception as e:
        err = one_line(e)
        mine: Exception | None = e
    else:
        mine = None
    errors = [e for e in ranks.objects(err) if e]
    if errors:
        if mine is not None and tuple(errors[0]) == err:
            raise mine  # this rank's own failure: its traceback stays for --debug
        raise Failed(errors[0][1], errors[0][0])
    return out


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build a model whose parameters live on the meta device (no memory) while its
    buffers stay real: a rotary table or causal mask computed in `__init__` is kept, and
    FSDP2 then allocates only each rank's shard of every parameter."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: members of a ModuleList that hold parameters (torchtitan
    and every HF, Megatron and OLMo-core model keep their layers so)."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            out.extend(c for c in m if any(True for _ in c.parameters()))
    return out


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing per block (non-reentrant `torch.utils.checkpoint`): each
    block keeps its input only and recomputes the rest in the backward pass. The block's
    own `forward` is wrapped in place, so module and parameter names stay the model's
    (a wrapper module would rename them) and FSDP2 still shards the block around it.
    Probes see the recomputation as a second forward of the same values. Returns the
    number of blocks."""
    import functools

    from torch.utils.checkpoint import checkpoint

    blocks = _blocks(model)
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]
    return len(blocks)


def shard_model(model: nn.Module, ranks: Ranks, bf16_params: bool = False) -> int:
    """FSDP2 over `model` in place: `fully_shard` per block, then the root; gradients
    summed, not averaged, across ranks. With `bf16_params`, torchtitan's default policy
    (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`): FSDP2 itself
    computes on bf16 copies of the fp32 shards and reduces the gradients in fp32.
    Returns the number of blocks sharded."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16_params
        else MixedPrecisionPolicy()
    )
    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block, mesh=ranks.mesh, mp_policy=policy)
    fully_shard(model, mesh=ranks.mesh, mp_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # gloo has no pre-multiplied sum: a plain sum is what a divide factor of 1 means.
            m.set_force_sum_reduction_for_comms(True)
    return len(blocks)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 module's unsharded parameters (`FSDPModule.reshard`), as after a
    training step: a forward without gradients leaves the root unsharded, and under a
    MixedPrecisionPolicy the next backward then leaves the root's sharded parameters
    without gradients (measured: torch 2.13, gloo)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the shards on `device` (uninitialised: the checkpoint fills them), keeping
    the buffers the model computed when it was built."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def local_rows(
    ranks: World,
    p: torch.Tensor,
    stored: tuple[int, ...],
    read_rows: Callable[[int, int], torch.Tensor],
    read_full: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """This rank's shard of a tensor for the DTensor `p`: only the shard's rows are read
    where the checkpoint stores it in `p`'s shape, else it is read whole and split (flat
    or differently shaped state). A plain `p` (one process, a world of one) owns every
    row: the tensor is read whole, as stored."""
    if not hasattr(p, "to_local"):
        return read_full()
    from torch.distributed.tensor import distribute_tensor

    shape = tuple(p.shape)
    if shape and tuple(stored) == shape:
        lo, hi = ranks.row_range(shape[0])
        if hi - lo == p.to_local().shape[0]:
            return read_rows(lo, hi)
    full = read_full().reshape(shape)
    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
