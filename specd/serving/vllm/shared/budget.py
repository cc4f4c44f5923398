"""Which drafts are worth verifying: measured acceptance per draft source against the measured price of a token.

Contract: `DraftBudget` learns online, from the steps it is shown,
- the conditional acceptance alpha[source][j] of the j-th draft from each source given that the
  drafts before it were accepted (sources are named by the proposer: context matches and table
  continuations by their match length, e.g. "context4", "table2", and "learned"), and
- the marginal seconds one more verified token adds to a step (a running least-squares fit of
  step time against tokens verified) and the output rate in tokens/s, both per batch size.
`keep(source, n)` then says how many leading drafts to send: a draft whose chance of being
accepted (the product of alphas up to it) is below marginal_seconds * tokens_per_second costs
more verification time than it returns. On a CPU at batch 8 verification is compute-bound and
the bar is high; at batch 1 it is nearly free and the bar is low. Drafts held back are not lost
for learning: `ShadowBook` scores them against the tokens the target then produced, so an
estimate below the bar keeps being measured at no verification cost (and every
`explore_every`-th step per row of the batch sends everything anyway, to keep the step-time fit
honest: at batch 8 such a step verifies every row's k drafts, about twice a normal step's work, so
it comes 8 times less often than at batch 1).
A drafter that runs one pass per draft (vLLM's EAGLE-3) also pays its own time: `observe_drafting`
fits the seconds one more drafting pass adds, and `keep(..., drafting=True)` raises the bar of
every draft after the first (the first comes from the pass that feeds the drafter's cache, which
runs anyway) by that time in tokens, shared by the rows the pass drafts for.
The step time that prices verification is the step's wall time less the drafter's own passes
in it (`observe_step`'s `drafting_seconds`): otherwise steps where context drafts let EAGLE-3 stand
down (fewer passes, as many verified tokens) make a verified token look free. A batch size whose
price is not measured yet (a fit needs steps of different counts) borrows the nearest measured
batch size's bar instead of sending everything.
A drafter that also says how sure it is of each draft (vLLM's EAGLE-3: the top probability of each
pass, `specd.serving.vllm.eagle3.confidence`) is trimmed per row and step instead of by position:
`ConfidenceCalibration` measures the acceptance of its drafts per band of that probability (given
the drafts before were accepted), and `keep_confident` multiplies those chances along the row's
own drafts, so a sure draft at position 4 is sent and an unsure one at position 1 is not;
`worth_another_pass` tells such a drafter, between its passes, whether any row's next draft is
still worth drafting. A context or table continuation's first draft is weighed at the rate its
source family has had in the request (`FirstDraftRates`), not only at the pooled rate.
`LearnedDrafterSwitch` decides whether the learned drafter runs at all: only while the tokens it is
expected to add are worth more than its own time, probing otherwise at a rate that keeps probes
near 1% of the time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple


class RunningFit:
    """Exponentially weighted least squares of y on x (recent points count most): its slope."""

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


class ConfidenceCalibration:
    """P(a draft is accepted | the drafts before it were, the drafter's top probability p for it):
    decayed counts per band of p, each band starting from its own midpoint (a calibrated drafter),
    worth two observations."""

    def __init__(self, bands: int = 10, decay: float = 0.01) -> None:
        self.bands, self.decay = bands, decay
        self.reached = [2.0] * bands
        self.accepted = [2.0 * (band + 0.5) / bands for band in range(bands)]

    def band(self, probability: float) -> int:
        return min(max(int(probability * self.bands), 0), self.bands - 1)

    def chance(self, probability: float) -> float:
        band = self.band(probability)
        return self.accepted[band] / self.reached[band]

    def observe(self, confidences: Sequence[float], drafted: int, accepted: int) -> None:
        """A row's drafts with these confidences: the first `accepted` of `drafted` were accepted."""
        for position in range(min(drafted, accepted + 1, len(confidences))):
            band = self.band(confidences[position])
            self.reached[band] = (1 - self.decay) * self.reached[band] + 1
            self.accepted[band] = (1 - self.decay) * self.accepted[band] + (position < accepted)

    def status(self) -> list[float]:
        return [round(a / r, 3) for a, r in zip(self.accepted, self.reached, strict=True)]


class FirstDraftRates:
    """Per request and source family ("context", "table", ...: the source without its match length),
    how often the family's first draft was accepted in this request, shrunk toward the pooled rate
    by `prior_weight` observations. Pooled acceptance mixes requests that copy much (code) with
    requests that seldom do (chat); a row's own record says which kind it is."""

    def __init__(self, prior_weight: float = 2.0) -> None:
        self.prior_weight = prior_weight
        self._counts: dict[str, dict[str, list[int]]] = {}   # request id -> family -> [reached, accepted]

    @staticmethod
    def family(source: str) -> str:
        return source.rstrip("0123456789")

    def observe(self, request_id: str, source: str, drafted: int, accepted: int) -> None:
        if drafted > 0:
            counts = self._counts.setdefault(request_id, {}).setdefault(self.family(source), [0, 0])
            counts[0] += 1
            counts[1] += accepted > 0

    def rate(self, request_id: str, source: str, pooled: float) -> float:
        counts = self._counts.get(request_id, {}).get(self.family(source))
        if counts is None:
            return pooled
        return (counts[1] + self.prior_weight * pooled) / (counts[0] + self.prior_weight)

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)


