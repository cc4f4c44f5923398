"""Small stand-ins that honour the real interfaces, for tests and cheap benchmarks.

Contract: deterministic for a seed; tiny enough to run anywhere in milliseconds. `tiny_target`
is a random Llama-family model; `learnable_target` is one whose greedy continuation follows a
fixed permutation of the vocabulary (token t is followed by successor[t]), so a drafter has real
structure to learn and its acceptance can rise measurably within a few hundred steps.
"""

from __future__ import annotations

import torch

from specd.serving.model import ModelConfig, Transformer

TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position=256, rope_theta=10000.0)


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


def learnable_target(vocab_size: int = TINY.vocab_size, seed: int = 0) -> Transformer:
    config = ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position=256, tie_embeddings=False)
    # near-zero layers leave the residual stream ≈ the token's own embedding
    model = tiny_target(config, seed=seed + 3, scale=0.02)
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab_size, generator=generator)
    with torch.no_grad():
        model.embed.weight.copy_(torch.randn(vocab_size, 32, generator=generator).double())
        # row v of the output layer is the embedding of v's predecessor: t scores highest at successor[t]
        model.lm_head.weight.copy_(model.embed.weight[successor.argsort()] * 3)
    return model
