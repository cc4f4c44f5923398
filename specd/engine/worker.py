"""Run an `Engine` on its own thread and let other threads (an asyncio server) talk to it.

Contract: `EngineWorker.submit` is thread-safe and returns at once; the worker thread admits the
request between two decoding steps, reports newly emitted tokens after every step through the
request's `on_tokens` callback and the end through `on_done` (or a refusal through `on_error`).
Callbacks run on the worker thread and must only hand data over (e.g. `call_soon_threadsafe`).
Finished requests are turned into trajectory records and published on the bus, which never
blocks, and added to the traffic table when there is one. `cancel` ends a request at the next
step boundary, decoding or still queued (a client that went away, a stop string), and its slot
or place in line is free from then on; one cancelled as `answered` (a stop string ended its
answer) is recorded and tabled still, since every token it decoded is the target's, while one
whose client went away is not. `queued` counts the requests that wait for a slot beyond
the free ones, not cancellations nor requests whose client has gone (they never take a slot). Nothing
here waits on disk or network inside a step. The decoding thread is supervised: a fault in a
step or in what follows it fails the requests in flight with a 500, is counted in the server's
`BackgroundHealth` under "engine" (`/health`, `specd_background_failures_total`), and the
engine serves on from a clean state.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from specd.core.errors import RequestRefused
from specd.core.threads import BackgroundHealth
from specd.drafter.swap import Swappable
from specd.drafter.traffic_table import TrafficTable
from specd.engine.engine import Engine
from specd.engine.request import SamplingParams, Sequence, record_from_sequence
from specd.transport.bus import RecordSink

log = logging.getLogger(__name__)

ENGINE_TASK = "engine"  # the decoding thread's name among the supervised background tasks


class WorkerMetrics(Protocol):
    """What the worker reports per verification step and per published record (the server's metrics)."""

    def observe_verification(self, version: int | None, source: str, drafts: int, accepted: int, emitted: int,
                             domain: str = "default") -> None: ...

    def record_published(self) -> None: ...


class Failure(NamedTuple):
    """Why a request ended without its answer: an HTTP-like status (400 refused, 500 fault), the
    reason in words, and for a refusal the request field at fault and OpenAI's code where known."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass
class Submission:
    prompt_ids: list[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[Sequence], None]
    on_error: Callable[[Failure], None]
    domain: str | None = None
    request_id: str | None = None
    sent: int = 0                      # output tokens already reported
    steps_seen: int = 0                # verification steps already counted in the metrics
    seq: Sequence | None = field(default=None, repr=False)


class EngineWorker:
    def __init__(self, engine: Engine, bus: RecordSink | None = None, server_id: str = "specd",
                 metrics: WorkerMetrics | None = None, table: TrafficTable | None = None,
                 health: BackgroundHealth | None = None) -> None:
        self.engine = engine
        self.health = health if health is not None else BackgroundHealth()
        self.health.register(ENGINE_TASK)
        self.table = table  # learns each finished request (the drafter reads it on this same thread)
        self.bus = bus
        self.metrics = metrics
        self.server_id = server_id
        self._inbox: queue.Queue[Submission | str] = queue.Queue()  # requests and the ids of cancelled ones
        self._num_inbox_requests = 0  # the Submissions in the inbox (cancellations wait there too)
        self._inbox_ids: set[str] = set()      # their request ids
        self._withdrawn: set[str] = set()      # ids cancelled whose cancellation waits in the inbox
        self._answered: set[str] = set()       # ids cancelled because their answer was complete
        self._count_lock = threading.Lock()
        self._active: dict[str, Submission] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_records_published = 0

    def submit(self, submission: Submission) -> None:
        with self._count_lock:
            self._num_inbox_requests += 1
            if submission.request_id is not None:
                self._inbox_ids.add(submission.request_id)
        self._inbox.put(submission)

    @property
    def queued(self) -> int:
        """Requests that wait for a batch slot: those submitted and not decoding yet (in the inbox
        or the engine's waiting line) beyond the slots that the next step boundary gives them.

        Cancelled requests are left out, and a running row that has finished or whose client went
        away counts as a free slot, both at once: a long step (a swap, a prefill chunk, a loaded
        core) would otherwise let requests that are about to be admitted, or abandoned ones, fill
        the line and turn new clients away while slots stand free."""
        with self._count_lock:
            withdrawn = set(self._withdrawn)
            in_inbox = self._num_inbox_requests - len(withdrawn & self._inbox_ids)
        engine = self.engine

        def live(seq: Sequence) -> bool:
            return not seq.is_finished and seq.request_id not in withdrawn

        waiting = sum(1 for seq in list(engine.waiting) if live(seq))
        prefilling = engine.prefilling  # read once: the decoding thread may clear it meanwhile
        busy = sum(1 for seq in list(engine.running) if live(seq))
        busy += int(prefilling is not None and live(prefilling.seq))
        free = max(engine.config.max_batch - busy, 0)
        return max(in_inbox + waiting - free, 0)

    def cancel(self, request_id: str, answered: bool = False) -> None:
        """End a request; `answered`: its client has the whole answer (a stop string), so it is recorded."""
        with self._count_lock:
            self._withdrawn.add(request_id)
            if answered:
                self._answered.add(request_id)
        self._inbox.put(request_id)

    def start(self) -> EngineWorker:
        self._thread = threading.Thread(target=self._run, name="specd-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put("")
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if isinstance(item, str):
                active = bool(item) and item in self._active
                if active:
                    self.engine.cancel(item)
                with self._count_lock:
                    self._withdrawn.discard(item)  # applied: the request is finished, if it was there
                    if not active:  # over already: nothing will be recorded under its id
                        self._answered.discard(item)
                continue
            with self._count_lock:
                self._num_inbox_requests -= 1
                if item.request_id is not None:
                    self._inbox_ids.discard(item.request_id)  # its cancellation, if any, follows it
            try:
                item.seq = self.engine.add_request(item.prompt_ids, item.params, item.request_id)
            except RequestRefused as error:
                item.on_error(Failure(400, str(error), error.param, error.code))
                continue
            self._active[item.seq.request_id] = item

    def _run(self) -> None:
        """The decoding thread, supervised: any fault in a step or in what follows it (callbacks,
        records) is counted under `ENGINE_TASK`, fails the requests in flight with a 500, and the
        engine starts afresh on the next request. The thread itself never dies of it."""
        while not self._stop.is_set():
            try:
                self._once()
            except Exception as error:  # never leave clients hanging on an engine fault
                log.exception("engine step failed")
                self.health.failed(ENGINE_TASK, error)
                for sub in self._active.values():
                    with contextlib.suppress(Exception):  # one client's failing callback spares the rest
                        sub.on_error(Failure(500, f"internal engine error: {error}"))
                self._active.clear()
                self.engine.reset()

    def _once(self) -> None:
        self._drain_inbox(block=not self.engine.has_work)
        if not self.engine.has_work:
            # idle: a swap offered meanwhile can happen now rather than at the next request
            if isinstance(self.engine.drafter, Swappable):
                self.engine.drafter.apply_pending()
            return
        finished = self.engine.step()
        self._report(finished)

    def _report(self, finished: list[Sequence]) -> None:
        """Tokens to their clients, finished requests to theirs, to the table and the bus."""
        for sub in self._active.values():
            assert sub.seq is not None
            self._count_steps(sub)
            if sub.seq.num_output_tokens > sub.sent:
                sub.on_tokens(sub.seq.output_ids[sub.sent:])
                sub.sent = sub.seq.num_output_tokens
        for seq in finished:
            if seq.request_id not in self._active:
                continue
            sub = self._active.pop(seq.request_id)
            if seq.finish_reason == "error":  # this request alone failed (e.g. its prefill)
                sub.on_error(Failure(500, f"internal engine error: {seq.error}"))
                continue
            sub.on_done(seq)
            with self._count_lock:
                answered = seq.request_id in self._answered
                self._answered.discard(seq.request_id)
            if seq.finish_reason == "cancelled" and not answered:  # its client went away: not served traffic
                continue
            if self.table is not None:
                self.table.add(seq.prompt_ids + seq.output_ids)
            if self.bus is not None:
                record = record_from_sequence(seq, self.server_id, time.time(), sub.domain)
                self.bus.publish(record.to_dict())
                self.num_records_published += 1
                if self.metrics is not None:
                    self.metrics.record_published()

    def _count_steps(self, sub: Submission) -> None:
        assert sub.seq is not None
        if self.metrics is not None:
            steps = sub.seq.steps
            for i, step in enumerate(steps[sub.steps_seen:], start=sub.steps_seen):
                end = steps[i + 1].position if i + 1 < len(steps) else sub.seq.num_tokens
                self.metrics.observe_verification(step.drafter_version, step.source, len(step.drafts),
                                                  min(step.num_accepted, end - step.position), end - step.position,
                                                  sub.domain or "default")
        sub.steps_seen = len(sub.seq.steps)
