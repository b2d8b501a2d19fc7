"""A model's architecture read from one traced forward pass: where its norms sit, whether
queries and keys are normalised, what feeds the head — never from module names.

One forward pass runs with grad enabled under a `TorchFunctionMode` that sees every
attention call (`scaled_dot_product_attention`, or a softmax over the last dim of a
[B, H, T, S] tensor), every functional norm (`layer_norm`, `rms_norm`, `group_norm`,
`normalize`) and every two-tensor add, while module hooks record the order modules run.
A module is a norm when it behaves as one: its output does not change when its input is
scaled (x10 after scaling the input to unit RMS). The autograd graph then says which
tensors flow where:

- a weight is a >= 2-D parameter reached from a node through parameter-only ops (a
  transpose, a dtype cast); a node that takes one is a projection;
- QK-norm: every path back from the attention's queries and keys meets a norm output
  before any projection;
- each attention layer's placement follows its residual add (the first add downstream of
  its output projection that merges another stream): `post` when that sum is consumed
  only by a norm (the stream is normalised: Vaswani et al. 2017, BERT); `reordered` when
  a norm sits between the output projection and the add and the projection's input is
  not normalised (OLMo 2); `sandwich` when both (Gemma 2, CogView); `pre` when only the
  projection's input is normalised (GPT-2, Llama);
- the head is the first projection back from the logits; a tanh on that path is a
  soft-cap (Gemma 2); its weight being the token embedding's is weight tying.

Over 400 lines: the trace, the autograd graph and the reader that turns them into an
`Architecture` share one pass's private state (`_Trace`, `_Graph`, `_Reader`); split, those
types would become API between modules.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..replay.probes import attention_logit_stats, logits_of, softmax_logit_stats

__all__ = ["AttentionLayer", "Architecture", "trace_architecture", "trace_pass", "PLACEMENTS"]

# What `norm_placement` may say, per layer and for the model.
PLACEMENTS = ("pre", "post", "reordered", "sandwich", "none", "mixed", "unknown")

_NORM_FUNCS = tuple(
    f
    for f in (
        F.layer_norm,
        getattr(F, "rms_norm", None),
        F.group_norm,
        F.normalize,
        torch.layer_norm,
        getattr(torch, "rms_norm", None),
        torch.group_norm,
    )
    if f is not None
)
_ADD_FUNCS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
_SOFTMAX = (torch.softmax, F.softmax, torch.Tensor.softmax)
# The relative change of a norm's output when its (unit-RMS) input is scaled x10: its eps
# moves it by ~eps (1e-5 .. 1e-6); any non-normalising layer moves by O(1).
_SCALE_INVARIANT = 1e-3
# Ops that read a parameter at positions an input gives (token ids): their output is an
# activation, not a view of the parameter.
_READS_DATA = (
    "EmbeddingBackward",
    "EmbeddingBagBackward",
    "IndexBackward",
    "IndexSelectBackward",
    "GatherBackward",
)
# Nodes a graph walk visits at most (a walk that finds no stop within them gives up).
_WALK_LIMIT = 200_000


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """One attention call of the forward pass.

    Attributes:
        module: the innermost module running when the call was made (the model's own name).
        heads: query heads.
        placement: 'pre', 'post', 'reordered', 'sandwich', 'none' or 'unknown'.
        qk_norm: every path from its queries and keys back to a projection crosses a norm.
        softcap: a tanh on the logits before the softmax (eager attention; SDPA cannot have one).
        max_logit: largest pre-softmax logit on the traced batch.
        entropy: mean attention entropy / log(keys) of its most collapsed head (1 uniform, 0 one-hot).
        stream_rms: RMS of the residual stream just after its residual add (NaN: none found).
        residual_rms: RMS of the stream the add merged the attention into (NaN: none found).
    """

    module: str
    heads: int
    placement: str
    qk_norm: bool
    softcap: bool
    max_logit: float
    entropy: float
    stream_rms: float
    residual_rms: float


@dataclass(frozen=True, slots=True)
class Architecture:
    """What the traced forward pass showed.

    Attributes:
        norm_placement: the layers' common placement; 'mixed' when they differ.
        qk_norm: True when every attention layer normalises queries and keys; None when no
            attention call was seen.
        layers: every attention call, in forward order.
        norm_params: names of the parameters of the normalisation layers found.
        embedding_params: names of the parameters read by embedding lookups (token ids in).
        head_param: the output projection's weight (None: not found).
        head_module: the module whose output is (on the path to) the logits.
        tied_embeddings: the head's weight is a token embedding's (None: not determinable).
        final_softcap: a tanh between the head's projection and the logits.
        embed_rms: RMS of the stream entering the first attention layer's residual add.
        logit_max: largest output logit (signed) on the traced batch.
        logit_absmax: largest |output logit|.
        logit_mean: mean output logit.
        log_z: mean log-sum-exp of the output logits (nats).
        notes: what could not be decided, said plainly.
    """

    norm_placement: str
    qk_norm: bool | None
    layers: tuple[AttentionLayer, ...]
    norm_params: tuple[str, ...]
    embedding_params: tuple[str, ...]
    head_param: str | None
    head_module: str | None
    tied_embeddings: bool | None
    final_softcap: bool
    embed_rms: float
    logit_max: float
    logit_absmax: float
    logit_mean: float
    log_z: float
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        out["layers"] = [{k: getattr(x, k) for k in x.__slots__} for x in self.layers]  # type: ignore[attr-defined]
        out["notes"] = list(self.notes)
        return out


@dataclass(slots=True)
class _NormSite:
    """A normalisation seen in the pass: its input and output graph nodes, its parameters."""

    inp: Any
    out: Any
    params: list[torch.Tensor] = field(default_factory=list)
    module: str | None = None


@dataclass(slots=True)
class _AttnSite:
    kind: str
    module: str
    heads: int
    qk: list[Any]  # graph nodes of the queries and keys (SDPA), or of the logits (softmax)
    out: Any  # graph node of the attention output (SDPA) or the probabilities (softmax)
    stats: torch.Tensor  # [H, 3] (`attention_logit_stats`)


class _Recorder(TorchFunctionMode):
    """Records the functional norms, attention calls and two-tensor adds of one pass."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        t = self.trace
        if t.busy or not isinstance(out, torch.Tensor):
            return out
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1] if len(args) > 1 else kwargs["key"]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
            scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
            t.attention.append(
                _AttnSite(
                    "sdpa",
                    t.running(),
                    int(q.shape[-3]),
                    [q.grad_fn, k.grad_fn],
                    out.grad_fn,
                    attention_logit_stats(q, k, mask, causal, scale),
                )
            )
        elif func in _SOFTMAX and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim in (-1, 3) and args[0].is_floating_point():
                t.attention.append(
                    _AttnSite(
                        "softmax",
                        t.running(),
                        int(args[0].shape[1]),
                        [args[0].grad_fn],
                        out.grad_fn,
                        softmax_logit_stats(args[0]),
                    )
                )
        elif (
            func in _NORM_FUNCS
            and args
            and isinstance(args[0], torch.Tensor)
            and out.grad_fn is not None
        ):
            params = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, nn.Parameter)]
            t.add_norm(_NormSite(args[0].grad_fn, out.grad_fn, params))
        elif func in _ADD_FUNCS and _same_shape_add(args, out):
            a, b = args[0].detach(), args[1].detach()
            t.adds[out.grad_fn] = (
                _rms(a),
                _rms(b),
                _rms(out.detach()),
                args[0].grad_fn,
                args[1].grad_fn,
            )
        return out


