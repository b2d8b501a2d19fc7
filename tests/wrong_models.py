"""Models with the fixture GPT's parameters (same names, same shapes) and another forward:
what a user who points `--model` at the wrong code hands the replay. Loading succeeds;
only the run's own log can tell (tests/test_conventions.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fixtures.tinygpt import GPT, MLP, Block, GPTConfig


def _gpt(**kwargs: int) -> GPT:
    known = set(GPTConfig.__dataclass_fields__)
    return GPT(GPTConfig(**{k: v for k, v in kwargs.items() if k in known}))


class _ReluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)))


class _PostLNBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


def relu_factory(**kwargs: int) -> GPT:
    """The same GPT with ReLU where the run used GELU."""
    model = _gpt(**kwargs)
    for block in model.transformer.h:
        block.mlp.__class__ = _ReluMLP
    return model


def post_ln_factory(**kwargs: int) -> GPT:
    """The same GPT with its norms after the sublayers (post-LN) where the run was pre-LN."""
    model = _gpt(**kwargs)
    for block in model.transformer.h:
        block.__class__ = _PostLNBlock
    return model
