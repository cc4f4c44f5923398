"""The evaluation gate: the held-out records and the verdict on a candidate drafter.

Contract: every `every`-th record the learner takes is held out (kept from training; the newest
`capacity` are kept), whatever its temperature. A candidate passes when its weights are finite and
its simulated accept length on the held-out records is not worse than the live version's by more
than `margin`. With fewer than `min_held_out` held-out records there is no evidence and no pass:
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
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from specd.core.records import TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel

AcceptLength = Callable[[DrafterModel, list[TrajectoryRecord]], float]


class Gate:
    def __init__(self, every: int, capacity: int, min_held_out: int, margin: float) -> None:
        self.every, self.min_held_out, self.margin = every, min_held_out, margin
        self.held_out: deque[TrajectoryRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        # the live side of the last verdict: (live model, held-out record ids, its accept length);
        # the same live version on the same held-out set needs no second replay
        self._live_memo: tuple[DrafterModel, tuple[str, ...], float] | None = None

    def hold_out(self, record: TrajectoryRecord, index: int) -> bool:
        """Keep the `index`-th record taken (counting from 1) if it is its turn; True if it was kept."""
        if index % self.every:
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

    @property
    def has_evidence(self) -> bool:
        return len(self.held_out) >= self.min_held_out

    def verdict(self, candidate: DrafterModel, live: DrafterModel | None,
                accept_length: AcceptLength) -> dict[str, Any]:
        """Pass or fail `candidate` against `live` (None: nothing to compare with, accept length 1)."""
        if not all(bool(torch.isfinite(p).all()) for p in candidate.parameters()):
            return {"passed": False, "reason": "non-finite weights"}
        with self._lock:
            records = list(self.held_out)
        if len(records) < self.min_held_out:
            return {"passed": False, "reason": f"{len(records)} held-out records, the gate needs {self.min_held_out}",
                    "held_out_records": len(records)}
        ours = accept_length(candidate, records)
        theirs = self._live_accept_length(live, records, accept_length)
        passed = ours >= theirs - self.margin
        reason = "ok" if passed else f"accept length {ours:.3f} is worse than live {theirs:.3f} beyond the margin"
        return {"passed": passed, "reason": reason, "candidate": ours, "live": theirs,
                "held_out_records": len(records),
                "sampled_records": sum(1 for r in records if r.temperature > 0)}

    def _live_accept_length(self, live: DrafterModel | None, records: list[TrajectoryRecord],
                            accept_length: AcceptLength) -> float:
        if live is None:
            return 1.0
        ids = tuple(r.record_id for r in records)
        memo = self._live_memo
        if memo is not None and memo[0] is live and memo[1] == ids:
            return memo[2]
        value = accept_length(live, records)
        self._live_memo = (live, ids, value)  # holds `live`, so `is` cannot match a recycled object
        return value
