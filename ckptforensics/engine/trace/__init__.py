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

One module a seam: `architecture` (what the pass showed: `Architecture`, `AttentionLayer`),
`recorder` (the trace: the recorder of functional calls, the module hooks, the norm test),
`graph` (the autograd graph and its walks), `reader` (the decisions that turn a trace and its
graph into an `Architecture`), `forward` (the pass itself: `trace_architecture`, `trace_pass`).
"""

from __future__ import annotations

from ckptforensics.engine.trace.architecture import PLACEMENTS, Architecture, AttentionLayer
from ckptforensics.engine.trace.forward import Call as Call
from ckptforensics.engine.trace.forward import trace_architecture, trace_pass

__all__ = ["AttentionLayer", "Architecture", "trace_architecture", "trace_pass", "PLACEMENTS"]
