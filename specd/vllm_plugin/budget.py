"""Which drafts are worth verifying: measured acceptance per draft source against the measured price of a token.

Contract: `DraftBudget` learns online, from the steps it is shown,
- the conditional acceptance alpha[source][j] of the j-th draft from each source (context match,
  traffic table, learned drafter) given that the drafts before it were accepted, and
- the marginal seconds one more verified token adds to a step (a running least-squares fit of
  step time against tokens verified) and the current output rate in tokens/s.
`keep(source, n)` then says how many leading drafts to send: a draft whose chance of being
accepted (the product of alphas up to it) is below marginal_seconds * tokens_per_second costs
more verification time than it returns. On a CPU at batch 8 verification is compute-bound and
the bar is high; at batch 1 it is nearly free and the bar is low. Every `explore_every`-th
step sends everything, so no source's estimate can freeze below the bar.
"""

from __future__ import annotations

SOURCES = ("context", "table", "learned")


class RunningFit:
    """Exponentially weighted least squares of y on x: slope and the weighted mean of y."""

    def __init__(self, decay: float = 0.02) -> None:
        self.decay = decay
        self.weight = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1 - self.decay
        self.weight = keep * self.weight + 1
        self.x = keep * self.x + x
        self.y = keep * self.y + y
        self.xx = keep * self.xx + x * x
        self.xy = keep * self.xy + x * y

    @property
    def slope(self) -> float | None:
        if self.weight < 10:
            return None
        mean_x, mean_y = self.x / self.weight, self.y / self.weight
        variance = self.xx / self.weight - mean_x * mean_x
        if variance < 1e-6:
            return None
        return max(0.0, (self.xy / self.weight - mean_x * mean_y) / variance)


class DraftBudget:
    def __init__(self, k: int, prior: float = 0.5, decay: float = 0.02, explore_every: int = 16,
                 max_bar: float = 0.95) -> None:
        self.k, self.decay, self.explore_every, self.max_bar = k, decay, explore_every, max_bar
        # per source and position: decayed counts of drafts that reached verification and were accepted
        self.reached = {source: [2.0] * k for source in SOURCES}
        self.accepted = {source: [2.0 * prior] * k for source in SOURCES}
        self.step_time = RunningFit(decay)
        self.tokens_per_second: float | None = None
        self.steps = 0

    def alpha(self, source: str) -> list[float]:
        return [a / r for a, r in zip(self.accepted[source], self.reached[source], strict=True)]

    def observe_step(self, seconds: float, verified_tokens: int, emitted_tokens: int) -> None:
        """One engine step: its wall time, tokens it verified (rows + drafts) and tokens it emitted."""
        if seconds <= 0 or verified_tokens <= 0:
            return
        self.steps += 1
        self.step_time.add(verified_tokens, seconds)
        rate = emitted_tokens / seconds
        self.tokens_per_second = rate if self.tokens_per_second is None else \
            (1 - self.decay) * self.tokens_per_second + self.decay * rate

    def observe_drafts(self, source: str, drafted: int, accepted: int) -> None:
        """A row's verified drafts: the first `accepted` were accepted, the next one (if any) rejected."""
        if source not in self.reached:
            return
        reached, hits = self.reached[source], self.accepted[source]
        for position in range(min(drafted, accepted + 1, self.k)):
            reached[position] = (1 - self.decay) * reached[position] + 1
            hits[position] = (1 - self.decay) * hits[position] + (position < accepted)

    @property
    def bar(self) -> float:
        """The acceptance chance a draft needs to pay for its verification (0 until measured)."""
        slope = self.step_time.slope
        if slope is None or self.tokens_per_second is None:
            return 0.0
        return min(self.max_bar, slope * self.tokens_per_second)

    @property
    def exploring(self) -> bool:
        return self.explore_every > 0 and self.steps % self.explore_every == 0

    def keep(self, source: str, drafted: int) -> int:
        """How many of a row's `drafted` leading drafts from `source` are worth verifying."""
        if drafted <= 0 or source not in self.reached or self.exploring:
            return max(drafted, 0)
        bar, chance, kept = self.bar, 1.0, 0
        for alpha in self.alpha(source)[:drafted]:
            chance *= alpha
            if chance < bar:
                break
            kept += 1
        return kept
