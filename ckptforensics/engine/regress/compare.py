"""Two tensors compared element by element, many pairs at once: max absolute and relative
difference, distance in units in the last place (ulps) of the reference's dtype, elements
whose bits differ, non-finite elements that disagree. Each pair is reduced on its device to
one row; the table is read to the host once (`table`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptforensics.core.errors import ForensicsError
from ckptforensics.engine.replay.distributed import World

__all__ = ["COLUMNS", "TensorDelta", "Across", "table", "deltas"]

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


# The row each pair is reduced to on its device, before the ranks meet: the two maxima and
# the scale reduce by their maximum over the ranks, the counts by their sum, and only then is
# the relative difference formed (max |b - a| over every rank's elements against max |a| over
# them: one process's figure, where a maximum of the ranks' ratios would overstate it).
_RAW = ("max_abs", "scale", "max_ulps", "differing", "numel", "nonfinite", "misshaped")
_MAXED = [0, 1, 2, 6]  # the columns of `_RAW` reduced by their maximum; the rest are summed


def _raw(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[len(_RAW)] float64 on a's device, no host read."""
    n = a.numel()
    if a.shape != b.shape:
        inf = math.inf
        return torch.tensor([inf, inf, inf, n, n, 0, 1], dtype=torch.float64, device=a.device)
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
    ulps = (_ordered(a) - _ordered(br)).abs().to(torch.float64)
    max_ulps = torch.where(both, ulps, 0.0).amax() if n else ulps.new_zeros(())
    bits_a = a.contiguous().view(_BITS[a.element_size()])
    differing = (
        (bits_a != b.contiguous().view(_BITS[b.element_size()])).sum()
        if same_dtype
        else torch.tensor(n, device=a.device)
    )
    return torch.stack(
        [
            max_abs.to(torch.float64),
            scale.to(torch.float64),
            max_ulps,
            differing.to(torch.float64),
            torch.tensor(float(n), dtype=torch.float64, device=a.device),
            nonfinite.sum().to(torch.float64),
            torch.zeros((), dtype=torch.float64, device=a.device),
        ]
    )


def _finish(raw: torch.Tensor) -> torch.Tensor:
    """[n, len(_RAW)] -> [n, len(COLUMNS)] on the host: the relative difference formed, a
    pair with a non-finite disagreement or mis-shaped given an infinite max_abs."""
    max_abs, scale, ulps, differing, numel, bad, misshaped = raw.unbind(1)
    rel = torch.where(scale > 0, max_abs / scale, torch.where(max_abs > 0, math.inf, 0.0))
    rel = torch.where(misshaped > 0, math.inf, rel)
    out = torch.stack([max_abs, rel, ulps, differing, numel, bad], dim=1)
    out[:, 0] = torch.where((bad > 0) | (misshaped > 0), math.inf, max_abs)
    return out


@dataclass(frozen=True, slots=True)
class Across:
    """How a table's pairs merge across torchrun ranks.

    Attributes:
        world: the ranks (one process: nothing to merge).
        keys: the pairs' names, in the same order on every rank (checked: see `_merge`).
        split: per pair, whether each rank holds its own rows of it (a module's activations
            on the rank's rows, a parameter's FSDP2 shard: counts summed over the ranks) or
            a tensor whole (a position embedding's [T, C] output, and the gradient at it, each
            rank's partial sum over its rows: counts are one rank's, the maximum). Empty: all
            split.
    """

    world: World
    keys: Sequence[str]
    split: Sequence[bool] = ()


def _merge(across: Across, raw: torch.Tensor) -> torch.Tensor:
    """The ranks' raw rows of the same pairs as one process's (`_MAXED` by their maximum, the
    counts summed where each rank holds its own rows), every rank's rows travelling in one
    collective. Every rank must have compared the same pairs: a rank whose pass called other
    modules (an expert its rows never reach) raises on every rank alike, so that none waits
    on another. Rank 0's `split` rules on every rank, so that all merge alike."""
    world, keys = across.world, list(across.keys)
    if world.world == 1:
        return raw
    split = list(across.split) or [True] * len(keys)
    got = world.objects((keys, split, raw.tolist()))
    if any(k != got[0][0] for k, _, _ in got):
        raise ForensicsError(
            "regress under torchrun: the ranks captured different modules or parameters "
            "(a data-dependent path, such as an expert no row of one rank reaches); "
            "run it in one process"
        )
    rows = torch.tensor([r for _, _, r in got], dtype=torch.float64).reshape(
        world.world, len(keys), len(_RAW)
    )
    summed = torch.tensor(got[0][1], dtype=torch.bool)
    out = torch.where(summed[:, None], rows.sum(0), rows.amax(0))
    out[:, _MAXED] = rows[:, :, _MAXED].amax(0)
    return out


def table(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], across: Across | None = None
) -> torch.Tensor:
    """[len(pairs), len(COLUMNS)] float64 on the host: each pair reduced where its reference
    lives, the rows gathered and read to the host in one transfer per device. Under torchrun
    (`across`) each rank holds its own rows of a pass's tensors and its shards of the
    parameters: the ranks' rows merge into one process's figures (`_merge`)."""
    raw = torch.zeros(len(pairs), len(_RAW), dtype=torch.float64)
    if pairs:
        with torch.no_grad():
            rows = [_raw(a, b) for a, b in pairs]
            by_dev: dict[torch.device, list[int]] = {}
            for i, r in enumerate(rows):
                by_dev.setdefault(r.device, []).append(i)
            for idx in by_dev.values():
                raw[idx] = torch.stack([rows[i] for i in idx]).cpu()
    if across is not None:
        raw = _merge(across, raw)
    return _finish(raw)


def deltas(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], across: Across | None = None
) -> list[TensorDelta]:
    """`table` as records."""
    return [
        TensorDelta(r[0], r[1], r[2], int(r[3]), int(r[4]), int(r[5]))
        for r in table(pairs, across).tolist()
    ]
