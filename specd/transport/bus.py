"""The record bus between servers and the learner; the embedded default lives in one process.

Contract: `publish` never blocks the caller (a decoding loop): the in-process bus keeps a bounded
queue and, when the learner falls behind, sheds the oldest record and counts it. `take` hands the
consumer up to n records, waiting at most `timeout` seconds for the first. Records travel as
plain dicts, exactly what a network transport would carry, so the learner validates them the
same way whichever bus brought them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol


class RecordSink(Protocol):
    """The serving side of a bus: hand over a record without ever blocking."""

    def publish(self, record: dict[str, Any]) -> None: ...


class Bus(RecordSink, Protocol):
    """The learner's side too: take what has arrived."""

    def take(self, max_records: int, timeout: float) -> list[dict[str, Any]]: ...


@dataclass
class BusCounters:
    published: int = 0
    shed: int = 0
    delivered: int = 0


class InProcessBus:
    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"bus capacity must be at least 1, got {capacity}")
        self._queue: deque[dict[str, Any]] = deque()
        self._capacity = capacity
        self._ready = threading.Condition()
        self.counters = BusCounters()

    def publish(self, record: dict[str, Any]) -> None:
        with self._ready:
            if len(self._queue) >= self._capacity:
                self._queue.popleft()  # the oldest record is the stalest training signal
                self.counters.shed += 1
            self._queue.append(record)
            self.counters.published += 1
            self._ready.notify()

    def take(self, max_records: int, timeout: float) -> list[dict[str, Any]]:
        with self._ready:
            if not self._queue:
                self._ready.wait(timeout)
            batch = [self._queue.popleft() for _ in range(min(max_records, len(self._queue)))]
            self.counters.delivered += len(batch)
            return batch

    @property
    def backlog(self) -> int:
        return len(self._queue)
