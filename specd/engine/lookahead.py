"""Choose each step's lookahead k from measured acceptance and measured costs (a speed floor).

Contract: `choose()` returns the k in 0..max_k with the best expected tokens per second, (1 −
α^(k+1)) / (1 − α) tokens for k·t_draft + t_verify(k) seconds, where α is the live drafter's
measured per-draft acceptance and the times are measured on this machine. α is the chance that a
draft is accepted when every draft before it was: a row that accepted a of its drafts and then had
one rejected counts a + 1 trials, a row that accepted all of them a trials (drafts after a rejection
are never tried). Accepted over proposed would read a chain of k drafts as k trials and make every
k > 1 look worse than it is. k = 0 means "decode without the learned drafter this step", so a drafter
that does not help costs (almost) nothing: every `probe_every` steps a k = 1 probe keeps measuring
it. What k governs is the engine's (`EngineConfig.lookahead_scope`): by default the learned
drafter's drafts alone, a hybrid's context continuations being served at every k (0 included) and α
being the learned drafter's own acceptance, since on a step a continuation serves k changes nothing.
(When k covered every source, α fell below break-even while a chat-trained drafter missed on the
first code requests, and k = 0 then also dropped the free context matches: a trap that held k = 0 on
134 of 172 steps of the demo's first HumanEval round.) A hybrid's continuations get a reach of their
own (`continuation_reaches`): how many drafts a context match or table continuation proposes, by the
same rule with no drafting cost and each chain position's own measured acceptance, since where a
wider pass costs more than a narrow one (on an AVX2 core 4 positions cost 1.40 one-position passes,
9 positions 2.1: benchmarks/results/lookahead_policy.json) a long reach pays only for spans that
hold. A new drafter version restarts the acceptance estimate from an optimistic prior, so fresh
weights get a fair trial. ATLAS's confidence-aware controller is the inspiration; this one only uses
running averages. The costs live in a `LookaheadCosts` of their own: engines that are compared (the
demo's adaptive and static modes) can share one, frozen after a calibration, so that they choose a
different k only because their drafters are accepted differently. A calibration (`CalibrationSweep`:
k = 0, 1, ..., max_k in turn, a step each, so that the machine's noise falls on every k alike) keeps
every sample (`keep_samples`) and freezes each k's median, made non-decreasing in k (`frozen_copy`,
`monotone_fit`): a running average of a few steps follows its first samples, and sweeping one k at a
time once let a burst of load make k = 2 look 40% dearer than k = 1. It sweeps every width a pass
can have, continuations' included, so that no reach is priced by extrapolation.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LookaheadConfig:
    max_k: int = 4
    adaptive: bool = True
    prior_acceptance: float = 0.6
    smoothing: float = 0.1          # weight of the newest step in the running averages
    probe_every: int = 8
    # a continuation's chance to be right at each position of its chain before any is measured:
    # optimistic, so that long reaches are tried and measured first
    prior_continuation: float = 0.8


@dataclass
class LookaheadCosts:
    """Measured step costs, running averages; a frozen one is read, never updated."""

    draft_seconds: float | None = None                                    # per drafted position, whole batch
    verify_seconds: dict[int, float] = field(default_factory=dict)       # per target pass, by k
    frozen: bool = False
    keep_samples: bool = False
    # kept samples by k: (draft seconds per position, None at k = 0 or where no learned draft was made;
    # verify seconds)
    samples: dict[int, list[tuple[float | None, float]]] = field(default_factory=dict)
    measured_verify_seconds: dict[int, float] = field(default_factory=dict)  # a frozen copy's medians by k

    def observe(self, k: int, draft_seconds: float | None, verify_seconds: float, weight: float) -> None:
        """A step at `k`: its drafting and verification seconds; drafting None where the learned
        drafter did not run (continuations served every row), so that step's drafting time says
        nothing of what a learned draft costs and only its verification is a sample."""
        if self.frozen:
            return
        per_position = draft_seconds / k if k and draft_seconds is not None else None
        if self.keep_samples:
            self.samples.setdefault(k, []).append((per_position, verify_seconds))
        if per_position is not None:
            self.draft_seconds = per_position if self.draft_seconds is None else (
                (1 - weight) * self.draft_seconds + weight * per_position)
        previous = self.verify_seconds.get(k)
        self.verify_seconds[k] = verify_seconds if previous is None else (
            (1 - weight) * previous + weight * verify_seconds)

    def frozen_copy(self, fit: str = "monotone") -> LookaheadCosts:
        """These costs, never updated again; where samples were kept, verification is each k's
        median made non-decreasing in k (`monotone_fit`; fit "line": the line `verify_line` draws
        through them), the medians kept beside it, and drafting the median over every drafted position."""
        if not self.samples:
            return LookaheadCosts(self.draft_seconds, dict(self.verify_seconds), frozen=True)
        drafts = [draft for pairs in self.samples.values() for draft, _ in pairs if draft is not None]
        medians = {k: statistics.median(seconds for _, seconds in pairs) for k, pairs in sorted(self.samples.items())}
        fitted = verify_line(medians) if fit == "line" else monotone_fit(medians)
        return LookaheadCosts(statistics.median(drafts) if drafts else self.draft_seconds, fitted,
                              frozen=True, measured_verify_seconds=medians)


def monotone_fit(medians: dict[int, float]) -> dict[int, float]:
    """A target pass's seconds against k: the closest non-decreasing sequence to the per-k medians
    (pool adjacent violators: a k measured cheaper than the one before it shares their mean), so a
    longer pass is never cheaper and the steps a CPU's kernel really has stay. On the AVX2 EPYC
    verification costs the same for 1-3 positions a row (one register block) and 30% more for 4-5
    (two blocks): a line through those medians priced 3 positions 9% above 2, and the controller
    chose k = 1 at a third of the demo's steps where k = 2 cost no more. The calibration interleaves
    the k's step by step, so a burst of load reaches them alike; a median of 20 samples does the rest."""
    pools: list[list[float]] = []   # [sum, count] of each pool, in k order
    for k in sorted(medians):
        pools.append([medians[k], 1.0])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    values = [total / count for total, count in pools for _ in range(int(count))]
    return dict(zip(sorted(medians), values, strict=True))


