"""Small stand-ins that honour the real interfaces, for tests and cheap benchmarks.

Contract: deterministic for a seed; tiny enough to run anywhere in milliseconds. `tiny_target`
is a random Llama-family model; `learnable_target` is one whose greedy continuation follows a
fixed permutation of the vocabulary (token t is followed by successor[t]), so a drafter has real
structure to learn and its acceptance can rise measurably within a few hundred steps.
"""

from __future__ import annotations

import torch

from specd.model.transformer import ModelConfig, Transformer

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


class ByteTokenizer:
    """A tokenizer stand-in: UTF-8 bytes are ids 0..255, BOS 256, EOS 257, with a plain chat format."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return [self.bos_token_id, *self.encode(text + ("assistant: " if add_generation_prompt else ""))]


def tiny_loaded_target(folder: str = "tiny-llama", seed: int = 0):
    """A LoadedTarget over a tiny random model and the byte tokenizer (vocab 258)."""
    from pathlib import Path

    from specd.model.target import LoadedTarget

    config = ModelConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position=512)
    return LoadedTarget(Path(folder), tiny_target(config, seed=seed, dtype=torch.float32), ByteTokenizer())
