"""How the module probe's hooks measure a tensor and turn it into a row of its tables.

A hook's measurement of one output (or of its gradient) is its elements, L2 norm, min and
max, and for fp16 / bf16 its subnormal share; a row of `FWD_STATS` (or `BWD_STATS`) is
derived from those. `ProbeRows` keeps one table's measurements of a pass, written by the C
kernel from the hook itself, into a raw buffer, or held pending, and writes each row's
latest at `flush`. The hooks themselves are `engine/replay/probes.py`'s (`ModuleProbe`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "FWD_STATS",
    "BWD_STATS",
    "FP16_MAX",
    "BF16_MAX",
    "Measurement",
    "ProbeRows",
]

FWD_STATS = ("absmax", "rms", "nonfinite", "over_fp16", "over_bf16", "subnormal_share")
# nonfinite / over_* are 0/1 flags (any element), derived from the extrema.
BWD_STATS = ("grad_norm", "grad_absmax", "grad_nonfinite")


FP16_MAX = float(torch.finfo(torch.float16).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)

# One hook call's measurement: (module row, elements, L2 norm, min, max, subnormal share or None).
_Norms = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


def _norms(
    x: torch.Tensor, subnormal: bool = True
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(elements, L2 norm in fp32, min, max, subnormal share) of a tensor in two reductions
    (both propagate NaN / inf; aminmax, not the inf-norm, which is ten times slower on CPU),
    on its device; the subnormal share only for fp16 / bf16 tensors."""
    n = x.numel()
    if n == 0:
        z = torch.zeros((), device=x.device)
        return 0, z, z, z, None
    l2 = torch.linalg.vector_norm(x, dtype=torch.float32)
    lo, hi = torch.aminmax(x)
    sub = (
        ((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / n
        if subnormal and x.dtype in (torch.float16, torch.bfloat16)
        else None
    )
    return n, l2, lo, hi, sub


def _rows(pending: list[_Norms], backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(module rows, their table rows) from the hooks' measurements, in a few ops over all
    of them: forward rows are `FWD_STATS` (`passstats._stats`' figures), backward rows
    `BWD_STATS` (grad norm, max |g|, non-finite flag); one per row (`ProbeRows.flush` keeps
    each row's latest)."""
    idx = torch.tensor([e[0] for e in pending], dtype=torch.long)
    l2 = torch.stack([e[2] for e in pending])
    lo = torch.stack([e[3].float() for e in pending])
    hi = torch.stack([e[4].float() for e in pending])
    subs = [e[5] for e in pending]
    sub = (
        torch.stack([s if s is not None else lo.new_zeros(()) for s in subs])
        if any(s is not None for s in subs)
        else None
    )
    return idx, _derive(l2, lo, hi, [e[1] for e in pending], sub, backward)


def _derive(
    l2: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: list[int],
    sub: torch.Tensor | None,
    backward: bool,
) -> torch.Tensor:
    """Table rows from [k] measurements (L2 norm, min, max, elements, subnormal share or
    None: 0): `FWD_STATS` rows, or with `backward` `BWD_STATS` rows."""
    top = torch.maximum(-lo, hi)
    nonfinite = (~torch.isfinite(top)).float()
    if backward:
        return torch.stack([l2, top, nonfinite], 1)
    root_n = torch.tensor([math.sqrt(max(n, 1)) for n in numel], device=l2.device)
    sub = sub if sub is not None else torch.zeros_like(top)
    return torch.stack(
        [top, l2 / root_n, nonfinite, (top > FP16_MAX).float(), (top > BF16_MAX).float(), sub], 1
    )


# A measurement as `ProbeRows.measure` returns it: the row written in place (an fp32 tensor),
# or the pending tuple.
Measurement = int | _Norms


class ProbeRows:
    """One table's measurements in a pass, each row its module's latest, whichever kind
    (`last`: the number of each row's latest measurement):

    - Kernel (CPU with the C kernels, `fused.load`; a contiguous fp32 tensor): its table
      row written by one C call from the hook itself, in one pass over the tensor while
      it is still in cache (`fused.Kernels.probe_row`): at 64 wide a hook's two torch
      reductions and the row's derivation at `flush` are dispatch, not arithmetic; held
      until `flush` instead, the tensors are read back cold from memory (5 ms a step at
      32 layers), and one an in-place op changes after its hook would read wrong.
    - Direct (another fp32 tensor on the table's device): its L2 norm, min and max into
      its row of a raw [M, 3] buffer (the reductions' `out=`), derived at `flush`.
    - Pending (fp16 / bf16: a subnormal share too; another device): scalars kept, stacked
      and derived at `flush` (`_rows`).
    """

    def __init__(self, table: torch.Tensor, kernels: Any = None) -> None:
        m = table.shape[0]
        self.table = table
        self.raw = torch.full((m, 3), float("nan"), device=table.device)
        self._row = list(self.raw.unbind(0))
        self._views = [tuple(r.unbind(0)) for r in self._row]
        self.numel = [0] * m
        self.seq = 0
        self.last: dict[int, int] = {}  # row -> its latest measurement's number
        self.direct: dict[int, int] = {}  # row -> number of its latest raw-buffer measurement
        self.pending: list[tuple[int, _Norms]] = []  # (number, measurement)
        # the kernel's one-tensor call and where the table's rows are (CPU fp32 tables only)
        plain = (
            table.device.type == "cpu" and table.dtype == torch.float32 and table.is_contiguous()
        )
        self._one = (
            kernels.probe_rows.get(table.shape[1]) if plain and kernels is not None else None
        )
        # each row's address in the table, for the kernel
        self._addr = [table.data_ptr() + 4 * table.shape[1] * i for i in range(m)]
        self._on_cpu = self.raw.device.type == "cpu"
        self._rows_np = table.numpy() if self._one is not None else None

    def _next(self, i: int) -> int:
        self.seq += 1
        self.last[i] = self.seq
        return self.seq

    def measure(self, i: int, x: torch.Tensor, subnormal: bool) -> Measurement:
        """Row `i`'s measurement of `x` (its values now; not used for autograd)."""
        m = x.numel()
        if (
            x.dtype == torch.float32
            and type(x) is torch.Tensor
            and m
            and (x.is_cpu if self._on_cpu else x.device == self.raw.device)
        ):
            n = self._next(i)
            if self._one is not None and x.is_contiguous():
                self._one(x.data_ptr(), m, self._addr[i])  # (its row needs no count)
                return i
            self.numel[i] = m
            self.direct[i] = n
            l2, lo, hi = self._views[i]
            x = x.detach()
            torch.linalg.vector_norm(x, dtype=torch.float32, out=l2)
            torch.aminmax(x, out=(lo, hi))
            return i
        meas = (i, *_norms(x.detach(), subnormal))
        self.pending.append((self._next(i), meas))
        return meas

    def again(self, i: int, meas: Measurement) -> Measurement:
        """Row `i` takes another row's measurement (a parent returning its child's output)."""
        if isinstance(meas, int):
            n = self._next(i)
            if meas in self.direct and self.last[meas] == self.direct[meas]:
                self._row[i].copy_(self._row[meas])
                self.numel[i] = self.numel[meas]
                self.direct[i] = n
            else:  # written by the kernel: its table row
                self._rows_np[i] = self._rows_np[meas]
            return i
        meas = (i, *meas[1:])
        self.pending.append((self._next(i), meas))
        return meas

    def flush(self, backward: bool) -> None:
        """The pass's raw and pending measurements into the table (`_derive`), each row its
        latest (the kernel's rows are written already); then cleared."""
        last, table = self.last, self.table
        rows = [i for i, n in self.direct.items() if last[i] == n]
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=self.raw.device)
            raw = self.raw[idx]
            got = _derive(
                raw[:, 0], raw[:, 1], raw[:, 2], [self.numel[i] for i in rows], None, backward
            )
            table[idx.to(table.device)] = got.to(table.device)
        pending = [m for n, m in self.pending if last[m[0]] == n]
        if pending:
            idx, got = _rows(pending, backward)
            table[idx.to(table.device)] = got.to(table.device)
        self.clear()

    def clear(self) -> None:
        self.last.clear()
        self.direct.clear()
        self.pending.clear()