class DraftBudget:
    def __init__(self, k: int, prior: float = 0.5, decay: float = 0.02, explore_every: int = 16,
                 max_bar: float = 0.95) -> None:
        self.k, self.decay, self.explore_every, self.max_bar = k, decay, explore_every, max_bar
        # per source and position: decayed counts of drafts that reached verification and were accepted
        self.prior = prior
        self.reached: dict[str, list[float]] = {}
        self.accepted: dict[str, list[float]] = {}
        # the price of a token depends on how many rows share the step: one fit per batch size
        self._fits: dict[int, RunningFit] = {}
        self._rates: dict[int, float] = {}
        self._drafting: dict[int, RunningFit] = {}  # a drafting pass's seconds, per batch size
        self.rows = 1                     # the batch size now (set by the caller each step)
        self.steps = 0
        self.last_drafting_seconds = 0.0  # the drafter's passes at the last step (inside the next step's time)
        self.calibration = ConfidenceCalibration()  # drafts that come with their drafter's confidence
        self.first_drafts = FirstDraftRates()        # each request's own record, for choosing its source

    def _counts(self, source: str) -> tuple[list[float], list[float]]:
        if source not in self.reached:  # a new source starts from the prior, worth two observations
            self.reached[source] = [2.0] * self.k
            self.accepted[source] = [2.0 * self.prior] * self.k
        return self.reached[source], self.accepted[source]

    def alpha(self, source: str) -> list[float]:
        reached, accepted = self._counts(source)
        return [a / r for a, r in zip(accepted, reached, strict=True)]

    @property
    def step_time(self) -> RunningFit:
        return self._fits.setdefault(self.rows, RunningFit(self.decay))

    @property
    def tokens_per_second(self) -> float | None:
        return self._rates.get(self.rows)

    def observe_step(self, seconds: float, verified_tokens: int, emitted_tokens: int, rows: int = 1,
                     drafting_seconds: float = 0.0) -> None:
        """One engine step of `rows` rows: its wall time, of which `drafting_seconds` were the
        drafter's own passes, and the tokens it verified (rows + drafts) and emitted."""
        if seconds <= 0 or verified_tokens <= 0:
            return
        self.steps += 1
        self.rows = rows
        self.step_time.add(verified_tokens, max(seconds - drafting_seconds, 0.0))
        rate, previous = emitted_tokens / seconds, self._rates.get(rows)
        self._rates[rows] = rate if previous is None else (1 - self.decay) * previous + self.decay * rate

    def observe_drafting(self, passes: int, seconds: float) -> None:
        """One step's drafting at the current batch size: `passes` drafting passes after the feeding
        one (k drafts cost it and k - 1 more; none or one draft, it alone) took `seconds` in all. The
        fit needs steps of different counts: a drafter that always drafts k stays unpriced."""
        if passes >= 0 and seconds > 0:
            self._drafting.setdefault(self.rows, RunningFit(self.decay)).add(passes, seconds)
            self.last_drafting_seconds = seconds

    @property
    def drafting_bar(self) -> float:
        """What one more drafting pass costs, in tokens per row it drafts for (0 until measured)."""
        return self._drafting_bar_at(self.rows)

    def _drafting_bar_at(self, rows: int) -> float:
        return _nearest_measured(rows, self._drafting, self._drafting_price)

    def _drafting_price(self, rows: int) -> float | None:
        fit, rate = self._drafting.get(rows), self._rates.get(rows)
        slope = fit.slope if fit is not None else None
        if slope is None or rate is None:
            return None
        return slope * rate / max(rows, 1)

    def observe_drafts(self, source: str, drafted: int, accepted: int, confidences: Sequence[float] = (),
                       request_id: str | None = None) -> None:
        """A row's verified drafts: the first `accepted` were accepted, the next one (if any) rejected;
        with the drafter's `confidences` in them, those are calibrated too, and with its
        `request_id`, the request's own record of the source is kept."""
        if request_id is not None:
            self.first_drafts.observe(request_id, source, drafted, accepted)
        if confidences:
            self.calibration.observe(confidences, drafted, accepted)
        reached, hits = self._counts(source)
        for position in range(min(drafted, accepted + 1, self.k)):
            reached[position] = (1 - self.decay) * reached[position] + 1
            hits[position] = (1 - self.decay) * hits[position] + (position < accepted)

    @property
    def bar(self) -> float:
        """The acceptance chance a draft needs to pay for its verification (0 until measured)."""
        return self._bar_at(self.rows)

    def _bar_at(self, rows: int) -> float:
        return _nearest_measured(rows, self._fits, self._verification_price)

    def _verification_price(self, rows: int) -> float | None:
        fit, rate = self._fits.get(rows), self._rates.get(rows)
        slope = fit.slope if fit is not None else None
        if slope is None or rate is None:
            return None
        return min(self.max_bar, slope * rate)

    def bars_by_batch(self) -> dict[int, dict[str, float]]:
        """Per batch size seen: the verification bar and the drafting bar it uses, measured there or
        borrowed from the nearest measured size (for status; the status's `draft_bar` and
        `drafting_bar` are those of the last step's batch size only)."""
        return {rows: {"draft_bar": round(self._bar_at(rows), 4), "drafting_bar": round(self._drafting_bar_at(rows), 4)}
                for rows in sorted(self._fits)}

    @property
    def exploring(self) -> bool:
        return self.explore_every > 0 and self.steps % (self.explore_every * max(self.rows, 1)) == 0

    def expected_accepted(self, source: str, sent: int, request_id: str | None = None) -> float:
        """Expected accepted tokens among `sent` leading drafts from `source` (for `request_id`, its
        first draft at the request's own rate: the rest follow the pooled chances)."""
        alphas = self.alpha(source)[:sent]
        if request_id is not None and alphas:
            alphas[0] = self.first_drafts.rate(request_id, source, alphas[0])
        chance, total = 1.0, 0.0
        for alpha in alphas:
            chance *= alpha
            total += chance
        return total

    def keep(self, source: str, drafted: int, drafting: bool = False) -> int:
        """How many of a row's `drafted` leading drafts from `source` are worth verifying; with
        `drafting`, worth drafting too (each after the first costs a pass of `drafting_bar`)."""
        if drafted <= 0 or self.exploring:
            return max(drafted, 0)
        bar, chance, kept = self.bar, 1.0, 0
        own = self.drafting_bar if drafting else 0.0
        for position, alpha in enumerate(self.alpha(source)[:drafted]):
            chance *= alpha
            if chance < bar + (own if position else 0.0):
                break
            kept += 1
        return kept

    def confident_chances(self, confidences: Sequence[float]) -> list[float]:
        """The chance that each of a row's drafts is accepted, from its drafter's confidences."""
        chances, chance = [], 1.0
        for probability in confidences:
            chance *= self.calibration.chance(probability)
            chances.append(chance)
        return chances

    def keep_confident(self, confidences: Sequence[float], drafted: int) -> int:
        """`keep` for drafts that come with their drafter's confidence: each draft's chance is its
        own band's measured acceptance times the chances before it."""
        if drafted <= 0 or self.exploring:
            return max(drafted, 0)
        bar = self.bar
        return sum(1 for _ in itertools.takewhile(lambda chance: chance >= bar,
                                                  self.confident_chances(confidences[:drafted])))

    def worth_another_pass(self, confidences: Sequence[Sequence[float]], min_chance: float = 0.0) -> bool:
        """Whether some row's next draft, from a drafter that states its confidence in each (rows of
        those so far), is worth its drafting pass and its verification: the row's chance so far
        times the calibrated chance of its last draft (a drafter sure of one draft tends to be sure
        of the next), against both bars (and at least `min_chance`)."""
        bar = max(self.bar + self.drafting_bar, min_chance)
        for row in confidences:
            if 0 < len(row) < self.k and \
                    self.confident_chances(row)[-1] * self.calibration.chance(row[-1]) >= bar:
                return True
        return False


