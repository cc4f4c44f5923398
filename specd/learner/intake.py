"""Record intake: what comes off the bus is validated, counted, held out for the gate or buffered.

Contract: `Intake.take(bus, timeout)` takes up to 1024 raw records, validates each against the
target's vocabulary and the drafter's feature width (`Intake.check`), and counts a refusal under
its `RefusalReason` (`stats.refused`) instead of raising; records shorter than the objective can
use are refused as `too-short`. Every `holdout_every`-th accepted record, greedy or sampled, goes to
the gate (`Gate.hold_out`), counted by the number the sidecar's spool gave it where it has one (so
that its role survives restarts); the rest join `buffer`, a bounded deque of the newest trajectories.
Every accepted record is also shown to `observe` (the canary's shadow scoring), when given.
Whatever a record holds, validating it never raises out of `take`: an error validation did not
foresee is a `malformed` refusal too, so one odd record cannot cost the batch it came in. Refusals
are logged by `note_refusal`: the first few of each reason, then every thousandth (a flood of bad
records is counted, not written out line by line).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable

from specd.core.errors import RecordRefused, RefusalReason
from specd.core.records import TrajectoryRecord, validate_record
from specd.learner.config import LearnerStats
from specd.learner.gate import Gate
from specd.learner.objectives import Objective
from specd.learner.spool import SPOOL_INDEX
from specd.transport.bus import Bus

log = logging.getLogger(__name__)

LOGGED_PER_REASON = 10   # refusals of one reason logged one by one; after that every 1000th
LOG_EVERY = 1000


def note_refusal(counts: Counter, reason: str, message: str) -> None:
    """Count a refusal under `reason`; log it while there are few of its kind."""
    counts[reason] += 1
    seen = counts[reason]
    if seen <= LOGGED_PER_REASON or seen % LOG_EVERY == 0:
        more = f" ({seen} {reason} refusals so far; from now on every {LOG_EVERY}th is logged)" \
            if seen >= LOGGED_PER_REASON else ""
        log.warning("refused %s%s", message, more)


class Intake:
    def __init__(self, vocab_size: int, objective: Objective, gate: Gate, capacity: int, stats: LearnerStats,
                 observe: Callable[[TrajectoryRecord], None] | None = None) -> None:
        self.vocab_size, self.objective, self.gate, self.stats = vocab_size, objective, gate, stats
        self.observe = observe
        self.buffer: deque[TrajectoryRecord] = deque(maxlen=capacity)

    def check(self, raw: object) -> TrajectoryRecord:
        """`raw` as a typed record, or `RecordRefused` under the reason `take` would count it by.
        Reads nothing that changes, so any thread may call it (the sidecar does, before spooling)."""
        try:
            record = validate_record(raw, self.vocab_size, self.objective.feature_size)
        except RecordRefused:
            raise
        except Exception as error:  # unforeseen by validation: still the record's fault, not the batch's
            raise RecordRefused(f"{type(error).__name__}: {str(error)[:200]}", RefusalReason.MALFORMED) from None
        if record.num_tokens < self.objective.min_tokens:
            raise RecordRefused(f"{record.num_tokens} tokens, fewer than the {self.objective.min_tokens} the "
                                f"objective can use", RefusalReason.TOO_SHORT)
        return record

    def take(self, bus: Bus, timeout: float = 0.0) -> int:
        """Records accepted from one take of the bus (held out or buffered)."""
        taken = 0
        for raw in bus.take(1024, timeout):
            try:
                record = self.check(raw)
            except RecordRefused as error:
                note_refusal(self.stats.refused, str(error.reason), f"a record: {error}")
                continue
            self.stats.records_in += 1
            taken += 1
            if self.observe is not None:
                self.observe(record)
            # the sidecar numbers records in its spool, the same number at every restart: a record
            # the live version trained on must not come back held out (see specd.learner.spool)
            index = raw.get(SPOOL_INDEX) if isinstance(raw, dict) else None
            index = index if isinstance(index, int) and not isinstance(index, bool) else self.stats.records_in
            # sampled records are held out too: they are evidence for the gate (see specd.learner.gate)
            if not self.gate.hold_out(record, index):
                self.buffer.append(record)
        return taken
