"""Seeded sampling that drafts cannot change: Gumbel-max draws keyed by (seed, position).

Contract: a seeded request's token at sequence index t is argmax over the vocabulary of
log p_t(x) + G_t(x), where p_t is the target's distribution there (temperature, top-p) and G_t is
Gumbel noise drawn from a generator seeded by mixing the request's seed with t. By the Gumbel-max
trick that is an exact draw from p_t, and it depends on the seed, t and p_t alone: whatever the
drafts, k, the batch or the drafter version, a seeded request's answer is the one the target alone
gives with that seed (speculation verifies such a row as a greedy one, against the noisy scores).
A drafter that draws its draft for index t with the same noise (argmax of log q_t + G_t) proposes
the target's token whenever q_t is close to p_t, which is how the feature drafter serves seeded rows.

The noise is computed once per position and kept for the few positions a step reads
(`PositionNoise.at`): about 0.2 ms for a 49k vocabulary on one CPU core, and with the 32 positions
kept (a step reads at most k + 1 of them, a wide context continuation's included) 6 MB per
running seeded request.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

_MASK = (1 << 64) - 1
_TINY = 1e-30  # keeps log(-log(u)) finite at u = 0


def _mix(value: int) -> int:
    """splitmix64's finaliser: nearby (seed, position) pairs give unrelated generator seeds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


class PositionNoise:
    """One seeded request's Gumbel noise [vocab_size] per sequence index, the recent ones kept."""

    def __init__(self, seed: int, vocab_size: int, keep: int = 32) -> None:
        self.seed, self.vocab_size, self.keep = seed & _MASK, vocab_size, keep
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._generator = torch.Generator()

    def at(self, position: int) -> torch.Tensor:
        """The noise for the token at sequence index `position` (float32, on the CPU)."""
        noise = self._kept.get(position)
        if noise is None:
            self._generator.manual_seed(_mix(self.seed ^ _mix(position)) >> 1)  # torch takes < 2**63 here
            uniforms = torch.rand(self.vocab_size, generator=self._generator)
            noise = -torch.log(-torch.log(uniforms.clamp_(min=_TINY)))
            self._kept[position] = noise
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
        return noise

    def span(self, start: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Noise for indices start..start+count-1: [count, vocab_size]."""
        return torch.stack([self.at(start + i) for i in range(count)]).to(device)


def noisy_scores(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log probs + noise, -inf where probs is 0 (outside top-p): its argmax is the seeded draw."""
    return torch.log(probs.float()) + noise.to(probs.device)


def redraw_seeded_rows(index: torch.Tensor, probs: torch.Tensor, noises: list[PositionNoise | None],
                      positions: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """`index` [B] (draws from `probs` [B, N]) with each seeded row's entry replaced by its seed's
    draw for the token at `positions[row]`; `ids` [N]: the vocabulary id of each column of `probs`
    (a pruned draft vocabulary), None when the columns are the vocabulary itself."""
    for row, noise in enumerate(noises):
        if noise is not None:
            at = noise.at(int(positions[row])).to(probs.device)
            index[row] = noisy_scores(probs[row], at if ids is None else at[ids]).argmax()
    return index


def seeded_scores(logits: torch.Tensor, probs: torch.Tensor, noises: list[PositionNoise | None],
                  lengths: torch.Tensor) -> torch.Tensor:
    """A verification pass's logits [B, T, V] with each seeded row's replaced by its noisy scores
    (column j scores the token at index lengths[row] + j); rows without noise keep their logits."""
    if not any(noise is not None for noise in noises):
        return logits
    scores = logits.float().clone()
    for row, noise in enumerate(noises):
        if noise is not None:
            start = int(lengths[row])
            scores[row] = noisy_scores(probs[row], noise.span(start, logits.shape[1], logits.device))
    return scores
