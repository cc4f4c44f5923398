"""A feature-level drafter (EAGLE-3-like): drafts from the target's own hidden states.

Contract: the engine hands it, through `observe`, the target's features (the layers named by
`capture_layers`, see `specd.drafter.feature_model`) of every position of every row, captured by
the prefill and verification passes it runs anyway; the drafter keeps them per slot and answers
`propose` like any `Drafter`. For a row of length L, entries 0..L-2 are target-fed (features at t,
token t + 1); the output state of entry L-2 gives draft 1, and draft j + 1 comes from the chained
entry L-2+j, which reads the drafter's own previous state and draft j. Its KV cache follows the
rows lazily: a slot remembers how many target-fed entries it holds (`fed`), each proposal feeds
the missing ones first, and the chain's entries are overwritten by the next proposal. After a
swap of weights every slot is marked empty and the new weights rebuild their cache from the
stored features within a per-step budget; a row that is not caught up, or has no features yet
(a one-token prompt before its first step), drafts nothing (`Proposal.limits`).
"""

from __future__ import annotations

import torch

from specd.drafter.base import BUILT_IN_VERSION, DraftBatch, Proposal, check_sampled_drafts
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.swap import HotSwapped
from specd.model.distributions import sample_from, target_probs
from specd.model.seeded_draws import redraw_seeded_rows
from specd.model.transformer import KVCache