def verify_line(medians: dict[int, float]) -> dict[int, float]:
    """A target pass's seconds against k, as the Theil–Sen line through `medians` (the median of
    the slopes between every two k, the median intercept; the fit before 2026-12-07, kept for
    benchmarks/lookahead_policy.py): one k's outlier moves a median of slopes little where it
    would move a least-squares line. Fewer than three k are kept as measured; the slope is never
    below 0 (a longer pass is never cheaper)."""
    if len(medians) < 3:
        return dict(medians)
    ks = sorted(medians)
    slopes = [(medians[b] - medians[a]) / (b - a) for i, a in enumerate(ks) for b in ks[i + 1:]]
    slope = max(0.0, statistics.median(slopes))
    intercept = statistics.median(medians[k] - slope * k for k in ks)
    return {k: intercept + slope * k for k in ks}


class LookaheadController:
    def __init__(self, config: LookaheadConfig, costs: LookaheadCosts | None = None) -> None:
        self.config = config
        self.acceptance = config.prior_acceptance
        self.version: int | None = None
        self.costs = costs if costs is not None else LookaheadCosts()
        self.steps_without_drafting = 0
        # per continuation kind, the chance that the draft at each chain position is accepted when
        # every one before it was: a copied span tends to hold once it has started to (unlike the
        # learned drafter's, its acceptance is no single α), so each position is measured apart
        self.chains: dict[str, list[float]] = {}
        self.reach_steps = 0

    @property
    def draft_seconds(self) -> float | None:
        return self.costs.draft_seconds

    @property
    def verify_seconds(self) -> dict[int, float]:
        return self.costs.verify_seconds

    def choose(self, version: int) -> int:
        if version != self.version:
            self.version, self.acceptance = version, self.config.prior_acceptance
        if not self.config.adaptive or self.draft_seconds is None or not self.verify_seconds:
            return self.config.max_k
        best = max(range(self.config.max_k + 1), key=self.expected_rate)
        if best == 0:
            self.steps_without_drafting += 1
            if self.steps_without_drafting % self.config.probe_every == 0:
                return 1
        else:
            self.steps_without_drafting = 0
        return best

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second at lookahead k (per row)."""
        alpha = min(self.acceptance, 0.999)
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / (k * (self.draft_seconds or 0.0) + self._verify_time(k))

    def continuation_reaches(self, kinds: tuple[str, ...], most: int) -> dict[str, int]:
        """Per continuation kind, how many drafts (1..most) a continuation proposes: the most
        expected tokens per second of verification, from its chain's measured acceptance (a pass of
        continuations runs no drafter). Every `probe_every`-th step each kind reaches `most`, so that
        positions past the chosen reach keep being measured."""
        self.reach_steps += 1
        if self.reach_steps % self.config.probe_every == 0 or not self.verify_seconds:
            return dict.fromkeys(kinds, most)
        return {kind: max(range(1, most + 1), key=lambda d: self._chain_tokens(kind, d) / self._verify_time(d))
                for kind in kinds}

    def observe_continuation(self, kind: str, drafts: int, accepted: int) -> None:
        """A continuation row's outcome: positions 1..accepted were right, and the one after them,
        if it was proposed, was wrong; positions after that were never tried."""
        chain = self._chain(kind, drafts)
        w = self.config.smoothing
        for position in range(min(drafts, accepted + 1)):
            chain[position] = (1 - w) * chain[position] + w * (position < accepted)

    def _chain(self, kind: str, length: int) -> list[float]:
        chain = self.chains.setdefault(kind, [])
        chain.extend([self.config.prior_continuation] * (length - len(chain)))
        return chain

    def _chain_tokens(self, kind: str, drafts: int) -> float:
        """Expected tokens of a pass whose continuation proposes `drafts` (its bonus token included)."""
        tokens = survive = 1.0
        for accept in self._chain(kind, drafts)[:drafts]:
            survive *= accept
            tokens += survive
        return tokens

    def _verify_time(self, k: int) -> float:
        if k in self.verify_seconds:
            return self.verify_seconds[k]
        measured = sorted(self.verify_seconds)
        if k > measured[-1] and len(measured) > 1:  # past the widest measured pass: the measured slope
            low, high = measured[0], measured[-1]
            slope = max(0.0, (self.verify_seconds[high] - self.verify_seconds[low]) / (high - low))
            return self.verify_seconds[high] + slope * (k - high)
        # an unmeasured width: scale the nearest measured one, each extra position costing 5% of a pass
        nearest = min(self.verify_seconds, key=lambda measured: abs(measured - k))
        return self.verify_seconds[nearest] * (1 + 0.05 * k) / (1 + 0.05 * nearest)

    def observe(self, k: int, accepted: int, rejected: int, draft_seconds: float | None,
                verify_seconds: float | None) -> None:
        """A step drafted at `k`: its accepted drafts, its rows that had a draft rejected, its times
        (drafting None where no learned draft was made: `LookaheadCosts.observe`; verification None
        where the pass is no sample of what k costs, a continuation having widened it)."""
        w = self.config.smoothing
        if accepted + rejected > 0:
            self.acceptance = (1 - w) * self.acceptance + w * accepted / (accepted + rejected)
        if verify_seconds is not None:
            self.costs.observe(k, draft_seconds, verify_seconds, w)


class CalibrationSweep(LookaheadController):
    """Drafts k = 0, 1, ..., max_k in turn, one step each, never adapting: every k's samples then
    span the same seconds of the run, so a burst of load reaches them alike."""

    def __init__(self, max_k: int, costs: LookaheadCosts) -> None:
        super().__init__(LookaheadConfig(max_k=max_k, adaptive=False), costs)
        self._steps = 0

    def choose(self, version: int) -> int:
        k = self._steps % (self.config.max_k + 1)
        self._steps += 1
        return k
