"""Chunked prefill: a prompt enters the target's cache a budget of tokens per engine step.

Contract: at most one request is part-way through its prefill (`InProgress`). It owns the slot
just past the running rows (`len(running)`), so the running rows keep reading a plain prefix of
the caches; when a running row retires and the rows compact, the engine moves the part-filled
slot down with them (`follow`). Each step spends at most `budget` prompt tokens (None: a whole
prompt at once, as before chunking), in prompt order, and a request whose prefill completes
joins the running rows at that step; a registered shared prefix is a prompt's first chunk, whole
whatever the budget, or copied in without a pass (`specd.engine.prefix_cache`). The chunks run
the same target code as a whole prefill, at their own start positions against the cache already
written, so the cache holds the same entries. The features a feature drafter reads are gathered
chunk by chunk and handed over together when the request starts decoding, only when every chunk
captured the layers the drafter reads then (a swap to a drafter of other layers part-way leaves
the row without features: it drafts nothing, as rows in flight at such a swap do, and its request
is served all the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.engine.prefix_cache import PrefixCache
from specd.engine.request import Sequence
from specd.model.transformer import KVCache, Transformer


@dataclass
class InProgress:
    seq: Sequence
    slot: int
    filled: int = 0   # prompt tokens (of prompt[:-1]) already in the cache
    features: list[torch.Tensor] = field(default_factory=list)
    captured: set[tuple[int, ...]] = field(default_factory=set)  # the layers each chunk captured

    @property
    def to_fill(self) -> int:
        """Prompt tokens the cache needs: all but the last, which is the first step's input."""
        return max(len(self.seq.prompt_ids) - 1, 0)

    @property
    def is_complete(self) -> bool:
        return self.filled >= self.to_fill

    def gathered_features(self, capture: tuple[int, ...]) -> torch.Tensor | None:
        """Positions 0..filled-1's features, when every chunk captured `capture` (the layers read now)."""
        if not self.features or self.captured != {capture}:
            return None
        return torch.cat(self.features)


def run_chunk(target: Transformer, cache: KVCache, tokens: torch.Tensor, part: InProgress, budget: int | None,
              capture: tuple[int, ...], prefixes: PrefixCache | None = None) -> int:
    """Write up to `budget` more prompt tokens of `part` (already in its row of `tokens`, the
    engine's token buffer) into its slot's cache; returns how many the target ran. A registered
    prefix the prompt starts with is its first chunk whatever the budget: copied in where kept
    (`PrefixCache.copy_into`), else run as this chunk and kept (`PrefixCache.keep`)."""
    prefix = prefixes.prefix_of(part.seq.prompt_ids, part.to_fill) if prefixes is not None and not part.filled else None
    if prefixes is not None and prefix is not None and prefixes.copy_into(cache, part, prefix, capture):
        return 0
    end = part.to_fill if budget is None else min(part.to_fill, part.filled + budget)
    end = len(prefix) if prefix is not None else end
    if end <= part.filled:
        return 0
    chunk = tokens[part.slot, part.filled:end]
    start = torch.tensor([part.filled], dtype=torch.long, device=tokens.device)
    _, features = target(chunk[None, :], start, cache, first_slot=part.slot, logits_for="none",
                         return_hidden=bool(capture), capture_layers=capture)
    part.captured.add(capture)
    if features is not None:
        part.features.append(features[0])
    if prefixes is not None and prefix is not None:
        prefixes.keep(cache, part.slot, prefix, capture, features[0] if features is not None else None)
    used, part.filled = end - part.filled, end
    return used


def follow(part: InProgress, cache: KVCache, tokens: torch.Tensor, slot: int) -> None:
    """Move a part-filled prefill to `slot` (the running rows compacted below it)."""
    if part.slot == slot:
        return
    cache.move_slot(part.slot, slot, part.filled)
    tokens[slot, :len(part.seq.prompt_ids)] = tokens[part.slot, :len(part.seq.prompt_ids)]
    part.slot = slot
