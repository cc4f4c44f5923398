"""Thread helpers shared by every layer that runs background work beside decoding.

Contract:
- `lower_thread_priority` makes the calling thread (and threads it starts, e.g. its OpenMP team)
  yield to decoding on Linux, which keeps a nice value per thread; elsewhere it quietly does
  nothing.
- `BackgroundHealth` is a thread-safe registry of named background tasks: for each, how often its
  body failed, the last error and when, and how often it was restarted. `snapshot()` is what
  `/v1/status` shows under `background`; `failures()` is what `/metrics` exports.
- `supervise` (asyncio) and `supervised_thread` (a thread) run a body until told to stop; when
  the body raises they log the error with its traceback, record it, wait a jittered exponential
  backoff and run the body again. A background loop is never silently dead: it is either
  running or visibly failing. A body that returns normally is not restarted.
- `CallWorker` runs submitted calls one at a time on a daemon thread of its own, at the
  priority of the thread that built it, and answers each with a future: rare, short requests
  (an operator's) that must not queue behind a long-running loop. `wait_idle` lets that loop
  step aside while calls are pending, so that they also get the cores to themselves.
Imports nothing of specd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from queue import SimpleQueue
from typing import Any

log = logging.getLogger(__name__)


def lower_thread_priority(niceness: int = 10) -> None:
    """Renice the calling thread so that decoding wins whenever both want a core."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def backoff_delay(attempt: int, base: float = 0.2, cap: float = 5.0) -> float:
    """Jittered exponential backoff: uniform in [0, min(cap, base * 2^attempt)]."""
    return random.uniform(0, min(cap, base * 2 ** min(attempt, 30)))


@dataclass
class TaskHealth:
    failures: int = 0
    restarts: int = 0
    last_error: str | None = None
    last_failure_time: float | None = None   # unix time


class BackgroundHealth:
    """Failure counts of named background tasks, read by status and metrics from other threads."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskHealth] = {}
        self._lock = threading.Lock()

    def register(self, name: str) -> None:
        """Make a task visible (with zero failures) before it ever fails."""
        with self._lock:
            self._tasks.setdefault(name, TaskHealth())

    def failed(self, name: str, error: BaseException) -> None:
        with self._lock:
            task = self._tasks.setdefault(name, TaskHealth())
            task.failures += 1
            task.last_error = f"{type(error).__name__}: {error}"
            task.last_failure_time = time.time()

    def restarted(self, name: str) -> None:
        with self._lock:
            self._tasks.setdefault(name, TaskHealth()).restarts += 1

    def failures(self) -> dict[str, int]:
        with self._lock:
            return {name: task.failures for name, task in self._tasks.items()}

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {name: asdict(task) for name, task in self._tasks.items()}

    def failing(self, within_s: float = 60.0) -> list[str]:
        """The tasks that failed within the last `within_s` seconds (what a health probe should flag)."""
        now = time.time()
        with self._lock:
            return sorted(name for name, task in self._tasks.items()
                          if task.last_failure_time is not None and now - task.last_failure_time <= within_s)


def _this_attempt(attempt: int, started: float, max_delay: float) -> int:
    # a body that ran well past the longest backoff was healthy: its failure starts the backoff anew
    return 0 if time.monotonic() - started > 10 * max_delay else attempt


async def supervise(name: str, body: Callable[[], Awaitable[None]], health: BackgroundHealth,
                    stop: asyncio.Event, base_delay: float = 0.2, max_delay: float = 5.0) -> None:
    """Run `await body()` until it returns or `stop` is set, restarting it after every exception."""
    health.register(name)
    attempt = 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any failure: the loop must come back, and be seen failing
            log.exception("background task %s failed; restarting it", name)
            health.failed(name, error)
        attempt = _this_attempt(attempt, started, max_delay)
        with contextlib.suppress(TimeoutError):  # a stop during the backoff ends it at once
            await asyncio.wait_for(stop.wait(), timeout=backoff_delay(attempt, base_delay, max_delay))
        attempt += 1
        if not stop.is_set():
            health.restarted(name)


def supervised_thread(name: str, body: Callable[[], None], health: BackgroundHealth, stop: threading.Event,
                      base_delay: float = 0.2, max_delay: float = 5.0) -> threading.Thread:
    """A daemon thread (not started) that runs `body()` until it returns or `stop` is set,
    restarting it after every exception."""
    health.register(name)

    def run() -> None:
        attempt = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                body()
                return
            except Exception as error:  # any failure: the thread must come back, and be seen failing
                log.exception("background thread %s failed; restarting it", name)
                health.failed(name, error)
            attempt = _this_attempt(attempt, started, max_delay)
            if stop.wait(backoff_delay(attempt, base_delay, max_delay)):
                return
            attempt += 1
            health.restarted(name)

    return threading.Thread(target=run, name=name, daemon=True)


class CallWorker:
    """Calls run in order on one daemon thread, started at once (it inherits its creator's
    priority on Linux: build it from a thread that was not reniced)."""

    def __init__(self, name: str) -> None:
        self._calls: SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._calls.put((fn, future))
        return future

    def wait_idle(self, timeout: float) -> bool:
        """Block while calls are queued or running (at most `timeout` s); True if none is."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            fn, future = self._calls.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as error:  # the caller gets it; the worker goes on
                        future.set_exception(error)
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.set()
