"""A token-level drafter: a small causal transformer over the target's vocabulary.

Contract: proposes k tokens per row autoregressively from its own KV cache, sampling with each
row's temperature / top-p (argmax for greedy rows) and returning the q it sampled from. Its
cache follows the engine's rows lazily: a slot remembers how many of its row's tokens are
cached, and each proposal first feeds what is missing. After a swap of weights every slot is
marked empty, so the new weights rebuild their own cache the next time they propose; nothing in
the engine waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.drafter.base import BUILT_IN_VERSION, DraftBatch, Proposal, check_sampled_drafts
from specd.drafter.swap import HotSwapped
from specd.model.distributions import sample_from, target_probs
from specd.model.seeded_draws import redraw_seeded_rows
from specd.model.transformer import KVCache, ModelConfig, Transformer


@dataclass(frozen=True)
class DrafterShape:
    """Size of a token drafter; the vocabulary and positions come from the target."""

    num_layers: int = 2
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    intermediate_size: int = 1536
    head_vocab_size: int | None = None  # None: predict the whole vocabulary (tied to the embedding)

    @classmethod
    def like(cls, target: ModelConfig, num_layers: int = 2, head_vocab_size: int | None = None) -> DrafterShape:
        """A drafter as wide as the target (so it can share its embeddings), with few layers."""
        return cls(num_layers, target.hidden_size, target.num_heads, target.num_kv_heads, target.intermediate_size,
                   head_vocab_size)

    def model_config(self, target: ModelConfig) -> ModelConfig:
        return ModelConfig(
            vocab_size=target.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, max_position=target.max_position,
            tie_embeddings=self.head_vocab_size is None, head_vocab_size=self.head_vocab_size,
            rope_llama3=target.rope_llama3)


@dataclass(frozen=True)
class TargetHead:
    """What a new drafter borrows from its target: the shape, the embedding and the output layer."""

    config: ModelConfig
    embed: torch.Tensor
    lm_head: torch.Tensor

    @classmethod
    def of(cls, target: Transformer) -> TargetHead:
        return cls(target.config, target.embed.weight, target.lm_head.weight)


def new_drafter_model(target: Transformer | TargetHead, shape: DrafterShape, copy_from_target: bool = True,
                      seed: int = 0) -> Transformer:
    """A randomly initialised drafter, optionally with the target's embeddings (and tied head)."""
    head = TargetHead.of(target) if isinstance(target, Transformer) else target
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Transformer(shape.model_config(head.config))
        for param in model.parameters():
            if param.dim() > 1:
                torch.nn.init.normal_(param, std=0.02)
    finally:
        torch.random.set_rng_state(generator_state)
    if copy_from_target:
        if shape.hidden_size != head.config.hidden_size:
            raise ValueError(f"copying embeddings needs the target's width {head.config.hidden_size}, "
                             f"the drafter has {shape.hidden_size}")
        with torch.no_grad():
            model.embed.weight.copy_(head.embed.float())
            if not model.config.tie_embeddings:
                model.lm_head.weight.copy_(head.lm_head[:model.config.output_size].float())
    return model.to(device=head.embed.device, dtype=head.embed.dtype).eval()


class TokenDrafter(HotSwapped[Transformer]):
    """Runs a drafter `Transformer` behind the `Drafter` protocol."""

    serves = Transformer

    def __init__(self, model: Transformer, version: int = BUILT_IN_VERSION, catchup_tokens_per_step: int = 256,
                 sampled_drafts: str = "sample") -> None:
        super().__init__(version)
        self.model = model
        self.catchup_tokens_per_step = catchup_tokens_per_step
        self.sampled_drafts = check_sampled_drafts(sampled_drafts)
        self._cache: KVCache | None = None
        self._cached: list[int] = []          # per slot: tokens of the row held in the cache
        self._proposed_from: list[int] = []   # per row: sequence length when the drafts were made
        self._ready: list[bool] = []          # per row: its cache was complete when it drafted
        self._k = 0

    def bind(self, max_batch: int, max_seq: int, device: torch.device) -> None:
        self._cache = self.model.new_cache(max_batch, max_seq)
        self._cached = [0] * max_batch

    def start(self, slot: int) -> None:
        self._cached[slot] = 0

    def move(self, src: int, dst: int) -> None:
        assert self._cache is not None
        self._cache.move_slot(src, dst, self._cached[src])
        self._cached[dst] = self._cached[src]

    def install(self, model: Transformer) -> None:
        """Take new weights between two steps; every slot rebuilds its cache on next proposal."""
        if self._cache is not None and model.config != self.model.config:
            self._cache = model.new_cache(self._cache.max_batch, self._cache.max_seq)
        self.model = model
        self._cached = [0] * len(self._cached)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        self.apply_pending()
        assert self._cache is not None, "bind() first"
        cache, model = self._cache, self.model
        lengths = batch.lengths.tolist()
        # feed the last `width` tokens of every row as one block; rows further behind catch up alone,
        # within a per-step token budget so that a swap (every row behind) never stalls one step
        width = min(2, min(lengths))
        budget = self.catchup_tokens_per_step
        ready = []
        for row, length in enumerate(lengths):
            behind = self._cached[row]
            chunk = min(length - width - behind, budget)
            if chunk > 0:
                model(batch.tokens[row:row + 1, behind:behind + chunk],
                      torch.tensor([behind], device=batch.tokens.device), cache, first_slot=row,
                      logits_for="none")
                self._cached[row] = behind + chunk
                budget -= chunk
            ready.append(self._cached[row] >= length - width)
        starts = batch.lengths - width
        rows = torch.arange(batch.num_rows, device=batch.tokens.device)
        block = batch.tokens[rows[:, None], starts[:, None] + torch.arange(width, device=starts.device)]
        logits, _ = model(block, starts, cache, logits_for="last")
        drafts, qs = [], []
        sampling = self.sampled_drafts == "sample" and not bool(batch.is_greedy.all())
        missing_vocab = model.config.vocab_size - model.config.output_size
        for i in range(k):
            assert logits is not None
            if sampling:
                q = target_probs(logits, batch.temperature, batch.top_p)[:, 0]  # [B, V'] over the head's ids
                q = F.pad(q, (0, missing_vocab))  # [B, V]: ids past the head have q = 0
                uniforms = torch.stack([torch.rand((), generator=g) for g in batch.generators])
                sampled = redraw_seeded_rows(sample_from(q, uniforms.to(q.device)), q, batch.noises, batch.lengths + i)
                draft = torch.where(batch.is_greedy, logits[:, 0].argmax(-1), sampled)
                qs.append(q)
            else:
                draft = logits[:, 0].argmax(-1)
            drafts.append(draft)
            if i < k - 1:
                logits, _ = model(draft[:, None], batch.lengths + i, cache, logits_for="last")
        self._proposed_from, self._ready, self._k = lengths, ready, k
        for row, length in enumerate(lengths):
            if ready[row]:
                self._cached[row] = length + k - 1
        # a row still catching up drafted from a partial cache: its drafts must not count
        limits = None if all(ready) else torch.tensor([k if r else 0 for r in ready], device=batch.tokens.device)
        return Proposal(torch.stack(drafts, dim=1), torch.stack(qs, dim=1) if sampling else None, limits)

    def commit(self, num_accepted: torch.Tensor) -> None:
        # d_1..d_{k-1} were fed; only the accepted ones are valid context
        for row, accepted in enumerate(num_accepted.tolist()):
            if self._ready[row]:
                self._cached[row] = self._proposed_from[row] + min(accepted, self._k - 1)
