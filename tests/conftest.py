"""Shared stand-ins: tiny random Llama-family models that honour the real interfaces."""

from __future__ import annotations

import pytest

from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import EngineConfig
from specd.model.transformer import Transformer
from specd.testing import TINY, learnable_target, tiny_target

__all__ = ["TINY", "learnable_target", "tiny_target"]

TINY_DRAFTER = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=48)


def fixed_k(**fields) -> EngineConfig:
    """An engine config that drafts exactly num_draft_tokens every step (no lookahead control)."""
    return EngineConfig(adaptive_lookahead=False, **fields)


def tiny_drafter(target: Transformer, seed: int = 1) -> TokenDrafter:
    return TokenDrafter(new_drafter_model(target, TINY_DRAFTER, copy_from_target=True, seed=seed))


@pytest.fixture
def target() -> Transformer:
    return tiny_target()