class FeatureDrafter(HotSwapped[FeatureDrafterModel]):
    """Runs a `FeatureDrafterModel` behind the `Drafter` protocol."""

    serves = FeatureDrafterModel

    def __init__(self, model: FeatureDrafterModel, version: int = BUILT_IN_VERSION,
                 catchup_tokens_per_step: int = 256, sampled_drafts: str = "sample") -> None:
        super().__init__(version)
        self.model = model
        self.catchup_tokens_per_step = catchup_tokens_per_step
        self.sampled_drafts = check_sampled_drafts(sampled_drafts)
        self._cache: KVCache | None = None
        self._history: torch.Tensor | None = None  # [max_batch, max_seq, feature_size] fp16, the target's
        self._known: list[int] = []  # per slot: positions 0..known-1 have features
        self._fed: list[int] = []    # per slot: target-fed entries 0..fed-1 cached for the current weights

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose residual streams this drafter reads (the engine captures them)."""
        return self.model.config.capture_layers

    def bind(self, max_batch: int, max_seq: int, device: torch.device) -> None:
        self._cache = self.model.new_cache(max_batch, max_seq)
        self._history = torch.zeros(max_batch, max_seq, self.model.config.feature_size, dtype=torch.float16,
                                    device=device)
        self._known, self._fed = [0] * max_batch, [0] * max_batch

    def start(self, slot: int) -> None:
        self._known[slot] = self._fed[slot] = 0

    def move(self, src: int, dst: int) -> None:
        assert self._cache is not None and self._history is not None
        known = self._known[src]
        self._history[dst, :known] = self._history[src, :known]
        self._cache.move_slot(src, dst, self._fed[src])
        self._known[dst], self._fed[dst] = known, self._fed[src]

    def history(self, slot: int) -> torch.Tensor:
        """The target's features stored for the row in `slot`: [known positions, feature_size], fp16."""
        assert self._history is not None, "bind() first"
        return self._history[slot, :self._known[slot]]

    def observe(self, slot: int, start: int, features: torch.Tensor) -> None:
        """The target's features [n, feature_size] of positions start..start+n-1 of the row in `slot`."""
        assert self._history is not None, "bind() first"
        if start > self._known[slot]:  # a gap (the drafter joined mid-request): the row never drafts
            return
        self._history[slot, start:start + len(features)] = features
        self._known[slot] = start + len(features)
        # entries from `start` on were built from the features they replace
        self._fed[slot] = min(self._fed[slot], start)

    def install(self, model: FeatureDrafterModel) -> None:
        """Take new weights between two steps; every slot rebuilds its cache on next proposal."""
        if self._cache is not None and self._history is not None:
            cache, history = self._cache, self._history
            if model.config != self.model.config or model.head.weight.dtype != cache.k.dtype:
                self._cache = model.new_cache(cache.max_batch, cache.max_seq)
            if model.config.capture_layers != self.model.config.capture_layers:
                # the stored features are other layers': rows in flight draft nothing until they end
                self._history = history.new_zeros(*history.shape[:2], model.config.feature_size)
                self._known = [0] * len(self._known)
        self.model = model
        self._fed = [0] * len(self._fed)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        self.apply_pending()
        assert self._cache is not None, "bind() first"
        model, device = self.model, batch.tokens.device
        lengths = batch.lengths.tolist()
        # feed the last `width` entries of every row as one block (re-feeding a cached entry writes
        # what it holds); rows further behind catch up alone, within a per-step budget, so that a
        # swap (every row behind) never stalls one step
        behind = max(length - 1 - self._fed[row] for row, length in enumerate(lengths))
        width = max(1, min(behind, k + 1))
        starts = [max(length - 1 - width, 0) for length in lengths]
        ready = self._catch_up(batch.tokens, lengths, starts)
        starts_t = torch.tensor(starts, device=device)
        state = self._feed_block(batch.tokens, starts_t, width)  # [B, width, hidden]
        for row, length in enumerate(lengths):
            if ready[row]:  # caught up to the block, which fed the rest up to entry L-2
                self._fed[row] = length - 1
        rows = torch.arange(batch.num_rows, device=device)
        state = state[rows, (batch.lengths - 2 - starts_t).clamp(min=0)][:, None]  # entry L-2: [B, 1, hidden]
        drafts, qs = [], []
        for i in range(k):
            draft, q = self._draw(model.logits(state), batch, i)
            drafts.append(draft)
            if q is not None:
                qs.append(q)
            if i < k - 1:  # entry L-1+i: the previous output state and draft i+1
                state = model.step(state, draft[:, None], batch.lengths - 1 + i, self._cache)
        limits = None if all(ready) else torch.tensor([k if r else 0 for r in ready], device=device)
        return Proposal(torch.stack(drafts, dim=1), torch.stack(qs, dim=1) if qs else None, limits)

    def _catch_up(self, tokens: torch.Tensor, lengths: list[int], starts: list[int]) -> list[bool]:
        """Feed rows behind their block alone, within the step's budget; which rows can draft."""
        budget = self.catchup_tokens_per_step
        ready = []
        for row, (length, start) in enumerate(zip(lengths, starts, strict=True)):
            has_features = length >= 2 and self._known[row] >= length - 1
            fed = self._fed[row]
            chunk = min(start - fed, budget) if has_features else 0
            if chunk > 0:
                self._feed_row(tokens, row, fed, chunk)
                self._fed[row] = fed = fed + chunk
                budget -= chunk
            ready.append(has_features and fed >= start)
        return ready

    def _feed_row(self, tokens: torch.Tensor, row: int, begin: int, count: int) -> None:
        """Entries begin..begin+count-1 of one row: the target's features and the next tokens."""
        assert self._cache is not None and self._history is not None
        state = self.model.fuse_features(self._history[row:row + 1, begin:begin + count])
        start = torch.tensor([begin], device=tokens.device)
        self.model.step(state, tokens[row:row + 1, begin + 1:begin + count + 1], start, self._cache, first_slot=row)

    def _feed_block(self, tokens: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
        """Entries starts[b]..starts[b]+width-1 of every row; their output states [B, width, hidden]."""
        assert self._cache is not None and self._history is not None
        rows = torch.arange(len(starts), device=tokens.device)[:, None]
        positions = starts[:, None] + torch.arange(width, device=tokens.device)  # [B, width]
        state = self.model.fuse_features(self._history[rows, positions])
        return self.model.step(state, tokens[rows, positions + 1], starts, self._cache)

    def _draw(self, logits: torch.Tensor, batch: DraftBatch, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts [B] (target ids) for the tokens at index lengths + `step` from draft-vocabulary
        logits [B, 1, N]; with sampled rows, also the full-vocabulary q [B, V] they were drawn from
        (zero outside the draft vocabulary). A seeded row draws with its seed's noise for that index
        (the target's own draw there whenever q is close to p: `specd.model.seeded_draws`)."""
        draft_ids = self.model.draft_ids  # [N] target id of each draft-vocabulary index
        greedy = logits[:, 0].argmax(-1)
        if self.sampled_drafts == "argmax" or bool(batch.is_greedy.all()):
            return draft_ids[greedy], None
        q_draft = target_probs(logits, batch.temperature, batch.top_p)[:, 0]  # [B, N]
        uniforms = torch.stack([torch.rand((), generator=g) for g in batch.generators])
        index = torch.where(batch.is_greedy, greedy, sample_from(q_draft, uniforms.to(q_draft.device)))
        index = redraw_seeded_rows(index, q_draft, batch.noises, batch.lengths + step, draft_ids)
        q = q_draft.new_zeros(len(q_draft), self.model.config.vocab_size)
        return draft_ids[index], q.index_add_(1, draft_ids, q_draft)  # [B, V]: a repeated id sums

    def commit(self, num_accepted: torch.Tensor) -> None:
        """Nothing to do: chain entries are never kept, and verified features arrive through `observe`."""
