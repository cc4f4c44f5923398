"""Shared prompt prefixes prefilled once: a chat template's system prompt, kept and copied.

Contract: `PrefixCache(prefixes)` holds token sequences that many prompts start with (the demo and
`specd serve` register their chat template's opening, `LoadedTarget.shared_prefixes`). A prompt that
starts with one (the longest that leaves at least one prompt token to prefill after it) has that
prefix written into its slot as a chunk of its own, positions 0..n-1, before the rest of the prompt
goes in chunks from n. The first such prompt runs that chunk as any other
(`specd.engine.prefill.run_chunk`), and `keep` keeps the slot's keys, values and the captured
features; every later one has them copied in (`copy_into`) instead of running the target. Whether
copied or computed, the chunk is the same pass over the same tokens at the same positions, so the
cache holds the same bits either way, and every engine of a deployment
(speculative or not) splits its prompts at the same place: greedy output stays the target's alone.
Features are kept per set of captured layers: after a swap to a drafter that reads other layers,
the next prompt computes the prefix again (same keys and values) and keeps those features too. The
target's weights never change under an engine, so nothing kept goes stale.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specd.model.transformer import KVCache

if TYPE_CHECKING:  # the prefill module imports this one
    from specd.engine.prefill import InProgress


@dataclass
class KeptPrefix:
    keys: torch.Tensor     # [layers, kv heads, n, head dim]
    values: torch.Tensor
    features: dict[tuple[int, ...], torch.Tensor | None] = field(default_factory=dict)  # capture -> [n, F]


class PrefixCache:
    def __init__(self, prefixes: Iterable[Sequence[int]] = ()) -> None:
        # longest first: a prompt takes the longest registered prefix it starts with
        self.prefixes = sorted({tuple(int(t) for t in p) for p in prefixes if len(p) > 0}, key=len, reverse=True)
        self.kept: dict[tuple[int, ...], KeptPrefix] = {}
        self.copied = self.computed = 0   # prompts whose prefix was copied in / computed

    def prefix_of(self, prompt: Sequence[int], to_fill: int) -> tuple[int, ...] | None:
        """The longest registered prefix `prompt` starts with and that fits in its `to_fill` positions."""
        for prefix in self.prefixes:
            if len(prefix) <= to_fill and tuple(prompt[:len(prefix)]) == prefix:
                return prefix
        return None

    def copy_into(self, cache: KVCache, part: InProgress, prefix: tuple[int, ...], capture: tuple[int, ...]) -> bool:
        """Write the kept `prefix` (with its features for `capture`) into `part`'s slot, positions
        0..n-1, and mark them filled; False where it is not kept yet for `capture` (then the caller
        runs it as the prompt's first chunk and `keep`s it)."""
        kept = self.kept.get(prefix)
        if kept is None or capture not in kept.features:
            return False
        n = len(prefix)
        cache.k[:, part.slot, :, :n] = kept.keys
        cache.v[:, part.slot, :, :n] = kept.values
        features = kept.features[capture]
        if features is not None:
            part.features.append(features)
        part.captured.add(capture)
        part.filled = n
        self.copied += 1
        return True

    def keep(self, cache: KVCache, slot: int, prefix: tuple[int, ...], capture: tuple[int, ...],
             features: torch.Tensor | None) -> None:
        """`prefix` was just run into `slot` (positions 0..n-1), capturing `features` [n, F]: keep them."""
        kept = self.kept.get(prefix)
        if kept is None:
            n = len(prefix)
            kept = self.kept[prefix] = KeptPrefix(cache.k[:, slot, :, :n].clone(), cache.v[:, slot, :, :n].clone())
        kept.features[capture] = features.clone() if features is not None else None
        self.computed += 1
