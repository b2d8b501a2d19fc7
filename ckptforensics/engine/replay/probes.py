"""Probes on every module: activation and gradient statistics kept on the device.

Each hook writes one row of a preallocated statistics tensor with tensor ops only; the
host reads the whole table once per pass (`collect`), never once per module. Attention is
watched where it is computed (`engine/replay/attention.py`: every `scaled_dot_product_attention`
call and every eager softmax over [B, H, T, S] gives its heads' largest pre-softmax logit and
attention entropy), attributed here to the module that ran it. How a hook's measurement
becomes a table row is `engine/replay/proberows.py`'s, the pass's record and its merge across ranks
`engine/replay/passstats.py`'s, the per-parameter figures `engine/replay/paramstats.py`'s. All are
re-exported, so `probes` stays the one import.

Over 400 lines: `ModuleProbe` is one class whose hooks, mapping pass and collection share
their state (the row table, the attention sites, the depth counter); split, that state
would travel between modules as private attributes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
from ckptforensics.engine.replay.passstats import PassStats, merge_ranks
from ckptforensics.engine.replay.proberows import BWD_STATS, FWD_STATS, Measurement, ProbeRows

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


# A rider's forward function (`ModuleProbe.ride`): (module, args, output) -> the gradient
# hook that output needs, or None.
_Rider = Callable[[nn.Module, Any, Any], Callable[[torch.Tensor], None] | None]


def _own_hook(out: object, extra: Callable[[torch.Tensor], None] | None) -> None:
    """A rider's gradient hook on an output the probe does not hook itself."""
    if extra is not None and isinstance(out, torch.Tensor):
        out.register_hook(extra)


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
        # What the hooks measured (`ProbeRows`: fp32 outputs straight into a raw buffer, others
        # pending), written to the tables at `collect` (`_flush`): a hook costs two
        # reductions, not a dozen small ops.
        kernels = fused.load() if torch.device(device).type == "cpu" else None
        self._fwd_rows = ProbeRows(self.fwd, kernels)
        self._bwd_rows = ProbeRows(self.bwd, kernels)
        # With activation checkpointing a block's modules run again in the backward pass:
        # only their first call in a pass is recorded.
        self.once = False
        self._ran: set[int] = set()
        # The last output measured: (tensor, its measurement, the modules its gradient
        # hook serves); a parent returning the same tensor reuses both.
        self._prev: tuple[torch.Tensor, Measurement, list[int] | None] | None = None
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
        """The hooks' pending measurements into the tables (`ProbeRows.flush`); a module that ran
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
        """The whole batch's statistics from every rank's share of its rows (`merge_ranks`)."""
        assert self.count is not None
        return merge_ranks(
            self.ranks, self.fwd, self.bwd, self.count, self.shared, attn, self._logits()
        )

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
