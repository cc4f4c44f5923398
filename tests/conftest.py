"""Shared stand-ins: tiny random Llama-family models that honour the real interfaces."""

from __future__ import annotations

import pytest
import torch

from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.serving.model import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position=256, rope_theta=10000.0)
TINY_DRAFTER = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)


def tiny_target(config: ModelConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float64,
                scale: float = 0.3) -> Transformer:
    """A random target whose logits are peaked enough that greedy paths are not all ties."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, scale)
    return model.to(dtype).eval()


def tiny_drafter(target: Transformer, seed: int = 1) -> TokenDrafter:
    return TokenDrafter(new_drafter_model(target, TINY_DRAFTER, copy_from_target=True, seed=seed))


@pytest.fixture
def target() -> Transformer:
    return tiny_target()
