"""The evaluation gate: the held-out records and the verdict on a candidate drafter.

Contract: every `every`-th record the learner takes is held out (kept from training; the newest
`capacity` are kept), whatever its temperature. A candidate passes when its weights are finite and
its simulated accept length on the held-out records is not worse than the bar by more than
`margin` (less where the bar drafts under `FULL_MARGIN_FROM` beyond 1: `margin_below`): the bar
is the better of the live version and, where given, the `bar` version (the last one that went
live without needing the margin, `Promoter.bar_version`), both replayed on the same records. So
regressions cannot chain: versions each within the margin of the one before would otherwise walk
the drafter down a margin at a time.
With fewer than `min_held_out` held-out records there is no evidence and no pass:
`has_evidence` is False (the learner then waits and trains on) and `verdict` fails. The learner's
thread holds records out while an operator's candidate may be judged on another thread: the
held-out set is copied under a lock, so a verdict judges one consistent set. The live side of a
verdict is replayed once per live model and held-out set, and reused while neither changes (the
live model the learner holds for the gate is one object per version, never trained).

What the gate measures is the drafter as it serves (`Objective.simulate`), on greedy and sampled
records alike. Speculation is lossless, so a record's tokens are draws from p (the target's
distribution after the request's temperature and top-p) whichever drafter served them.
- Greedy records: the replay is the engine's own walk, exact.
- The feature drafter serves a draw from its own q on sampled rows, which speculative sampling
  accepts with probability Σ_x min(p(x), q(x)). The replay computes that per position, with no
  sampling noise: p from the record's last-layer features through the target's output head, q
  from the candidate (`specd.learner.simulation`). `benchmarks/sampled_drafts.py` measures the
  estimate against served accept lengths.
- The token drafter serves its argmax x on sampled rows (`DrafterSpec.sampled_drafts`): a one-hot
  draft, accepted with probability p(x). A recorded sampled token equals x with probability p(x)
  too, so the argmax replayed against the recorded draw is an unbiased estimate (one draw, not
  the expectation: noisier than on greedy records, but evidence).
Candidate and live are replayed on the same records, so both sides see the same traffic.

With `confidence_z` > 0 the verdict asks for evidence, not a point estimate: each held-out record
is replayed alone under the candidate and the reference (the better of live and bar), and the
candidate passes when the mean of the paired differences of accept length, less `confidence_z`
standard errors, is not below −`margin` (per domain with a traffic window, the domains' weighted
means and their standard errors combined by the same weights). The figures it reports are then
means over records, not pooled. With 0 (the default) the pooled rule above stands: measured
against many more records (benchmarks/gate_evidence.py: versions trained on chats, then code), it
passed no version worse than the one it replaced, and a bound of 1.64 standard errors with no
margin refused better ones it had passed; the bound is there for operators who want promotion
only on evidence of no loss.

With `traffic_window` > 0 the verdict judges the traffic the candidate is about to serve: the
gate remembers the domains of the newest `traffic_window` records taken (held out or not), replays
each domain's held-out records apart, and weighs each domain's accept length by its share of that
window (domains with no held-out record, or absent from the window, weigh nothing; with none left,
every domain weighs alike). After a shift in traffic a version that learned the new domain is then
judged on it, not on a held-out set still made mostly of the old one; while the mix holds, each
domain weighs about what its share of the held-out set gave it. With 0 every held-out record
weighs the same (one replay of the whole set).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch

from specd.core.records import TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel
from specd.learner.simulation import record_replayable

AcceptLength = Callable[[DrafterModel, list[TrajectoryRecord]], float]
# what the reference must draft beyond the one token every pass gives for the whole margin to stand;
# below, the margin shrinks in proportion (at 1.04, a random target's drafters: 0.08 of it)
FULL_MARGIN_FROM = 0.5


class Gate:
    def __init__(self, every: int, capacity: int, min_held_out: int, margin: float, traffic_window: int = 0,
                 confidence_z: float = 0.0) -> None:
        self.every, self.min_held_out, self.margin, self.confidence_z = every, min_held_out, margin, confidence_z
        self.held_out: deque[TrajectoryRecord] = deque(maxlen=capacity)
        self.kept_from_ranks = 0
        self.traffic_window = traffic_window
        self.recent_domains: deque[str | None] = deque(maxlen=traffic_window or None)  # kept only when weighing
        self._lock = threading.Lock()
        # the live and bar sides of the last verdict: (model, held-out record ids, its accept length);
        # the same version on the same held-out set needs no second replay
        self._memos: dict[str, tuple[DrafterModel, tuple[str, ...], float]] = {}
        # with confidence_z: each side's model and its accept length per record id (held-out records
        # come and go one at a time, so most of a verdict's live side is already replayed)
        self._record_memos: dict[str, tuple[DrafterModel, dict[str, float]]] = {}

    def hold_out(self, record: TrajectoryRecord, index: int) -> bool:
        """Keep the `index`-th record taken (counting from 1) if it is its turn and a replay can score
        it; True if it was kept. With a traffic window, every record's domain joins it, kept or not."""
        if self.traffic_window > 0:
            with self._lock:
                self.recent_domains.append(record.domain)
        # a record too short to replay would score nothing for every drafter alike (a domain of only
        # such records weighed 0 tokens a pass into the verdict): it goes to training instead
        if index % self.every or not record_replayable(record):
            return False
        with self._lock:
            self.held_out.append(record)
        return True

    def drain(self) -> list[TrajectoryRecord]:
        """Take every held-out record out (a rank other than 0 hands them to rank 0's gate)."""
        with self._lock:
            records = list(self.held_out)
            self.held_out.clear()
        return records

    def keep(self, records: list[TrajectoryRecord]) -> None:
        """Hold out records another rank held out (the newest `capacity` are kept, as ever)."""
        with self._lock:
            self.held_out.extend(records)
            self.kept_from_ranks += len(records)  # rank 0's sign of the traffic other ranks take

    def margin_below(self, reference: float) -> float:
        """How far a candidate may trail `reference` (an accept length): `margin` from 1 +
        `FULL_MARGIN_FROM` on, in proportion to what the reference drafts beyond 1 below that. Near 1
        (a drafter that barely pays, as on a random target) a fixed margin would pass a version whose
        drafts all fail."""
        return self.margin * min(1.0, max(0.0, reference - 1.0) / FULL_MARGIN_FROM)

    @property
    def has_evidence(self) -> bool:
        return len(self.held_out) >= self.min_held_out

    def verdict(self, candidate: DrafterModel, live: DrafterModel | None,
                accept_length: AcceptLength, bar: DrafterModel | None = None) -> dict[str, Any]:
        """Pass or fail `candidate` against `live` (None: nothing to compare with, accept length 1)
        and `bar` (None: the live version is the bar). `improved` says it passed without the margin."""
        if not all(bool(torch.isfinite(p).all()) for p in candidate.parameters()):
            return {"passed": False, "reason": "non-finite weights"}
        with self._lock:
            records = list(self.held_out)
        if len(records) < self.min_held_out:
            return {"passed": False, "reason": f"{len(records)} held-out records, the gate needs {self.min_held_out}",
                    "held_out_records": len(records)}
        shares = self.domain_shares(records)
        if self.confidence_z > 0:
            return self._paired_verdict(candidate, live, bar, shares, accept_length, len(records))
        ours = _weighted(shares, lambda domain, group: accept_length(candidate, group))
        theirs = _weighted(shares, lambda domain, group: self._replayed(f"live {domain}", live, group, accept_length))
        floor = (_weighted(shares, lambda domain, group: self._replayed(f"bar {domain}", bar, group, accept_length))
                 if bar is not None else theirs)
        reference = max(theirs, floor)
        passed = ours >= reference - self.margin_below(reference)
        if passed:
            reason = "ok"
        elif theirs >= floor:
            reason = f"accept length {ours:.3f} is worse than live {theirs:.3f} beyond the margin"
        else:
            reason = f"accept length {ours:.3f} is worse than the bar {floor:.3f} beyond the margin"
        weights = {"domain_weights": _named(shares)} if self.traffic_window > 0 else {}
        return {"passed": passed, "reason": reason, "candidate": ours, "live": theirs, "bar": floor,
                "improved": ours >= reference, "held_out_records": len(records),
                "sampled_records": sum(1 for r in records if r.temperature > 0), **weights}

    def _paired_verdict(self, candidate: DrafterModel, live: DrafterModel | None, bar: DrafterModel | None,
                        shares: dict[str | None, tuple[float, list[TrajectoryRecord]]], accept_length: AcceptLength,
                        held_out: int) -> dict[str, Any]:
        """`verdict` with `confidence_z` > 0: the lower bound of the paired mean difference."""
        records = [r for _, group in shares.values() for r in group]
        ours = {r.record_id: accept_length(candidate, [r]) for r in records}
        theirs = self._per_record("live", live, records, accept_length)
        floor = self._per_record("bar", bar, records, accept_length) if bar is not None else theirs
        means = {side: sum(w * statistics.fmean(values[r.record_id] for r in group) for w, group in shares.values())
                 for side, values in (("candidate", ours), ("live", theirs), ("bar", floor))}
        reference = theirs if means["live"] >= means["bar"] else floor
        difference, variance = 0.0, 0.0
        for weight, group in shares.values():
            pairs = [ours[r.record_id] - reference[r.record_id] for r in group]
            difference += weight * statistics.fmean(pairs)
            variance += weight ** 2 * (statistics.variance(pairs) / len(pairs) if len(pairs) > 1 else math.inf)
        bound = difference - self.confidence_z * math.sqrt(variance)
        margin = self.margin_below(max(means["live"], means["bar"]))
        passed = bound >= -margin
        side = "live" if reference is theirs else "the bar"
        reason = "ok" if passed else (f"accept length {means['candidate']:.3f} against {side} "
                                      f"{max(means['live'], means['bar']):.3f}: the difference's lower bound "
                                      f"{bound:+.3f} is below -{margin:.3g}")
        weights = {"domain_weights": _named(shares)} if self.traffic_window > 0 else {}
        return {"passed": passed, "reason": reason, **means, "difference": difference, "lower_bound": bound,
                "improved": bound >= 0, "held_out_records": held_out,
                "sampled_records": sum(1 for r in records if r.temperature > 0), **weights}

    def _per_record(self, side: str, model: DrafterModel | None, records: list[TrajectoryRecord],
                    accept_length: AcceptLength) -> dict[str, float]:
        """`model`'s accept length on each record alone, by record id (1.0 each for None); those of
        the last call are reused while the model is the same object (only new records replay)."""
        if model is None:
            return dict.fromkeys((r.record_id for r in records), 1.0)
        memo = self._record_memos.get(side)
        known = memo[1] if memo is not None and memo[0] is model else {}
        values = {r.record_id: known[r.record_id] if r.record_id in known else accept_length(model, [r])
                  for r in records}
        self._record_memos[side] = (model, values)
        return values

    def domain_shares(self, records: list[TrajectoryRecord]) -> dict[str | None, tuple[float, list[TrajectoryRecord]]]:
        """Each held-out domain's weight in the verdict and its records (one group, weight 1, when
        `traffic_window` is 0)."""
        if self.traffic_window <= 0:
            return {None: (1.0, records)}
        groups: dict[str | None, list[TrajectoryRecord]] = {}
        for record in records:
            groups.setdefault(record.domain, []).append(record)
        with self._lock:
            seen = Counter(self.recent_domains)
        total = sum(seen[domain] for domain in groups)
        if total == 0:  # the window holds none of the held-out domains: judge them alike
            return {domain: (1 / len(groups), group) for domain, group in groups.items()}
        return {domain: (seen[domain] / total, group) for domain, group in groups.items() if seen[domain]}

    def _replayed(self, side: str, model: DrafterModel | None, records: list[TrajectoryRecord],
                  accept_length: AcceptLength) -> float:
        if model is None:
            return 1.0
        ids = tuple(r.record_id for r in records)
        memo = self._memos.get(side)
        if memo is not None and memo[0] is model and memo[1] == ids:
            return memo[2]
        value = accept_length(model, records)
        self._memos[side] = (model, ids, value)  # holds `model`, so `is` cannot match a recycled object
        return value


def _named(shares: dict[str | None, tuple[float, list[TrajectoryRecord]]]) -> dict[str, float]:
    """Each domain's weight by name, records with no domain under "default" (as the canary names them)."""
    return {domain or "default": round(weight, 4) for domain, (weight, _) in shares.items()}


def _weighted(shares: dict[str | None, tuple[float, list[TrajectoryRecord]]],
              replay: Callable[[str | None, list[TrajectoryRecord]], float]) -> float:
    return sum(weight * replay(domain, group) for domain, (weight, group) in shares.items())
