"""One probed pass kept whole: every module's input and output in the forward, the gradient
at its output and at its input in the backward, in the order they happened.

`regress` compares two versions of the code element by element, so statistics are not
enough here (the replay's `ModuleProbe` keeps those): the tensors themselves are cloned on
their device. Inputs and outputs are both kept because a change between two modules (a
functional op in the parent's own forward: `F.gelu`, an attention call, a cast) shows first
as the *input* of the next module; the gradient at a module's input is its own backward's
(taken by an identity node in front of the module), apart from the gradient that other
consumers of the same tensor add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Event", "PassCapture", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True, slots=True)
class Event:
    """One tensor the pass produced at a module boundary.

    Attributes:
        key: unique in the pass: '<phase>.<side>:<module>' with '#k' for the module's k-th
            call after its first (a module called twice, a block recomputed).
        module: the model's own module name (`named_modules`).
        caller: the module running when `module` was called ('' for the model itself): where
            the code between two modules lives.
        phase: 'forward' (the tensor itself) or 'backward' (the loss's gradient at it).
        side: 'in' (the module's first floating input) or 'out' (its first floating output).
    """

    key: str
    module: str
    caller: str
    phase: str
    side: str


class _Tap(torch.autograd.Function):
    """Identity in front of a module: its backward sees the gradient this module alone
    sends to its input (a tensor hook on the input would see every consumer's sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.seen(g)
        return g, None


def _first_float(xs: Any) -> tuple[int | str, torch.Tensor] | None:
    """(position or keyword, tensor) of the first floating-point tensor among a module's
    arguments (a sequence or a keyword dict), or of its output (a tuple, an HF output)."""
    items = xs.items() if isinstance(xs, dict) else enumerate(xs)
    for k, v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return k, v
    return None


def _output_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        got = _first_float(out)
        return got[1] if got else None
    logits = getattr(out, "logits", None)  # transformers' ModelOutput
    if isinstance(logits, torch.Tensor) and logits.is_floating_point():
        return logits
    if isinstance(out, dict):  # a ModelOutput without logits (last_hidden_state first)
        got = _first_float(out)
        return got[1] if got else None
    return None


def _ident(t: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]:
    """What makes two tensors one (same memory, same view): a module's input that is the
    previous module's output is kept once."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class PassCapture:
    """Hooks on every named module for one pass (a context manager): `events` in the order
    they happened (forward, then backward as autograd ran it) and `tensors` by event key,
    cloned on the pass's device (an input that is the previous output is the same object)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.events: list[Event] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._stack: list[str] = []
        self._outputs: dict[tuple, tuple[str, torch.Tensor]] = {}  # _ident -> (key, original)
        self._handles: list[Any] = []

    def __enter__(self) -> PassCapture:
        for name, mod in self.model.named_modules():
            if name:
                self._handles.append(
                    mod.register_forward_pre_hook(self._pre(name), with_kwargs=True)
                )
                self._handles.append(mod.register_forward_hook(self._post(name), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._outputs.clear()  # the originals were held only to keep their memory unique

    def _key(self, phase: str, side: str, name: str) -> str:
        k = self._calls.get(name, 1)
        return f"{phase}.{side}:{name}" + (f"#{k}" if k > 1 else "")

    def _keep(self, ev: Event, t: torch.Tensor) -> None:
        self.events.append(ev)
        self.tensors[ev.key] = t

    def _grad(self, ev: Event) -> Callable[[torch.Tensor], None]:
        def seen(g: torch.Tensor) -> None:
            self._keep(ev, g.detach().clone())

        return seen

    def _pre(self, name: str):  # noqa: ANN202 - hook factory
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            self._calls[name] = self._calls.get(name, 0) + 1
            caller = self._stack[-1] if self._stack else ""
            self._stack.append(name)
            got = _first_float(args) or _first_float(kwargs)
            if got is None:
                return None
            where, x = got
            ev = Event(self._key(FORWARD, "in", name), name, caller, FORWARD, "in")
            same = self._outputs.get(_ident(x))
            self._keep(ev, self.tensors[same[0]] if same is not None else x.detach().clone())
            if not (torch.is_grad_enabled() and x.requires_grad):
                return None
            back = Event(self._key(BACKWARD, "in", name), name, caller, BACKWARD, "in")
            tapped = _Tap.apply(x, self._grad(back))
            if isinstance(where, int):
                args = (*args[:where], tapped, *args[where + 1 :])
            else:
                kwargs = {**kwargs, where: tapped}
            return args, kwargs

        return hook

    def _post(self, name: str):  # noqa: ANN202 - hook factory
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            t = _output_tensor(out)
            if t is None:
                return
            caller = self._stack[-1] if self._stack else ""
            ev = Event(self._key(FORWARD, "out", name), name, caller, FORWARD, "out")
            self._keep(ev, t.detach().clone())
            self._outputs[_ident(t)] = (ev.key, t)
            if t.requires_grad:
                back = Event(self._key(BACKWARD, "out", name), name, caller, BACKWARD, "out")
                t.register_hook(self._grad(back))

        return hook
