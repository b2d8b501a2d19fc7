"""What one traced forward pass showed: each attention layer, and the model's architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What `norm_placement` may say, per layer and for the model.
PLACEMENTS = ("pre", "post", "reordered", "sandwich", "none", "mixed", "unknown")


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
        fused_norms: modules that normalise their input inside the projection they compute
            (Transformer Engine's `LayerNormLinear`, Megatron's TE-layout `linear_qkv`):
            norms, seen by behaviour.
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
    fused_norms: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__slots__}  # type: ignore[attr-defined]
        out["layers"] = [{k: getattr(x, k) for k in x.__slots__} for x in self.layers]  # type: ignore[attr-defined]
        out["notes"] = list(self.notes)
        return out
