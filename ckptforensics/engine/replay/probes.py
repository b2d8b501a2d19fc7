"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module. Attention is
watched where it is computed (`replay/attention.py`: every `scaled_dot_product_attention`
call and every eager softmax over [B, H, T, S] gives its heads' largest pre-softmax logit and
attention entropy), attributed here to the module that ran it; the per-parameter figures
live in `replay/paramstats.py`. Both are re-exported, so `probes` stays the one import.

Over 400 lines: `ModuleProbe` is one class whose hooks, mapping pass and collection share
their state (the row table, the attention sites, the depth counter); split, that state
would travel between modules as private attributes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ckptforensics.core import fused
from ckptforensics.engine.replay.attention import (
    ATTN_STATS,
    AttentionWatch,
    Patched,
    attention_logit_stats,
    attention_logit_stats_many,
    softmax_logit_stats,
)
from ckptforensics.engine.replay.paramstats import (
    param_grad_stats,
    param_grad_sums,
    param_grad_table,
)

__all__ = [
    "FWD_STATS",
    "BWD_STATS",
    "ATTN_STATS",
    "PassStats",
    "ModuleProbe",
    "AttentionWatch",
    "attention_logit_stats",
    "attention_logit_stats_many",
    "softmax_logit_stats",
    "logits_of",
    "param_grad_stats",
    "param_grad_sums",
    "param_grad_table",
]

FWD_STATS = ("absmax", "rms", "nonfinite", "over_fp16", "over_bf16", "subnormal_share")
# nonfinite / over_* are 0/1 flags (any element), derived from the extrema.
BWD_STATS = ("grad_norm", "grad_absmax", "grad_nonfinite")


_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@dataclass(frozen=True, slots=True)
class PassStats:
    """One forward+backward pass.

    Attributes:
        modules: module names (the model's own), row order of the tables.
        fwd: [M, len(FWD_STATS)] output statistics; NaN for modules that did not run.
        bwd: [M, len(BWD_STATS)] output-gradient statistics; NaN where none flowed.
        fwd_order, bwd_order: row indices in the order the hooks fired.
        attn_modules: the module that ran each attention call, in forward order (one per
            layer; the innermost module running when the call was made).
        attn: [L, Hmax, len(ATTN_STATS)] per attention call and head; NaN past a call's heads.
        head: the module whose output is the model's logits (the last module in forward
            order whose output has the logits' shape); None when a bare function computes them.
        logit_mean: mean output logit of the pass (nats; its drift with log Z is the
            output-logit divergence of Wortsman et al. 2023).
    """

    modules: tuple[str, ...]
    fwd: torch.Tensor
    bwd: torch.Tensor
    fwd_order: tuple[int, ...]
    bwd_order: tuple[int, ...]
    attn_modules: tuple[str, ...] = ()
    attn: torch.Tensor | None = None
    head: str | None = None
    logit_mean: float = math.nan


def logits_of(out: object) -> torch.Tensor | None:
    """The logits in a model's output: the tensor itself, `.logits` (transformers), the first
    tensor of a tuple (nanoGPT's `(logits, loss)`); None when there is none."""
    return _first_tensor(out)


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            t = _first_tensor(o)
            if t is not None:
                return t
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        for o in out.values():
            t = _first_tensor(o)
            if t is not None:
                return t
    return None


def _stats(x: torch.Tensor, with_subnormal: bool) -> torch.Tensor:
    """[absmax, rms, nonfinite, over_fp16, over_bf16, subnormal_share] in two passes.

    One aminmax and one norm (both propagate NaN/inf), then scalar ops: the flags are
    0/1 indicators derived from the extrema, not counts, so no pass is spent counting
    and nothing leaves the device.
    """
    if x.numel() == 0:
        return torch.zeros(len(FWD_STATS), device=x.device)
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(-lo.float(), hi.float())
    rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    nonfinite = (~torch.isfinite(absmax)).float()
    sub = (
        (((x.abs() < torch.finfo(x.dtype).tiny) & (x != 0)).sum().float() / x.numel())
        if with_subnormal
        else absmax.new_zeros(())
    )
    return torch.stack(
        [absmax, rms, nonfinite, (absmax > _FP16_MAX).float(), (absmax > _BF16_MAX).float(), sub]
    )


