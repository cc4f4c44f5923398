"""Record intake: what comes off the bus is validated, counted, held out for the gate or buffered.

Contract: `Intake.take(bus, timeout)` takes up to 1024 raw records, validates each against the
target's vocabulary and the drafter's feature width, and counts a refusal under its
`RefusalReason` (`stats.refused`) instead of raising; records shorter than the objective can use
are refused as `too-short`. Every `holdout_every`-th accepted record, greedy or sampled, goes to
the gate (`Gate.hold_out`); the rest join `buffer`, a bounded deque of the newest trajectories.
Every accepted record is also shown to `observe` (the canary's shadow scoring), when given.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from specd.core.errors import RecordRefused, RefusalReason
from specd.core.records import TrajectoryRecord, validate_record
from specd.learner.config import LearnerStats
from specd.learner.gate import Gate
from specd.learner.objectives import Objective
from specd.transport.bus import Bus

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, vocab_size: int, objective: Objective, gate: Gate, capacity: int, stats: LearnerStats,
                 observe: Callable[[TrajectoryRecord], None] | None = None) -> None:
        self.vocab_size, self.objective, self.gate, self.stats = vocab_size, objective, gate, stats
        self.observe = observe
        self.buffer: deque[TrajectoryRecord] = deque(maxlen=capacity)

    def take(self, bus: Bus, timeout: float = 0.0) -> int:
        """Records accepted from one take of the bus (held out or buffered)."""
        taken = 0
        for raw in bus.take(1024, timeout):
            try:
                record = validate_record(raw, self.vocab_size, self.objective.feature_size)
            except RecordRefused as error:
                self.stats.refused[str(error.reason)] += 1
                log.warning("refused a record: %s", error)
                continue
            if record.num_tokens < self.objective.min_tokens:
                self.stats.refused[str(RefusalReason.TOO_SHORT)] += 1
                continue
            self.stats.records_in += 1
            taken += 1
            if self.observe is not None:
                self.observe(record)
            # sampled records are held out too: they are evidence for the gate (see specd.learner.gate)
            if not self.gate.hold_out(record, self.stats.records_in):
                self.buffer.append(record)
        return taken
