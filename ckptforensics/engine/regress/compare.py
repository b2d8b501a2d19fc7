"""Two tensors compared element by element, many pairs at once: max absolute and relative
difference, distance in units in the last place (ulps) of the reference's dtype, elements
whose bits differ, non-finite elements that disagree. Each pair is reduced on its device to
one row; the table is read to the host once (`table`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["COLUMNS", "TensorDelta", "table", "deltas"]

# The row of one pair (reference a, other b), in this order.
COLUMNS = ("max_abs", "max_rel", "max_ulps", "differing", "numel", "nonfinite")

# The integer type a float's bits are read as, by its width.
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """One pair's difference (b against the reference a).

    Attributes:
        max_abs: max |b - a| over elements finite in both (the tensor's unit; inf: shapes
            differ, or a non-finite element where the other is finite).
        max_rel: max_abs / max |a| (dimensionless: the size of the difference against the
            tensor's own scale, robust where a is near 0 elementwise).
        max_ulps: largest distance in ulps of a's dtype (b rounded to that dtype first):
            1 is the last bit, the rounding a different summation order leaves.
        differing: elements whose bits differ (0: bitwise identical, dtype included).
        numel: elements compared.
        nonfinite: elements non-finite in one and not the other (or NaN against inf).
    """

    max_abs: float
    max_rel: float
    max_ulps: float
    differing: int
    numel: int
    nonfinite: int

    @property
    def identical(self) -> bool:
        return self.differing == 0 and self.nonfinite == 0 and math.isfinite(self.max_abs)


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """The float's bits as an integer that counts ulps (int64, monotone in the value; +0 and
    -0 both 0): sign-magnitude read as two's complement."""
    width = x.element_size()
    bits = x.contiguous().view(_BITS[width]).to(torch.int64)
    mag = bits & ((1 << (8 * width - 1)) - 1)
    return torch.where(bits < 0, -mag, mag)


def _row(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[len(COLUMNS)] float64 on a's device, no host read."""
    n = a.numel()
    if a.shape != b.shape:
        inf = math.inf
        return torch.tensor([inf, inf, inf, n, n, 0], dtype=torch.float64, device=a.device)
    b = b.to(a.device)
    same_dtype = a.dtype == b.dtype
    br = b if same_dtype else b.to(a.dtype)
    work = torch.float64 if a.dtype == torch.float64 or b.dtype == torch.float64 else torch.float32
    fa, fb = a.to(work), b.to(work)
    ok_a, ok_b = torch.isfinite(fa), torch.isfinite(fb)
    both = ok_a & ok_b
    # non-finite in one and not the other, or NaN against inf (NaN against NaN agrees)
    nonfinite = ~both & ~(fa.isnan() & fb.isnan()) & (fa != fb)
    zero = fa.new_zeros(())
    d = torch.where(both, (fb - fa).abs(), zero)
    max_abs = d.amax() if n else zero
    scale = torch.where(ok_a, fa.abs(), zero).amax() if n else zero
    max_rel = torch.where(scale > 0, max_abs / scale, torch.where(max_abs > 0, math.inf, 0.0))
    ulps = (_ordered(a) - _ordered(br)).abs().to(torch.float64)
    max_ulps = torch.where(both, ulps, 0.0).amax() if n else ulps.new_zeros(())
    bits_a = a.contiguous().view(_BITS[a.element_size()])
    differing = (
        (bits_a != b.contiguous().view(_BITS[b.element_size()])).sum()
        if same_dtype
        else torch.tensor(n, device=a.device)
    )
    bad = nonfinite.sum()
    return torch.stack(
        [
            torch.where(bad > 0, math.inf, max_abs.to(torch.float64)),
            max_rel.to(torch.float64),
            max_ulps,
            differing.to(torch.float64),
            torch.tensor(float(n), dtype=torch.float64, device=a.device),
            bad.to(torch.float64),
        ]
    )


def table(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[len(pairs), len(COLUMNS)] float64 on the host: each pair reduced where its reference
    lives, the rows gathered and read to the host in one transfer per device."""
    if not pairs:
        return torch.zeros(0, len(COLUMNS), dtype=torch.float64)
    with torch.no_grad():
        rows = [_row(a, b) for a, b in pairs]
        by_dev: dict[torch.device, list[int]] = {}
        for i, r in enumerate(rows):
            by_dev.setdefault(r.device, []).append(i)
        out = torch.empty(len(rows), len(COLUMNS), dtype=torch.float64)
        for idx in by_dev.values():
            out[idx] = torch.stack([rows[i] for i in idx]).cpu()
    return out


def deltas(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[TensorDelta]:
    """`table` as records."""
    return [
        TensorDelta(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]))
        for r in table(pairs).tolist()
    ]