# A rider's forward function (`ModuleProbe.ride`): (module, args, output) -> the gradient
# hook that output needs, or None.
_Rider = Callable[[nn.Module, Any, Any], Callable[[torch.Tensor], None] | None]


def _own_hook(out: object, extra: Callable[[torch.Tensor], None] | None) -> None:
    """A rider's gradient hook on an output the probe does not hook itself."""
    if extra is not None and isinstance(out, torch.Tensor):
        out.register_hook(extra)


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
    of them: forward rows are `FWD_STATS` (`_stats`' figures), backward rows `BWD_STATS`
    (grad norm, max |g|, non-finite flag); one per row (`_Rows.flush` keeps each row's latest)."""
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
        [top, l2 / root_n, nonfinite, (top > _FP16_MAX).float(), (top > _BF16_MAX).float(), sub], 1
    )


# A measurement as `_Rows.measure` returns it: the row written in place (an fp32 tensor),
# or the pending tuple.
_Meas = int | _Norms


class _Rows:
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

    def measure(self, i: int, x: torch.Tensor, subnormal: bool) -> _Meas:
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

    def again(self, i: int, meas: _Meas) -> _Meas:
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


# Heads up to which `_heads` takes Python numbers: below it, a few microseconds in all
# against a handful of torch (or numpy) ops, which cost ~100 µs between a replayed
# step's other work at 2 layers.
_HEADS_IN_PYTHON = 256


def _heads(a: torch.Tensor) -> torch.Tensor:
    """[L, H, 2] per attention call and head, from a pass's [L, H, 3] table on the host:
    its max logit, and its mean normalised entropy over the rows counted (NaN where none
    were). Small tables in Python numbers (an fp32 quotient computed in float64 and
    rounded once is the fp32 quotient), others by torch's ops: the same figures."""
    n, h = a.shape[0], a.shape[1]
    if n * h <= _HEADS_IN_PYTHON:
        nan = math.nan
        got = [
            [top, ent / max(cnt, 1.0) if cnt > 0 else nan]
            for layer in a.tolist()
            for top, ent, cnt in layer
        ]
        return torch.tensor(got, dtype=torch.float32).reshape(n, h, 2)
    cnt = a[..., 2]
    return torch.stack(
        [a[..., 0], a[..., 1] / cnt.clamp_min(1).where(cnt > 0, torch.tensor(math.nan))], -1
    )


class ModuleProbe:
    """Forward hooks on every named module, a gradient hook on each output, and an
    `AttentionWatch` (its attention calls' logit statistics, attributed to the module that
    ran them on the first pass, which watches the whole forward; later passes watch only
    the modules that ran attention, and map again if the count of calls changes). Where
    every call of the first pass went through `Patched`'s wrappers of the attention
    functions, later passes are watched by those alone, with no torch-function mode (which
    costs a Python call for every torch call of the attention modules)."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str = "cpu",
        ranks: Any = None,
        attention: bool = True,
    ) -> None:
        self.model = model
        self.names = tuple(n for n, _ in model.named_modules() if n)
        self.index = {n: i for i, n in enumerate(self.names)}
        m = len(self.names)
        self.device = device
        self.fwd = torch.full((m, len(FWD_STATS)), float("nan"), device=device)
        self.bwd = torch.full((m, len(BWD_STATS)), float("nan"), device=device)
        # Under torchrun (`replay.distributed`): elements each rank's statistics cover, to
        # weigh them when the ranks' tables are merged.
        self.ranks = ranks
        self.count = torch.zeros((m, 1), device=device) if ranks is not None else None
        # Outputs without this rank's rows as dim 0 (a position table [T, C] added to every
        # row) are the same on every rank, and their true gradient is the ranks' sum: kept
        # whole (they are small) and summed at `collect`, the norm taken after the sum.
        self.rows: int | None = None
        self.shared: dict[int, torch.Tensor] = {}
        self.fwd_order: list[int] = []
        self.bwd_order: list[int] = []
        # What the hooks measured (`_Rows`: fp32 outputs straight into a raw buffer, others
        # pending), written to the tables at `collect` (`_flush`): a hook costs two
        # reductions, not a dozen small ops.
        kernels = fused.load() if torch.device(device).type == "cpu" else None
        self._fwd_rows = _Rows(self.fwd, kernels)
        self._bwd_rows = _Rows(self.bwd, kernels)
        # With activation checkpointing a block's modules run again in the backward pass:
        # only their first call in a pass is recorded.
        self.once = False
        self._ran: set[int] = set()
        # The last output measured: (tensor, its measurement, the modules its gradient
        # hook serves); a parent returning the same tensor reuses both.
        self._prev: tuple[torch.Tensor, _Meas, list[int] | None] | None = None
        self.enabled = True
        # A rider's forward function (`ride`: the per-sample shares), called by the hook
        # of each linear; the gradient hook it returns shares the probe's on that output.
        self._rider: _Rider | None = None
        self._linears = {
            id(mod) for n, mod in model.named_modules() if n and isinstance(mod, nn.Linear)
        }
        self._handles = [
            mod.register_forward_hook(self._forward(self.index[n], isinstance(mod, nn.Linear)))
            for n, mod in model.named_modules()
            if n
        ]
        # Attention and output logits: the watch is entered by the model's own forward
        # pre-hook and left by its forward hook (also when the forward raises).
        self.watch = AttentionWatch(self._site) if attention else None
        self.attn_modules: tuple[str, ...] | None = None  # settled on the first watched pass
        self.head: str | None = None
        self._mapping = False  # the first pass: record output shapes and the running module
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._stack: list[str] = []
        self._stack_handles: list[Any] = []
        self._watching = False
        # Once the first pass has mapped which modules run attention, the watch (a torch
        # function mode: a Python call for every torch call it sees) is entered around
        # those modules only, not the whole forward; the whole forward is watched on a
        # mapping pass, or when an attention call ran outside every named module.
        self._whole = False
        self._scope: frozenset[str] = frozenset()
        self._scope_handles: list[Any] = []
        self._depth = 0
        # After a mapping pass on which every attention call went through `Patched`'s
        # wrappers, the scoped passes use those alone (no torch-function mode at all).
        self._patch_only = False
        self._patched = (
            Patched(self.watch, lambda: self._patch_only and self._depth > 0)
            if self.watch is not None
            else None
        )
        # the output logits' sum (a tensor where the logits are, read at `collect`) and count
        self._logit_sum: torch.Tensor | float = math.nan
        self._logit_count = math.nan
        if self.watch is not None:
            self._handles.append(model.register_forward_pre_hook(self._enter))
            self._handles.append(model.register_forward_hook(self._leave, always_call=True))

    def _site(self, kind: str, args: tuple, kwargs: dict, out: Any) -> str:
        """The module running an attention call (on the mapping pass; else unused)."""
        return self._stack[-1] if self._stack else ""

    def _enter(self, module: nn.Module, args: object) -> None:
        if not self.enabled or self.watch is None or self._watching:
            return
        self._mapping = self.attn_modules is None
        if self._mapping:
            # Which module runs each attention call: a stack of running modules, kept only
            # on this first pass (its pre-hooks cost a call per module).
            for n, mod in self.model.named_modules():
                if n:
                    self._stack_handles.append(
                        mod.register_forward_pre_hook(lambda _m, _a, n=n: self._stack.append(n))
                    )
        self.watch.rows.clear()
        self.watch.sites.clear()
        self._watching = True
        self._whole = self._mapping or not self._scoped()
        if self._mapping:
            self._patch_only = False
            self.watch.patch_ok = True
        if self._patched is not None and (self._mapping or (self._patch_only and not self._whole)):
            self._patched.install()
        if self._whole:
            self.watch.__enter__()

    def _scoped(self) -> bool:
        """Whether this pass watches the mapped attention modules only (hooks on them
        installed as needed)."""
        mods = self.attn_modules or ()
        if "" in mods:
            return False
        scope = frozenset(mods)
        if scope != self._scope:
            for h in self._scope_handles:
                h.remove()
            self._scope_handles.clear()
            for n, mod in self.model.named_modules():
                if n in scope:
                    self._scope_handles.append(mod.register_forward_pre_hook(self._scope_in))
                    self._scope_handles.append(
                        mod.register_forward_hook(self._scope_out, always_call=True)
                    )
            self._scope = scope
        return True

    def _scope_in(self, module: nn.Module, args: object) -> None:
        if self._watching and not self._whole and self.watch is not None:
            if self._depth == 0 and not self._patch_only:
                self.watch.__enter__()
            self._depth += 1

    def _scope_out(self, module: nn.Module, args: object, out: object) -> None:
        if self._depth > 0 and self.watch is not None:
            self._depth -= 1
            if self._depth == 0 and not self._patch_only:
                self.watch.__exit__(None, None, None)

    def _leave(self, module: nn.Module, args: object, out: object) -> None:
        if not self._watching or self.watch is None:
            return
        if self._whole or (self._depth > 0 and not self._patch_only):
            self.watch.__exit__(None, None, None)
        if self._patched is not None:
            self._patched.uninstall()
        self.watch.flush()
        self._depth = 0
        self._whole = False
        self._watching = False
        self._prev = None
        logits = logits_of(out)
        if logits is not None and logits.is_floating_point():
            self._logit_sum = logits.detach().float().sum()
            self._logit_count = float(logits.numel())
        if self._mapping:
            for h in self._stack_handles:
                h.remove()
            self._stack_handles.clear()
            self._stack.clear()
            self.attn_modules = tuple(self.watch.sites)
            # every call went through `Patched`: later passes need no torch-function mode
            self._patch_only = self.watch.patch_ok
            if logits is not None:
                shape = tuple(logits.shape)
                self.head = next(
                    (
                        self.names[i]
                        for i in reversed(self.fwd_order)
                        if self._shapes.get(i) == shape
                    ),
                    None,
                )
            self._mapping = False
        elif self.attn_modules is not None and len(self.watch.rows) != len(self.attn_modules):
            self.attn_modules = None  # a different call pattern: map again on the next pass

    def ride(self, rider: _Rider | None) -> set[int]:
        """Let `rider` (or no one, None) see each linear's forward from the probe's own
        hook: it returns the gradient hook that output needs, or None. The probe's
        gradient hook on that output then calls it after its own measurement, so a linear
        costs one forward hook and one gradient hook, not two each. Returns the ids of the
        linears the probe hooks (any other is the rider's to hook)."""
        self._rider = rider
        return set(self._linears)

    def _forward(self, i: int, linear: bool = False):  # noqa: ANN202 - hook factory
        def hook(module: nn.Module, args: object, out: object) -> None:
            if self._stack and self._mapping:
                self._stack.pop()
            rider = self._rider if linear else None
            extra = rider(module, args, out) if rider is not None else None
            if not self.enabled:
                _own_hook(out, extra)
                return
            t = _first_tensor(out)
            if t is None or not t.is_floating_point():
                _own_hook(out, extra)
                return
            if self._mapping:
                self._shapes[i] = tuple(t.shape)
            prev = self._prev
            if prev is not None and prev[0] is t:
                # A parent returning the tensor its last child returned (an attention
                # block o_proj's output, an MLP down_proj's): measured once, and one
                # gradient hook serves both rows, in the order two hooks would fire.
                meas = self._fwd_rows.again(i, prev[1])
                rows = prev[2]
            else:
                meas = self._fwd_rows.measure(i, t, True)
                rows = None
            if self.count is not None:
                self.count[i] = t.numel()
            if self.once:
                if i in self._ran:
                    # recomputed (activation checkpointing): same values; the gradient
                    # flows to the first call's outputs (a rider hooks this call's own)
                    _own_hook(out, extra)
                    return
                self._ran.add(i)
            self.fwd_order.append(i)
            if t.requires_grad:
                if rows is not None:
                    rows.append(i)
                    _own_hook(out, extra)
                else:
                    shared = self.count is not None and (t.dim() == 0 or t.shape[0] != self.rows)
                    rows = [i]
                    if extra is not None and t is not out:
                        _own_hook(out, extra)
                        extra = None
                    t.register_hook(self._backward(rows, shared, extra))
            else:
                _own_hook(out, extra)
            self._prev = (t, meas, rows)

        return hook

    def _backward(
        self,
        rows: list[int],
        shared: bool = False,
        extra: Callable[[torch.Tensor], None] | None = None,
    ):  # noqa: ANN202 - hook factory
        """The gradient hook of one output tensor: its statistics for each module in `rows`
        (the modules that returned it), then a rider's hook on it (`ride`), if any."""

        def hook(g: torch.Tensor) -> None:
            # (`measure` reads the values only; a gradient in a hook needs no detach)
            m = self._bwd_rows.measure(rows[0], g, False)
            for i in rows:
                if shared:
                    self.shared[i] = g.detach().float().clone()
                if i != rows[0]:
                    self._bwd_rows.again(i, m)
                self.bwd_order.append(i)
            if extra is not None:
                extra(g)

        return hook

    def reset(self) -> None:
        self._prev = None
        self.fwd.fill_(float("nan"))
        self.bwd.fill_(float("nan"))
        self._fwd_rows.clear()
        self._bwd_rows.clear()
        if self.count is not None:
            self.count.zero_()
        self.shared.clear()
        self._ran.clear()
        self.fwd_order.clear()
        self.bwd_order.clear()
        if self.watch is not None:
            self.watch.rows.clear()
            self.watch.clear_waiting()
        self._logit_sum, self._logit_count = math.nan, math.nan

    def _logits(self) -> torch.Tensor:
        """[sum of the pass's logits, their count] (fp64, on the probe's device)."""
        top = self._logit_sum
        return torch.stack(
            [
                torch.as_tensor(top).to(self.device, torch.float64),
                torch.tensor(self._logit_count, dtype=torch.float64, device=self.device),
            ]
        )

    def _flush(self) -> None:
        """The hooks' pending measurements into the tables (`_rows`); a module that ran
        more than once in the pass keeps its last call's row, as each call overwrote it."""
        self._fwd_rows.flush(backward=False)
        self._bwd_rows.flush(backward=True)

    def _attn_table(self) -> torch.Tensor:
        """[L, Hmax, 3] of the pass's attention calls (NaN past a call's heads)."""
        if self.watch is not None:
            self.watch.flush()
        rows = [r for r in self.watch.rows if r is not None] if self.watch is not None else []
        if not rows:
            return torch.zeros(0, 0, 3, device=self.device)
        hmax = max(r.shape[0] for r in rows)
        if all(r.shape[0] == hmax for r in rows):
            return torch.stack(rows)
        table = torch.full((len(rows), hmax, 3), float("nan"), device=rows[0].device)
        for i, r in enumerate(rows):
            table[i, : r.shape[0]] = r
        return table

    def collect(self) -> PassStats:
        """The pass's tables, read to the host in one transfer (under torchrun, every rank's
        tables merged after one collective)."""
        self._flush()
        attn = self._attn_table()
        na = attn.numel()
        if self.ranks is None and self.fwd.device.type == "cpu" and attn.device.type == "cpu":
            # on the host already: copies of the tables, no packing
            fwd, bwd, a = self.fwd.clone(), self.bwd.clone(), attn.float()
            s, n = float(self._logit_sum), self._logit_count
        else:
            fwd, bwd, attn, logits = (
                (self.fwd, self.bwd, attn, self._logits())
                if self.ranks is None
                else self._merged(attn)
            )
            flat = torch.cat(
                [
                    fwd.reshape(-1).float(),
                    bwd.reshape(-1).float(),
                    attn.reshape(-1).float().to(fwd.device),
                    logits.float().to(fwd.device),
                ]
            ).cpu()
            nf, nb = fwd.numel(), bwd.numel()
            a = flat[nf + nb : nf + nb + na].reshape(attn.shape)
            s, n = flat[-2:].tolist()
            fwd = flat[:nf].reshape(fwd.shape).clone()
            bwd = flat[nf : nf + nb].reshape(bwd.shape).clone()
        heads = _heads(a) if na else None
        mods = (
            self.attn_modules
            if self.attn_modules is not None
            and heads is not None
            and len(self.attn_modules) == heads.shape[0]
            else ()
        )
        return PassStats(
            self.names,
            fwd,
            bwd,
            tuple(self.fwd_order),
            tuple(self.bwd_order),
            attn_modules=tuple(mods),
            attn=heads,
            head=self.head,
            logit_mean=s / n if n > 0 else math.nan,
        )

    def _merged(
        self, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The whole batch's statistics from every rank's share of its rows: one gather of
        [fwd | bwd | count | shared flag] per module, the attention table and the logit sums.
        Extremes and flags take the maximum, RMS and the subnormal share the element-weighted
        mean, gradient norms the root sum of squares, attention entropy and logit sums add."""
        assert self.count is not None
        nf, nb = len(FWD_STATS), len(BWD_STATS)
        flags = torch.zeros_like(self.count)
        flags[list(self.shared)] = 1.0
        table = torch.cat([self.fwd, self.bwd, self.count, flags], 1).double()
        m = table.numel()
        flat = torch.cat(
            [
                table.reshape(-1),
                attn.reshape(-1).double().to(table.device),
                self._logits().to(table.device),
            ]
        )
        gathered = self.ranks.gather(flat).reshape(-1, flat.numel())  # [W, m + attn + 2]
        w = gathered.shape[0]
        every = gathered[:, :m].reshape(w, *table.shape)  # [W, M, nf + nb + 2]
        att_r = gathered[:, m : m + attn.numel()].reshape(w, *attn.shape)
        logit_r = gathered[:, m + attn.numel() :]
        fwd_r, bwd_r, nfw = every[..., :nf], every[..., nf : nf + nb], every[..., nf + nb]
        fwd = fwd_r.amax(0)
        tot = nfw.sum(0)
        rms = FWD_STATS.index("rms")
        fwd[:, rms] = ((fwd_r[..., rms].pow(2) * nfw).sum(0) / tot).sqrt()
        sub = FWD_STATS.index("subnormal_share")
        fwd[:, sub] = (fwd_r[..., sub] * nfw).sum(0) / tot
        bwd = bwd_r.amax(0)
        bwd[:, BWD_STATS.index("grad_norm")] = (
            bwd_r[..., BWD_STATS.index("grad_norm")].pow(2).sum(0).sqrt()
        )
        # A rank with no rows reports zeros over no elements (`_stats`): weightless.
        shared = (
            torch.nonzero(every[..., nf + nb + 1].amin(0) > 0).flatten().tolist()
        )  # shared on every rank
        if shared:
            grads = [self.shared[i] for i in shared]
            total = self.ranks.sum(torch.cat([g.reshape(-1) for g in grads]))
            for i, g in zip(shared, total.split([g.numel() for g in grads]), strict=True):
                st = _stats(g, with_subnormal=False).double()
                bwd[i] = torch.stack([st[1] * math.sqrt(max(g.numel(), 1)), st[0], st[2]])
        att = att_r[0].clone() if att_r.shape[0] else attn.double()
        if att.numel():
            att[..., 0] = att_r[..., 0].amax(0)
            att[..., 1:] = att_r[..., 1:].nansum(0)
        logits = logit_r.nansum(0)
        return fwd.float(), bwd.float(), att.float(), logits.float()

    def remove(self) -> None:
        if (
            self._watching
            and self.watch is not None
            and (self._whole or (self._depth > 0 and not self._patch_only))
        ):
            self.watch.__exit__(None, None, None)
        if self._patched is not None:
            self._patched.uninstall()
        self._watching, self._whole, self._depth = False, False, 0
        for h in self._handles + self._stack_handles + self._scope_handles:
            h.remove()
        self._handles.clear()
        self._stack_handles.clear()
        self._scope_handles.clear()
        self._scope = frozenset()