def _same_shape_add(args: tuple, out: torch.Tensor) -> bool:
    """Two float tensors of one shape added (a residual add is one): their RMS is recorded."""
    return (
        len(args) >= 2
        and all(isinstance(a, torch.Tensor) and a.is_floating_point() for a in args[:2])
        and out.grad_fn is not None
        and args[0].shape == args[1].shape == out.shape
    )


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.float()) / math.sqrt(max(x.numel(), 1))


class _Trace:
    """Module calls and the recorder's sites of one forward pass."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stack: list[str] = []
        self.busy = False  # re-running a module to test it: record nothing
        self.norms: dict[Any, _NormSite] = {}  # output node -> site
        self.attention: list[_AttnSite] = []
        self.adds: dict[Any, tuple[Any, ...]] = {}
        self.outputs: dict[Any, str] = {}  # output node -> innermost module that returned it
        self.handles: list[Any] = []
        for name, mod in model.named_modules():
            if name:
                self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
                self.handles.append(mod.register_forward_hook(self._post(name)))

    def running(self) -> str:
        return self.stack[-1] if self.stack else ""

    def add_norm(self, site: _NormSite) -> None:
        old = self.norms.get(site.out)
        if old is not None:  # a norm module whose forward is a functional norm: one site
            old.params = old.params or site.params
            return
        self.norms[site.out] = site

    def _pre(self, name: str) -> Any:
        def hook(_m: nn.Module, _a: Any) -> None:
            if not self.busy:
                self.stack.append(name)

        return hook

    def _post(self, name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if self.busy:
                return
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                self.outputs.setdefault(out.grad_fn, name)
            x = (
                args[0]
                if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], torch.Tensor)
                else None
            )
            if (
                x is None
                or not isinstance(out, torch.Tensor)
                or out.grad_fn is None
                or not _norm_candidate(mod, x, out)
            ):
                return
            if _scale_invariant(self, mod, x):
                site = self.norms.get(out.grad_fn)
                params = [p for p in mod.parameters(recurse=False)]
                if site is None:
                    self.norms[out.grad_fn] = _NormSite(x.grad_fn, out.grad_fn, params, name)
                else:
                    site.module, site.params, site.inp = name, params or site.params, x.grad_fn

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def _norm_candidate(mod: nn.Module, x: torch.Tensor, out: torch.Tensor) -> bool:
    """A leaf module mapping a float tensor to one of its shape, with at most 1-D parameters."""
    return (
        not any(True for _ in mod.children())
        and x.is_floating_point()
        and out.shape == x.shape
        and x.numel() > 0
        and all(p.dim() <= 1 for p in mod.parameters(recurse=False))
    )


def _scale_invariant(trace: _Trace, mod: nn.Module, x: torch.Tensor) -> bool:
    """Whether `mod` normalises: f(c x) = f(10 c x) with c x at unit RMS, and f is not
    constant (f(c x) != f(-c x))."""
    with torch.no_grad():
        xs = x.detach().float()
        r = float(_rms(xs))
        if not math.isfinite(r) or r == 0:
            return False
        xs = (xs / r).to(x.dtype)
        trace.busy = True
        try:
            a, b, c = mod(xs), mod(10 * xs), mod(-xs)
        except (
            Exception
        ):  # a module that cannot be called on its own input again: not a norm we can test
            return False
        finally:
            trace.busy = False
        if not all(isinstance(t, torch.Tensor) for t in (a, b, c)):
            return False
        a, b, c = a.float(), b.float(), c.float()
        size = float(torch.linalg.vector_norm(a)) or 1.0
        same = float(torch.linalg.vector_norm(a - b)) / size
        odd = float(torch.linalg.vector_norm(a - c)) / size
        return same < _SCALE_INVARIANT and odd > _SCALE_INVARIANT


# --------------------------------------------------------------------------- the graph
class _Graph:
    """The autograd graph below the logits: inputs of each node, the nodes consuming each,
    and which inputs are weights (>= 2-D parameters through parameter-only ops)."""

    def __init__(self, root: Any) -> None:
        self.inputs: dict[Any, list[Any]] = {}
        self.consumers: dict[Any, list[Any]] = defaultdict(list)
        seen = {root}
        todo = [root]
        while todo and len(seen) < _WALK_LIMIT:
            n = todo.pop()
            ins = [f for f, _ in getattr(n, "next_functions", ()) if f is not None]
            self.inputs[n] = ins
            for f in ins:
                self.consumers[f].append(n)
                if f not in seen:
                    seen.add(f)
                    todo.append(f)
        self._param: dict[Any, torch.Tensor | None] = {}

    def param_of(self, n: Any) -> torch.Tensor | None:
        """The parameter a node carries through parameter-only ops, else None."""
        if n in self._param:
            return self._param[n]
        var = getattr(n, "variable", None)
        if isinstance(var, torch.Tensor):
            out: torch.Tensor | None = var
        elif type(n).__name__.startswith(_READS_DATA):
            out = None  # an embedding lookup: a parameter read at the input's indices is an activation
        else:
            ins = self.inputs.get(n)
            if ins is None:
                ins = [f for f, _ in getattr(n, "next_functions", ()) if f is not None]
            out = self.param_of(ins[0]) if len(ins) == 1 else None
        self._param[n] = out
        return out

    def weights(self, n: Any) -> list[torch.Tensor]:
        """>= 2-D parameters a node takes directly (through parameter-only ops)."""
        out = []
        for f in self.inputs.get(n, ()):
            p = self.param_of(f)
            if p is not None and p.dim() >= 2:
                out.append(p)
        return out

    def data(self, n: Any) -> list[Any]:
        """Inputs of a node that are not parameters."""
        return [f for f in self.inputs.get(n, ()) if self.param_of(f) is None]


def _back_to(g: _Graph, starts: Iterable[Any], stop: Any) -> list[Any]:
    """Walk back from `starts` until `stop(node)` is truthy; the nodes it stopped at (a path
    that runs out without a stop adds nothing)."""
    found, seen = [], set()
    todo = [s for s in starts if s is not None]
    while todo and len(seen) < _WALK_LIMIT:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if stop(n):
            found.append(n)
            continue
        todo.extend(g.data(n))
    return found


def _forward_to(g: _Graph, start: Any, stop: Any) -> Any:
    """Breadth-first from `start` along consumers to the first node where `stop` holds."""
    seen, frontier = {start}, [start]
    while frontier and len(seen) < _WALK_LIMIT:
        nxt = []
        for n in frontier:
            for c in g.consumers.get(n, ()):
                if c in seen:
                    continue
                if stop(c):
                    return c
                seen.add(c)
                nxt.append(c)
        frontier = nxt
    return None


def _is_add(n: Any) -> bool:
    return type(n).__name__.startswith("AddBackward")


class _Reader:
    """Decisions about one traced pass."""

    def __init__(self, trace: _Trace, graph: _Graph) -> None:
        self.t, self.g = trace, graph
        self.norm_out = trace.norms
        self.norm_in: dict[Any, _NormSite] = {
            s.inp: s for s in trace.norms.values() if s.inp is not None
        }
        self._inner: dict[Any, set[Any]] = {}

    def is_norm_out(self, n: Any) -> bool:
        return n in self.norm_out

    def normalised(self, n: Any) -> bool:
        """Every path back from `n`, through ops without weights, meets a norm output first."""
        stops = _back_to(self.g, [n], lambda m: self.is_norm_out(m) or bool(self.g.weights(m)))
        return bool(stops) and all(self.is_norm_out(m) for m in stops)

    def projection_back(self, starts: list[Any]) -> list[Any]:
        """The first nodes with weights on every path back from `starts` (norms crossed)."""
        return _back_to(self.g, starts, lambda m: bool(self.g.weights(m)))

    def internal(self, site: _NormSite) -> set[Any]:
        """Nodes between a norm's input and its output (its own arithmetic)."""
        if site.out not in self._inner:
            self._inner[site.out] = set(_walk_between(self.g, site.out, site.inp))
        return self._inner[site.out]

    def placement(self, site: _AttnSite) -> tuple[str, Any]:
        """The layer's placement and its residual add node (None when not found)."""
        g = self.g
        projs = self.projection_back(site.qk)
        xs = [d for p in projs for d in g.data(p)]
        pre = bool(xs) and all(self.normalised(x) for x in xs)
        proj_out = _forward_to(g, site.out, lambda m: bool(g.weights(m)))
        if proj_out is None:
            return "unknown", None
        node, post_norm = proj_out, False
        for _ in range(64):  # follow the branch to its residual add
            site_n = self.norm_in.get(node)
            if site_n is not None:
                post_norm, node = True, site_n.out
                continue
            nxt = [c for c in g.consumers.get(node, ())]
            if len(nxt) != 1:
                break
            c = nxt[0]
            if len(g.data(c)) >= 2:
                node = c
                break
            if g.weights(c):
                return "unknown", None
            node = c
        if not _is_add(node):
            return "unknown", None
        add = node
        if self._stream_normalised(add):
            return "post", add
        if post_norm:
            return ("sandwich" if pre else "reordered"), add
        return ("pre" if pre else "none"), add

    def _stream_normalised(self, add: Any) -> bool:
        """The residual sum is consumed by a norm and by nothing else (post-LN)."""
        site = self.norm_in.get(add)
        if site is None:
            return False
        others = [
            c
            for c in self.g.consumers.get(add, ())
            if c not in self.internal(site) and c is not site.out
        ]
        return not others


