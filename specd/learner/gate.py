"""The evaluation gate: the held-out records and the verdict on a candidate drafter.

Contract: every `every`-th record the learner takes is held out (kept from training; the newest
`capacity` are kept), whatever its temperature. A candidate passes when its weights are finite and
its simulated accept length on the held-out records is not worse than the live version's by more
than `margin`. With fewer than `min_held_out` held-out records there is no evidence and no pass:
`has_evidence` is False (the learner then waits and trains on) and `verdict` fails. The learner's
thread holds records out while an operator's candidate may be judged on another thread: the
held-out set is copied under a lock, so a verdict judges one consistent set.

Why sampled records are evidence: the serving drafter proposes its argmax x, a one-hot draft, so
speculative sampling accepts it with probability min(1, p(x) / 1) = p(x), p the target's
distribution after the request's temperature and top-p. Speculation is lossless, so a record's
tokens are draws from p whichever drafter served them, and a recorded sampled token equals x with
probability p(x) too; position after position along a run of drafts the same holds, since the run
continues only where the recorded prefix equals the drafts. Replaying the drafter's greedy
proposals against a sampled trajectory (`Objective.simulate`) is therefore an unbiased estimate of
the accept length it reaches on such requests: noisier than on greedy records (one draw instead of
the mode), but evidence. Candidate and live are replayed on the same records, so both sides of the
comparison see the same draws.
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

    def hold_out(self, record: TrajectoryRecord, index: int) -> bool:
        """Keep the `index`-th record taken (counting from 1) if it is its turn; True if it was kept."""
        if index % self.every:
            return False
        with self._lock:
            self.held_out.append(record)
        return True

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
        theirs = accept_length(live, records) if live is not None else 1.0
        passed = ours >= theirs - self.margin
        reason = "ok" if passed else f"accept length {ours:.3f} is worse than live {theirs:.3f} beyond the margin"
        return {"passed": passed, "reason": reason, "candidate": ours, "live": theirs,
                "held_out_records": len(records),
                "sampled_records": sum(1 for r in records if r.temperature > 0)}