def _nearest_measured(rows: int, sizes: Iterable[int], price: Callable[[int], float | None]) -> float:
    """`price(rows)`, or where it is unmeasured that of the nearest batch size among `sizes` that
    is measured (the larger on a tie: a bar never drops for lack of a measurement); 0 when none is."""
    for size in sorted({rows, *sizes}, key=lambda size: (abs(size - rows), -size)):
        value = price(size)
        if value is not None:
            return value
    return 0.0


class Settled(NamedTuple):
    """Held-back drafts whose fate the target's tokens have settled (`DraftBudget.observe_drafts`'s arguments)."""

    source: str
    drafted: int
    accepted: int
    confidences: Sequence[float] = ()


class ShadowBook:
    """Drafts held back, scored later against what the target produced at their positions."""

    def __init__(self) -> None:
        # request id -> (source, position, drafts, the drafter's confidence in each)
        self._pending: dict[str, tuple[str, int, list[int], Sequence[float]]] = {}

    def add(self, request_id: str, source: str, position: int, drafts: list[int],
            confidences: Sequence[float] = ()) -> None:
        if drafts and request_id not in self._pending:
            self._pending[request_id] = (source, position, list(drafts), confidences)

    def score(self, request_id: str, tokens: list[int]) -> Settled | None:
        """(source, drafted, accepted, confidences) once the sequence settles the drafts' fate, else None."""
        pending = self._pending.get(request_id)
        if pending is None:
            return None
        source, position, drafts, confidences = pending
        accepted = 0
        while accepted < len(drafts) and position + accepted < len(tokens):
            if tokens[position + accepted] != drafts[accepted]:
                break
            accepted += 1
        # settled: all drafts matched, or the target produced a different token at the next position
        if accepted < len(drafts) and position + accepted >= len(tokens):
            return None  # every draft so far was right, and the target has not gone further yet
        del self._pending[request_id]
        return Settled(source, len(drafts), accepted, confidences)

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)


