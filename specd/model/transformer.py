"""A compact Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) with static KV caches.

Contract: `Transformer.forward` runs a block of tokens for rows that occupy consecutive cache slots,
each row starting at its own position, and writes their keys and values into the cache at those
positions. Nothing is ever rolled back: a later write at the same position overwrites a stale entry,
and the causal mask hides every slot at or beyond a query's own position + 1, so rejected drafts
left in the cache are never seen. A pass of a few rows a call (a decoding step or a verification
pass, float32, one thread) runs each block in one C call (`specd.model.fused_layer`), which gives a
row the same bits however many rows and positions share the pass (what keeps greedy speculation
lossless); longer passes (prefill) and training take the torch path. The model knows nothing about
tokenisers, sampling or speculation; the target and the token-level drafter are both this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from specd.model.fused_layer import FusedLayer, c_positions
from specd.model.packed_linear import PackedLinear

LogitsFor = Literal["all", "last", "none"]
# queries per row up to which attention over the cache is two plain matmuls (`attend_few`) instead
# of torch's CPU flash kernel: decoding and verification. For one query per row at batch 64 in
# bfloat16 the kernel takes 10.1 ms a layer against 2.9 ms (it was 71% of bulk generation's time);
# for a 48-token prefill chunk the kernel is ahead (0.96 against 1.45 ms) and never builds the whole
# score matrix. benchmarks/attention_paths.py
FEW_QUERIES = 16


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder; Qwen2 adds qkv biases, Qwen3 adds q/k RMS norms."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # a drafter may predict only ids [0, head_vocab_size): BPE ids run roughly by frequency, so a
    # prefix of the vocabulary covers most tokens at a fraction of the output layer's cost
    head_vocab_size: int | None = None
    # llama3-style rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position)
    rope_llama3: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.head_vocab_size is not None and not 0 < self.head_vocab_size <= self.vocab_size:
            raise ValueError(f"model config: head_vocab_size must be in (0, {self.vocab_size}]")
        if self.tie_embeddings and self.output_size != self.vocab_size:
            raise ValueError("model config: a tied output layer must cover the whole vocabulary")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def output_size(self) -> int:
        return self.head_vocab_size or self.vocab_size

    @property
    def num_parameters(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size + (0 if self.tie_embeddings else self.output_size * self.hidden_size)
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + self.hidden_size


class KVCache:
    """Keys and values for `max_batch` slots of `max_seq` positions each, one pair per layer."""

    def __init__(self, config: ModelConfig, max_batch: int, max_seq: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (config.num_layers, max_batch, config.num_kv_heads, max_seq, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq(self) -> int:
        return self.k.shape[3]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (batch compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def rope_tables(config: ModelConfig, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles for positions [0, length): each [length, head_dim / 2]."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) * 2 / config.head_dim))
    if config.rope_llama3 is not None:
        factor, low, high, original = config.rope_llama3
        wavelen = 2 * math.pi / inv_freq
        smooth = ((original / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= original / low) & (wavelen >= original / high)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x: [B, H, T, D] with cos/sin [B, 1, T, D/2] (HF's rotate_half layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, input_size: int | None = None) -> None:
        super().__init__()
        self.config = config
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q, k and v fused into one matmul: fewer, larger kernels are what a CPU decode step needs
        # (a feature drafter's layer reads [embedding, state] side by side: twice the width)
        self.qkv = PackedLinear(input_size or config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o = PackedLinear(q_size, config.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_index: torch.Tensor,
                positions: torch.Tensor, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        q = q.view(batch, length, cfg.num_heads, cfg.head_dim)  # [B, T, H, D]
        k = k.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(batch, length, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)
        gqa = cfg.num_heads != cfg.num_kv_heads
        if k_cache is None or v_cache is None:  # training: whole sequences, no cache
            out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=gqa)
            return self.o(out.transpose(1, 2).reshape(batch, length, -1))
        # k_cache: [B, Hkv, S, D]; advanced indices (row, position) put the [B, T] dims first
        k_cache[write_index, :, positions] = k.transpose(1, 2)
        v_cache[write_index, :, positions] = v
        kv_len = mask.shape[-1] if mask is not None else int(positions.max()) + 1
        keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        if length <= FEW_QUERIES:
            out = attend_few(q, keys, values, mask)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


def attend_few(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of a few queries per row, as `scaled_dot_product_attention(..., enable_gqa=True)`:
    q [B, H, T, D] against keys and values [B, Hkv, L, D], mask [B, 1, T, L] (True: visible) or
    None; query head h reads key head h // (H / Hkv). Scores and softmax in float32 at least."""
    batch, heads, length, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    # the query heads that share a key head side by side: one matmul per key head, no repeated keys
    scores = q.reshape(batch, kv_heads, groups * length, dim) @ keys.transpose(-1, -2)
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    scores = scores.mul_(1.0 / math.sqrt(dim)).view(batch, kv_heads, groups, length, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype).view(batch, kv_heads, groups * length, -1)
    return (weights @ values).view(batch, heads, length, dim)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up = PackedLinear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = PackedLinear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = MLP(config)
        self.fused = FusedLayer((self.attn_norm,), self.attn, self.mlp_norm, self.mlp)  # a few positions, in C


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = PackedLinear(config.hidden_size, config.output_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def new_cache(self, max_batch: int, max_seq: int) -> KVCache:
        weight = self.embed.weight
        return KVCache(self.config, max_batch, max_seq, weight.dtype, weight.device)

    def train_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [B, T, output_size] for whole sequences from position 0, no cache."""
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).expand(batch, length)
        cos_table, sin_table = self._rope_tables(length)
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
        x = self.embed(tokens)
        for block in cast(list[Block], self.blocks):
            x = x + block.attn(block.attn_norm(x), cos, sin, positions, positions, None, None, None)
            x = x + block.mlp(block.mlp_norm(x))
        return cast(torch.Tensor, self.lm_head(self.norm(x)))

    def train_features(self, tokens: torch.Tensor, capture_layers: tuple[int, ...]) -> torch.Tensor:
        """Features [B, T, len(capture_layers) * hidden] of whole sequences, no cache: the residual
        stream after each captured layer (see `forward`)."""
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).expand(batch, length)
        cos_table, sin_table = self._rope_tables(length)
        cos, sin = cos_table[positions][:, None], sin_table[positions][:, None]
        x = self.embed(tokens)
        captured = []
        for layer, block in enumerate(cast(list[Block], self.blocks)):
            x = x + block.attn(block.attn_norm(x), cos, sin, positions, positions, None, None, None)
            x = x + block.mlp(block.mlp_norm(x))
            if layer in capture_layers:
                captured.append(x)
        return torch.cat(captured, dim=-1)

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].device != self.embed.weight.device:
            self._rope = rope_tables(self.config, max(length, self.config.max_position), self.embed.weight.device)
        return self._rope

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache, first_slot: int = 0,
                logits_for: LogitsFor = "all", return_hidden: bool = False,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run tokens [B, T] for slots first_slot..first_slot+B-1, row b at positions start[b]+t.

        Returns (logits, hidden): logits [B, T, V] for "all", [B, 1, V] for "last", None for "none";
        hidden only when asked for: for each layer index in `capture_layers`, the residual stream
        after that layer, side by side [B, T, len(capture_layers) * hidden] (a feature drafter's
        input, captured by the same pass at no extra target cost; vLLM's EAGLE-3 "auxiliary hidden
        states" at layer ids capture + 1), or the final normed states when none is named.
        """
        batch, length = tokens.shape
        positions = start[:, None] + torch.arange(length, device=tokens.device)  # [B, T]
        rope = self._rope_tables(cache.max_seq)
        x = self.embed(tokens)
        slots = slice(first_slot, first_slot + batch)
        captured, inputs = [], None
        where = c_positions(positions, cache.max_seq, rope)  # checked once for every block's C call
        for layer, block in enumerate(cast(list[Block], self.blocks)):
            fused = None if where is None else block.fused(x, where, cache.k[layer, slots], cache.v[layer, slots], rope)
            if fused is not None:
                x = fused
            else:
                if inputs is None:  # made once, at the first layer the C call does not serve
                    inputs = _attention_inputs(start, positions, rope)
                h = block.attn_norm(x)
                cos, sin, write_index, mask = inputs
                x = x + block.attn(h, cos, sin, write_index, positions, cache.k[layer, slots], cache.v[layer, slots],
                                   mask)
                x = x + block.mlp(block.mlp_norm(x))
            if return_hidden and layer in capture_layers:
                captured.append(x)
        if logits_for == "none" and not return_hidden:
            return None, None
        hidden = self.norm(x[:, -1:] if logits_for == "last" and not return_hidden else x)
        logits = None
        if logits_for == "all":
            logits = self.lm_head(hidden)
        elif logits_for == "last":
            logits = self.lm_head(hidden[:, -1:])
        if not return_hidden:
            return logits, None
        return logits, (torch.cat(captured, dim=-1) if captured else hidden)


def _attention_inputs(start: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`Attention.forward`'s cos, sin, write_index and mask for rows starting at `start`."""
    batch, length = positions.shape
    cos, sin = rope[0][positions][:, None], rope[1][positions][:, None]  # [B, 1, T, D/2]
    mask: torch.Tensor | None = None
    if length > 1 or batch > 1:
        # query (b, t) sees cache positions 0..start[b]+t: stale entries past it stay hidden
        kv_len = int(start.max()) + length
        mask = (torch.arange(kv_len, device=positions.device) <= positions[:, :, None])[:, None]  # [B, 1, T, L]
    write_index = torch.arange(batch, device=positions.device)[:, None]  # [B, 1]
    return cos, sin, write_index, mask
