"""The decisions about one traced pass: each attention layer's placement, QK-norm and
soft-cap, the head and weight tying, read into an `Architecture`."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from ckptforensics.engine.trace.architecture import Architecture, AttentionLayer
from ckptforensics.engine.trace.graph import (
    Graph,
    back_to,
    descends,
    forward_to,
    is_add,
    tanh_before,
    walk_between,
)
from ckptforensics.engine.trace.recorder import AttnSite, NormSite, Trace


class Reader:
    """Decisions about one traced pass."""

    def __init__(self, trace: Trace, graph: Graph) -> None:
        self.t, self.g = trace, graph
        self.norm_out = trace.norms
        self.norm_in: dict[Any, NormSite] = {
            s.inp: s for s in trace.norms.values() if s.inp is not None
        }
        self._inner: dict[Any, set[Any]] = {}
        # The weighted nodes of norms fused into a projection: their input is normalised
        # inside the kernel, which the graph cannot show.
        self.fused_proj: set[Any] = {
            p for s in trace.fused.values() for p in self.projection_back([s.out])
        }

    def is_norm_out(self, n: Any) -> bool:
        return n in self.norm_out

    def normalised(self, n: Any) -> bool:
        """Every path back from `n`, through ops without weights, meets a norm output first."""
        stops = back_to(self.g, [n], lambda m: self.is_norm_out(m) or bool(self.g.weights(m)))
        return bool(stops) and all(self.is_norm_out(m) for m in stops)

    def input_normalised(self, proj: Any) -> bool:
        """A projection whose inputs are all norm outputs, or one a norm is fused into."""
        return proj in self.fused_proj or all(self.normalised(x) for x in self.g.data(proj))

    def projection_back(self, starts: list[Any]) -> list[Any]:
        """The first nodes with weights on every path back from `starts` (norms crossed)."""
        return back_to(self.g, starts, lambda m: bool(self.g.weights(m)))

    def internal(self, site: NormSite) -> set[Any]:
        """Nodes between a norm's input and its output (its own arithmetic)."""
        if site.out not in self._inner:
            self._inner[site.out] = set(walk_between(self.g, site.out, site.inp))
        return self._inner[site.out]

    def placement(self, site: AttnSite) -> tuple[str, Any]:
        """The layer's placement and its residual add node (None when not found)."""
        g = self.g
        projs = self.projection_back(site.qk)
        seen = any(p in self.fused_proj or g.data(p) for p in projs)
        pre = seen and all(self.input_normalised(p) for p in projs)
        proj_out = forward_to(g, site.out, lambda m: bool(g.weights(m)))
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
        if not is_add(node):
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


def read(trace: Trace, g: Graph, logits: torch.Tensor, names: dict[int, str]) -> Architecture:
    r = Reader(trace, g)
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
        softcap = site.kind == "softmax" and tanh_before(g, site.qk[0])
        st = per_call[i]
        rows = st[:, 2]
        ent = torch.where(rows > 0, st[:, 1] / rows.clamp_min(1), torch.tensor(math.nan))
        stream, resid = math.nan, math.nan
        if add is not None and add in add_rms:
            ra, rb, rs, na, nb = add_rms[add]
            branch_first = descends(g, na, site.out)
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
    final_softcap = tanh_before(g, logits.grad_fn, stop_at_weights=True)
    embeds = [n for n in g.inputs if type(n).__name__.startswith("EmbeddingBackward")]
    emb_w = [w for n in embeds for w in g.weights(n)]
    tied = None
    if head_w is not None:
        tied = any(w is head_w for w in emb_w)
    head_module = _module_of(trace, g, heads, logits.grad_fn)
    sites = (*trace.norms.values(), *trace.fused.values())
    norm_params = sorted({names[id(p)] for s in sites for p in s.params if id(p) in names})
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
        fused_norms=tuple(s.module for s in trace.fused.values() if s.module),
    )


def _eager_qk(r: Reader, site: AttnSite) -> bool:
    """Eager attention: the logits' two operands (the q k^T product's inputs) normalised."""
    prod = r.projection_back(site.qk)  # the projections of q and k
    operands = back_to(r.g, site.qk, lambda m: len(r.g.data(m)) >= 2 and not is_add(m))
    if not operands:
        return False
    return all(r.normalised(n) for m in operands for n in r.g.data(m)) and bool(prod)


def _module_of(trace: Trace, g: Graph, nodes: list[Any], end: Any) -> str | None:
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