class LearnedDrafterSwitch:
    """Run the learned drafter only while the tokens it adds are worth more than its time.

    gain = tokens the learned drafter's sent drafts are expected to add per step / tokens emitted
    per step, cost = its seconds per step / seconds per step; both smoothed over the steps it
    ran. While gain < cost it stays off, probing every `cost / probe_share` steps (at least
    `min_period`), so that a better version or easier traffic switches it back on.
    """

    def __init__(self, smoothing: float = 0.2, probe_share: float = 0.01, min_period: int = 16,
                 max_period: int = 512) -> None:
        self.smoothing, self.probe_share = smoothing, probe_share
        self.min_period, self.max_period = min_period, max_period
        self.gain: float | None = None
        self.cost: float | None = None
        self._off_for = 0

    def observe(self, expected_tokens: float, tokens_emitted: int, learned_seconds: float,
                step_seconds: float) -> None:
        if tokens_emitted <= 0 or step_seconds <= 0:
            return
        gain, cost = expected_tokens / tokens_emitted, learned_seconds / step_seconds
        a = self.smoothing
        self.gain = gain if self.gain is None else (1 - a) * self.gain + a * gain
        self.cost = cost if self.cost is None else (1 - a) * self.cost + a * cost

    @property
    def probe_period(self) -> int:
        if self.cost is None:
            return self.min_period
        return round(min(self.max_period, max(self.min_period, self.cost / self.probe_share)))

    def decide(self) -> bool:
        if self.gain is None or self.cost is None or self.gain >= self.cost:
            self._off_for = 0
            return True
        self._off_for += 1
        if self._off_for >= self.probe_period:
            self._off_for = 0
            return True
        return False
