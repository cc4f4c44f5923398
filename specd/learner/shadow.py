"""The canary by shadow scoring: the live version against the one before it, on the same records.

Contract: `observe(record)` keeps every `every`-th record the learner takes (at most `capacity`
wait). `check()` scores the waiting records that the live version served (its learned drafts
are in them) by replaying both the live version and its predecessor (the last entry of the
store's live history) on each: one paired difference of accept length per record, per domain
(each keeps its newest `history`). It judges every domain, and all domains pooled, that has
`min_records` pairs: the live version regressed when the mean difference is below −`margin` and
the mean plus `z` standard errors is still below 0. Then it rolls back, with the evidence, by
compare-and-set on the live version it judged (`WeightStore.rollback(if_live=...)`); someone
else's change meanwhile stands. A pinned live version is the floor and is never rolled back.
When the live version (or its predecessor) changes, the pairs start again.
Why paired: both versions are replayed on identical positions, so a change of traffic (a harder
domain, longer prompts) moves both sides of every pair alike. With an unchanged drafter every
difference is exactly 0, and no traffic shift can roll it back; the served acceptance of two
versions that saw different traffic (what `specd.control.acceptance.AcceptanceLog` shows) can.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from specd.core.errors import StoreError
from specd.core.records import LEARNED_SOURCE, TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel
from specd.hotswap.store import LiveVersionChanged, WeightStore
from specd.learner.simulation import record_replayable

log = logging.getLogger(__name__)

POOLED = "all domains"
AcceptLength = Callable[[DrafterModel, list[TrajectoryRecord]], float]


class ShadowCanary:
    def __init__(self, store: WeightStore, load: Callable[[int], DrafterModel], accept_length: AcceptLength,
                 margin: float, min_records: int, z: float, every: int = 2, capacity: int = 64,
                 history: int = 1000) -> None:
        self.store, self.load, self.accept_length = store, load, accept_length
        self.margin, self.min_records, self.z, self.every = margin, min_records, z, every
        self.waiting: deque[TrajectoryRecord] = deque(maxlen=capacity)
        self._seen = 0
        self._pair: tuple[int, int] | None = None
        self.models: dict[int, DrafterModel] = {}
        # the newest `history` pairs per domain: a version live for days is judged on recent traffic
        self.differences: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=history))
        self.rollbacks: list[dict[str, Any]] = []

    def observe(self, record: TrajectoryRecord) -> None:
        if not record_replayable(record):  # it would pair 0 with 0 and dilute the mean
            return
        self._seen += 1
        if self._seen % self.every == 0:
            self.waiting.append(record)

    def check(self) -> dict[str, Any] | None:
        """Score what waits and roll a regression back; the evidence when it did."""
        if not self.waiting:  # the learner ticks many times a second: no store reads for nothing
            return None
        pair = self._live_pair()
        if pair is None:
            self.waiting.clear()
            return None
        live, predecessor = pair
        scored = False
        while self.waiting:
            record = self.waiting.popleft()
            if any(s.version == live and s.source == LEARNED_SOURCE for s in record.steps):
                ours = self.accept_length(self._model(live), [record])
                theirs = self.accept_length(self._model(predecessor), [record])
                self.differences[record.domain or "default"].append(ours - theirs)
                scored = True
        evidence = self.verdict(live, predecessor) if scored else None
        if evidence is None:
            return None
        try:
            evidence["restored"] = self.store.rollback(None, evidence, if_live=live, unless_pinned=True)
        except LiveVersionChanged:  # someone else changed (or pinned) the live version meanwhile: theirs stands
            return None
        log.warning("canary rolled version %s back to %s: %s", live, evidence["restored"], evidence)
        self.rollbacks.append(evidence)
        return evidence

    def verdict(self, live: int, predecessor: int) -> dict[str, Any] | None:
        """Rollback evidence for `live` from the pairs so far, or None when it stands."""
        groups: dict[str, list[float]] = {domain: list(values) for domain, values in self.differences.items()}
        if len(groups) > 1:
            groups[POOLED] = [d for values in self.differences.values() for d in values]
        for domain, values in groups.items():
            n = len(values)
            if n < self.min_records:
                continue
            mean = sum(values) / n
            spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
            bound = mean + self.z * spread / math.sqrt(n)
            if mean < -self.margin and bound < 0:
                return {"by": "canary", "method": "paired replay", "domain": domain, "records": n,
                        "mean_difference": mean, "upper_bound": bound, "predecessor": predecessor,
                        "margin": self.margin, "z": self.z, "time": time.time()}
        return None

    def _live_pair(self) -> tuple[int, int] | None:
        """(live, predecessor) while a canary can judge; the pairs start again when it changes."""
        try:
            live = self.store.live_version()
            history = self.store.live_state()["history"] if live is not None else []
            pinned = live is not None and bool(self.store.manifest(live).get("pinned"))
        except StoreError:  # a damaged store file: no pair to judge until it is repaired (the store says why)
            live, history, pinned = None, [], False
        pair = (live, history[-1]) if live is not None and history and not pinned else None
        if pair != self._pair:
            self._pair, self.models = pair, {}
            self.differences.clear()
        return pair

    def _model(self, version: int) -> DrafterModel:
        if version not in self.models:
            self.models[version] = self.load(version)
        return self.models[version]
