"""The seam between the engine and any drafter.

Contract: the engine owns the token buffer and the batch; a drafter owns only its own state
(weights, KV cache, per-slot bookkeeping) and answers `propose` with k drafts per active row and,
when it sampled them, the distributions q they came from. Rows are the engine's slots 0..B-1 in
order. After verification the engine calls `commit` with how many drafts each row accepted; when
a request joins a slot it calls `start`, and when the batch is compacted, `move`. A drafter never
changes what the engine emits, only how many target passes it takes. A drafter that reads the
target's hidden states is also a `FeatureReader`: the engine captures its layers in the passes it
runs anyway and hands over every row's features as its positions are verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specd.core.errors import ConfigurationError
from specd.model.seeded_draws import PositionNoise

BUILT_IN_VERSION = 0  # a drafter not read from the weight store (the day-0 drafter, a replay, a capture)
# How a learned drafter drafts for a sampled row: its argmax, a one-hot draft (what the learner's
# gate replays), or a draw from its own distribution q. Both are lossless under speculative sampling.
SAMPLED_DRAFTS = ("argmax", "sample")


@dataclass
class DraftBatch:
    """What a drafter may read about the active rows (slots 0..B-1)."""

    tokens: torch.Tensor         # [max_batch, max_seq] each slot's prompt + output so far
    lengths: torch.Tensor        # [B] tokens in each row's sequence
    prompt_lengths: list[int]    # [B]
    request_ids: list[str]       # [B]
    temperature: torch.Tensor    # [B] 0 means greedy
    top_p: torch.Tensor          # [B]
    generators: list[torch.Generator]  # [B] the requests' own random streams
    # [B] a seeded sampled row's noise, whose Gumbel-max draws decide its tokens (None elsewhere;
    # empty: no row is seeded); a drafter drawing with it proposes the seeded draw (seeded_draws.py)
    noises: list[PositionNoise | None] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def is_greedy(self) -> torch.Tensor:
        return self.temperature == 0

    @property
    def is_seeded(self) -> torch.Tensor:
        """[B] rows whose sampled tokens are their seed's Gumbel-max draws (verified like greedy rows)."""
        seeded = [noise is not None for noise in self.noises] if self.noises else [False] * self.num_rows
        return torch.tensor(seeded, dtype=torch.bool, device=self.temperature.device)


@dataclass
class Proposal:
    """k drafts per row (a hybrid's long continuations may make it wider: `HybridDrafter.context_k`);
    q is None when every draft is deterministic (q one-hot at the draft)."""

    drafts: torch.Tensor            # [B, k] token ids
    q: torch.Tensor | None = None   # [B, k, V] the distributions the drafts were drawn from
    limits: torch.Tensor | None = None  # [B] drafts usable per row (fewer while a row is not ready)


class Drafter(Protocol):
    """Anything that proposes drafts: a small transformer, a replay, an n-gram table."""

    @property
    def version(self) -> int: ...

    def bind(self, max_batch: int, max_seq: int, device: torch.device) -> None:
        """Allocate per-slot state for an engine of this size."""

    def start(self, slot: int) -> None:
        """A new request occupies `slot`: forget whatever the slot held."""

    def move(self, src: int, dst: int) -> None:
        """The request in slot `src` now lives in slot `dst`."""

    def propose(self, batch: DraftBatch, k: int) -> Proposal: ...

    def commit(self, num_accepted: torch.Tensor) -> None:
        """num_accepted: [B] how many of the last proposal's drafts each row accepted."""


@runtime_checkable
class FeatureReader(Protocol):
    """A drafter fed the target's features (the residual streams after `capture_layers`, the last layer among them)."""

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Target layers to capture; () reads none (a hybrid over a token drafter)."""

    def observe(self, slot: int, start: int, features: torch.Tensor) -> None:
        """features [n, F]: the target's at positions start..start+n-1 of the row in `slot`."""


def check_sampled_drafts(policy: str) -> str:
    if policy not in SAMPLED_DRAFTS:
        raise ConfigurationError(f"sampled_drafts {policy!r}: choose one of {', '.join(SAMPLED_DRAFTS)}")
    return policy


def one_hot_q(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """q for deterministic drafts: [B, k] -> [B, k, V] with all mass on the draft."""
    q = torch.zeros(*drafts.shape, vocab_size, device=drafts.device)
    return q.scatter_(-1, drafts[..., None], 1.0)
