"""bitsandbytes' 8-bit optimizer state, read and dequantised on CPU (no bitsandbytes needed).

Everything the tool knows about the quantised layout lives here. bitsandbytes' 2-state
8-bit optimizers (Adam8bit, AdamW8bit, their paged variants) keep per parameter:

- `state1` / `state2`: uint8 codes, the parameter's shape; a code is an index into
  `qmap1` / `qmap2`, 256 sorted fp32 values in [-1, 1] (`create_dynamic_map(signed=True)`,
  the first moment) and [0, 1] (`signed=False`, the second moment);
- `absmax1` / `absmax2`: fp32, one per block of 256 consecutive elements of the flattened
  tensor (`Optimizer2State.init_state`: blocks = ceil(n / 256)); the value is
  `qmap[code] * absmax[i // 256]` (`dequantize_blockwise`). The non-blockwise layout of
  older releases keeps one `max1` / `max2` instead: one block;
- tensors under `min_8bit_size` elements (4096 by default) keep fp32 `state1` / `state2`:
  Adam's exp_avg / exp_avg_sq as they are.

`Optimizer8bit.state_dict()` nests the quantised tensors under `QUANT_KEY` (hidden from
FSDP's gathering); `unwrap` lifts them back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "QUANT_KEY",
    "BLOCKSIZE",
    "DERIVED",
    "blocksize",
    "quant_parts",
    "unwrap",
    "is_quantised",
    "with_moments",
    "raw_state",
    "dequantise",
    "code_gap",
    "per_element",
    "explain_code_flip",
]

QUANT_KEY = "__bnb_optimizer_quant_state__"
# The block of bitsandbytes' blockwise 8-bit optimizers (`Optimizer2State.init_state`).
BLOCKSIZE = 256
# The moments this module adds to a quantised state (derived, never saved back).
DERIVED = ("exp_avg", "exp_avg_sq")
_SLOTS = (
    ("exp_avg", "state1", "qmap1", "absmax1", "max1"),
    ("exp_avg_sq", "state2", "qmap2", "absmax2", "max2"),
)


def unwrap(st: Any) -> Any:
    """A saved per-parameter state with bitsandbytes' nested quantised tensors lifted to
    the top level (anything else unchanged)."""
    if isinstance(st, dict) and isinstance(st.get(QUANT_KEY), dict):
        out = {k: v for k, v in st.items() if k != QUANT_KEY}
        out.update(st[QUANT_KEY])
        return out
    return st


def is_quantised(st: dict[str, Any]) -> bool:
    """The state holds 8-bit codes (not the fp32 state of a tensor under min_8bit_size)."""
    s1 = st.get("state1")
    return isinstance(s1, torch.Tensor) and s1.dtype == torch.uint8


def _scale(st: dict[str, Any], absmax_key: str, max_key: str) -> torch.Tensor | None:
    for k in (absmax_key, max_key):
        t = st.get(k)
        if isinstance(t, torch.Tensor):
            return t.reshape(-1).float()
    return None


def blocksize(n: int, blocks: int) -> int:
    """The block of a quantised tensor of n elements with `blocks` scales: bitsandbytes'
    256 where it fits, else the one block, else the power of two that gives that count.

    Raises:
        ValueError: no block size gives that many blocks.
    """
    if blocks == 1:
        return max(n, 1)
    if math.ceil(n / BLOCKSIZE) == blocks:
        return BLOCKSIZE
    for e in range(4, 24):
        if math.ceil(n / 2**e) == blocks:
            return 2**e
    raise ValueError(f"{blocks} scales for {n} elements match no block size")


def per_element(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Per-block values (absmax) repeated over each block's elements: n values."""
    bs = blocksize(n, scale.numel())
    return scale.repeat_interleave(bs)[:n]


def dequantise(codes: torch.Tensor, qmap: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 `codes`: qmap[code] times its block's scale, the parameter's shape."""
    flat = qmap.float()[codes.reshape(-1).long()]
    return (flat * per_element(scale, flat.numel())).reshape(codes.shape)


def with_moments(st: dict[str, Any]) -> dict[str, Any]:
    """The state with Adam's `exp_avg` / `exp_avg_sq` added: dequantised from the codes, or
    the fp32 state1 / state2 of a tensor kept unquantised. Raw keys are kept (the replay
    loads them back into bitsandbytes' own class). A state that cannot be dequantised
    (no map, or scales that match no block size) is returned as it is."""
    out = dict(st)
    for name, s, q, am, mx in _SLOTS:
        codes = st.get(s)
        if not isinstance(codes, torch.Tensor):
            return st
        if codes.dtype != torch.uint8:
            out[name] = codes
            continue
        qmap, scale = st.get(q), _scale(st, am, mx)
        if not isinstance(qmap, torch.Tensor) or qmap.numel() != 256 or scale is None:
            return st
        try:
            out[name] = dequantise(codes, qmap, scale)
        except ValueError:
            return st
    return out


def raw_state(st: dict[str, Any]) -> dict[str, Any]:
    """The state as bitsandbytes keeps it: the derived moments dropped."""
    return {k: v for k, v in st.items() if k not in DERIVED} if "state1" in st else st


def code_gap(qmap: torch.Tensor) -> float:
    """The widest gap between adjacent codes of a map, in units of the block's absmax: how
    far a stored value can sit from the fp32 value it quantised, whatever the rounding
    (bitsandbytes rounds to the nearest code: half this)."""
    q = qmap.double().sort().values
    return float((q[1:] - q[:-1]).max())


def quant_parts(
    st: dict[str, Any], which: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes, qmap, per-block scale) of state1 (which=1) or state2, or None where unquantised."""
    _, s, q, am, mx = _SLOTS[which - 1]
    codes, qmap, scale = st.get(s), st.get(q), _scale(st, am, mx)
    if (
        not isinstance(codes, torch.Tensor)
        or codes.dtype != torch.uint8
        or not isinstance(qmap, torch.Tensor)
        or scale is None
    ):
        return None
    return codes, qmap, scale


def explain_code_flip(
    code: int, qmap: torch.Tensor, scale: float, before: float, ok: Callable[[float], bool]
) -> tuple[str, int | None, str | None]:
    """Is a stored code one flipped bit away from a code whose value the optimizer could
    have reached? A flipped bit moves the index 2^b places along the sorted map: bit 7
    across half of it (the sign of the first moment's signed map; three to four decades of
    the second moment's), the low bits to a neighbouring value. Among the bits that
    explain it, the one restoring the previous magnitude."""
    best: tuple[float, int] | None = None
    for bit in range(8):
        val = float(qmap[code ^ (1 << bit)]) * scale
        if not ok(val):
            continue
        mag = abs(math.log2(abs(val) + 1e-45) - math.log2(abs(before) + 1e-45))
        if best is None or mag < best[0]:
            best = (mag, bit)
    if best is None:
        return "out_of_bound", None, None
    return "bit_flip", best[1], "code"