def _walk_between(g: _Graph, out: Any, inp: Any) -> list[Any]:
    """Nodes from `out` back to (not including) `inp`."""
    found, seen, todo = [], set(), [out]
    while todo and len(seen) < 10_000:
        n = todo.pop()
        if n in seen or n is inp:
            continue
        seen.add(n)
        found.append(n)
        todo.extend(g.data(n))
    return found


# --------------------------------------------------------------------------- the pass
def _call(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The model called with keywords, else with the ids alone (a caller that knows the
    run's calling convention passes its own `call`)."""
    ids = batch["input_ids"]
    kwargs = {"input_ids": ids}
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    try:
        return model(**kwargs)
    except TypeError:
        return model(ids)


Call = Callable[[nn.Module, dict[str, torch.Tensor]], Any]


def trace_architecture(
    model: nn.Module, batch: dict[str, torch.Tensor], call: Call | None = None
) -> Architecture:
    """Run one forward pass of `model` on `batch` (on the model's device; grad enabled, no
    backward) and read the architecture off it.

    Args:
        model: the model, its weights loaded (eval mode is set for the pass: no dropout).
        batch: `input_ids` [B, T] (and optionally `attention_mask`).
        call: how to call the model (`replay.conventions.call_model` with the run's
            convention); default: keywords, else the ids alone.

    Returns:
        The architecture (`Architecture`); what could not be decided is in its notes.

    Example:
        >>> arch = trace_architecture(model, {"input_ids": ids})
        >>> arch.norm_placement, arch.qk_norm
        ('pre', False)
    """
    return trace_pass(model, batch, call)[0]


def trace_pass(
    model: nn.Module, batch: dict[str, torch.Tensor], call: Call | None = None
) -> tuple[Architecture, torch.Tensor]:
    """`trace_architecture`, and the pass's logits with their graph (a caller may take the
    gradient of a loss on them: the audit's RMS_t)."""
    was_training = model.training
    model.eval()
    trace = _Trace(model)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied weight under its first name
    needs = [p for p in model.parameters() if not p.requires_grad]
    for p in needs:  # the graph needs every weight as a leaf
        p.requires_grad_(True)
    try:
        with torch.enable_grad(), _Recorder(trace):
            out = (call or _call)(model, batch)
    finally:
        trace.remove()
        for p in needs:
            p.requires_grad_(False)
        model.train(was_training)
    logits = logits_of(out)
    if logits is None or logits.grad_fn is None:
        raise ValueError("the model's output has no logits with a gradient graph")
    g = _Graph(logits.grad_fn)
    return _read(trace, g, logits, names), logits


def _read(trace: _Trace, g: _Graph, logits: torch.Tensor, names: dict[int, str]) -> Architecture:
    r = _Reader(trace, g)
    notes: list[str] = []
    layers = []
    embed_rms = math.nan
    # One host read for every number of the pass.
    table = [s.stats for s in trace.attention]
    adds = list(trace.adds.items())
    lg = logits.detach().float()
    head_stats = torch.stack([lg.max(), lg.abs().max(), lg.mean(), torch.logsumexp(lg, -1).mean()])
    parts = [
        *(t.reshape(-1).float() for t in table),
        *(torch.stack([a[0], a[1], a[2]]).float() for _, a in adds),
        head_stats,
    ]
    flat = torch.cat([x.to(lg.device) for x in parts]).cpu().tolist()
    pos = 0
    per_call = []
    for t in table:
        n = t.numel()
        per_call.append(torch.tensor(flat[pos : pos + n]).reshape(t.shape))
        pos += n
    add_rms = {}
    for node, a in adds:
        add_rms[node] = (flat[pos], flat[pos + 1], flat[pos + 2], a[3], a[4])
        pos += 3
    logit_max, logit_absmax, logit_mean, log_z = flat[pos : pos + 4]
    for i, site in enumerate(trace.attention):
        placement, add = r.placement(site)
        qk = (
            bool(site.qk) and all(r.normalised(n) for n in site.qk if n is not None)
            if site.kind == "sdpa"
            else _eager_qk(r, site)
        )
        softcap = site.kind == "softmax" and _tanh_before(g, site.qk[0])
        st = per_call[i]
        rows = st[:, 2]
        ent = torch.where(rows > 0, st[:, 1] / rows.clamp_min(1), torch.tensor(math.nan))
        stream, resid = math.nan, math.nan
        if add is not None and add in add_rms:
            ra, rb, rs, na, nb = add_rms[add]
            branch_first = _descends(g, na, site.out)
            resid = rb if branch_first else ra
            stream = rs
        layers.append(
            AttentionLayer(
                module=site.module,
                heads=site.heads,
                placement=placement,
                qk_norm=qk,
                softcap=softcap,
                max_logit=float(st[:, 0].max()) if st.numel() else math.nan,
                entropy=float(torch.nan_to_num(ent, nan=math.inf).min())
                if ent.numel() and bool(torch.isfinite(ent).any())
                else math.nan,
                stream_rms=stream,
                residual_rms=resid,
            )
        )
    if layers:
        embed_rms = layers[0].residual_rms
    kinds = Counter(x.placement for x in layers)
    if not layers:
        placement = "unknown"
        notes.append(
            "no attention call was seen (no scaled_dot_product_attention, no softmax over [B, H, T, S])"
        )
    elif len(kinds) == 1:
        placement = layers[0].placement
    else:
        known = Counter({k: v for k, v in kinds.items() if k != "unknown"})
        placement = known.most_common(1)[0][0] if len(known) == 1 else "mixed"
        notes.append(
            "placements per layer: " + ", ".join(f"{k} x{v}" for k, v in kinds.most_common())
        )
    if placement == "unknown" and layers:
        notes.append("no residual add was found after the attention's output projection")
    qk_norm = all(x.qk_norm for x in layers) if layers else None
    # The head: the first projection back from the logits.
    heads = r.projection_back([logits.grad_fn])
    head_w = next((w for h in heads for w in g.weights(h)), None)
    head_param = names.get(id(head_w)) if head_w is not None else None
    final_softcap = _tanh_before(g, logits.grad_fn, stop_at_weights=True)
    embeds = [n for n in g.inputs if type(n).__name__.startswith("EmbeddingBackward")]
    emb_w = [w for n in embeds for w in g.weights(n)]
    tied = None
    if head_w is not None:
        tied = any(w is head_w for w in emb_w)
    head_module = _module_of(trace, g, heads, logits.grad_fn)
    norm_params = sorted(
        {names[id(p)] for s in trace.norms.values() for p in s.params if id(p) in names}
    )
    return Architecture(
        norm_placement=placement,
        qk_norm=qk_norm,
        layers=tuple(layers),
        norm_params=tuple(norm_params),
        embedding_params=tuple(sorted({names[id(w)] for w in emb_w if id(w) in names})),
        head_param=head_param,
        head_module=head_module,
        tied_embeddings=tied,
        final_softcap=final_softcap,
        embed_rms=embed_rms,
        logit_max=logit_max,
        logit_absmax=logit_absmax,
        logit_mean=logit_mean,
        log_z=log_z,
        notes=tuple(notes),
    )


def _eager_qk(r: _Reader, site: _AttnSite) -> bool:
    """Eager attention: the logits' two operands (the q k^T product's inputs) normalised."""
    prod = r.projection_back(site.qk)  # the projections of q and k
    operands = _back_to(r.g, site.qk, lambda m: len(r.g.data(m)) >= 2 and not _is_add(m))
    if not operands:
        return False
    return all(r.normalised(n) for m in operands for n in r.g.data(m)) and bool(prod)


def _tanh_before(g: _Graph, start: Any, stop_at_weights: bool = False) -> bool:
    """A tanh on the path back from `start` before the first node with weights."""
    seen, todo = set(), [start]
    while todo and len(seen) < 10_000:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if type(n).__name__.startswith("TanhBackward"):
            return True
        if g.weights(n):
            continue
        todo.extend(g.data(n))
    return False


def _descends(g: _Graph, node: Any, ancestor: Any) -> bool:
    """Whether `ancestor` is reached walking back from `node` (through data inputs)."""
    seen, todo = set(), [node]
    while todo and len(seen) < _WALK_LIMIT:
        n = todo.pop()
        if n is None or n in seen:
            continue
        if n is ancestor:
            return True
        seen.add(n)
        todo.extend(g.data(n))
    return False


def _module_of(trace: _Trace, g: _Graph, nodes: list[Any], end: Any) -> str | None:
    """The innermost module whose output is one of `nodes` or a node after them on the way
    to `end` (the head's projection, then its bias, cast or soft-cap)."""
    for n in nodes:
        cur = n
        for _ in range(32):
            if cur in trace.outputs:
                return trace.outputs[cur]
            if cur is end:
                break
            nxt = g.consumers.get(cur, ())
            if len(nxt) != 1:
                break
            cur = nxt[0]
    return None
