"""A supervised background loop: a daemon thread that runs `tick` until stopped and survives its faults.

Contract: `start` runs `tick` repeatedly on a thread of lowered priority (work beside decoding
yields whenever both want a core); any Exception in a tick is logged with its traceback, counted
on `stats` (`loop_failures`, `last_failure`) and followed by a pause of `backoff_s`, so a
persistent fault is retried, not spun on. `stop` ends the loop within one tick.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, Self

from specd.core.errors import out_of_space
from specd.core.threads import lower_thread_priority

log = logging.getLogger(__name__)


class FailureCounts(Protocol):
    loop_failures: int
    last_failure: dict[str, Any] | None


class SupervisedLoop:
    def __init__(self, name: str, stats: FailureCounts, backoff_s: float) -> None:
        self._name, self._failures, self._backoff_s = name, stats, backoff_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        lower_thread_priority()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as error:  # a bug here must not take serving down with it, nor pass unseen
                self._failures.loop_failures += 1
                self._failures.last_failure = {"error": f"{type(error).__name__}: {error}", "time": time.time()}
                if out_of_space(error):  # the machine's state, not a bug: one line, no traceback
                    log.error("%s cannot write (no space left on the device: %s; %d failures so far); "
                              "retrying in %.0f s", self._name, str(error).splitlines()[0][:300],
                              self._failures.loop_failures, self._backoff_s)
                else:
                    log.exception("%s failed (%d failures so far); retrying in %.0f s",
                                  self._name, self._failures.loop_failures, self._backoff_s)
                self._stop.wait(self._backoff_s)
