"""What leaves the proposer besides drafts: finished records and acceptance reports, off the decoding thread.

Contract: `Telemetry` owns the lock that guards the `StepTracker` (the decoding thread takes it
around every tracker call; the report thread reads the totals under it), the queue of finished
records, the last finished records (for the control path) and two daemon threads, started by
`start(publisher, table)` and living as long as vLLM's worker process:
- the record thread takes each finished record, feeds its tokens to the traffic table (if the
  drafter has one), keeps it among the recent records and hands it to the publisher (if any); a
  record that fails any of it is counted (`records_failed`, logged sparingly) and the thread goes on;
- the report thread sends the tracker's cumulative acceptance report every `report_seconds`.
`finish(record)` only enqueues, so the decoding thread never waits on any of it; publishers
never block either (a bounded buffer). `status()` is this part of the proposer's status: records
queued, delivered to the broker, shed by the publisher's full buffer (and reports shed), or failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Protocol

from specd.core.records import TrajectoryRecord
from specd.drafter.traffic_table import TrafficTable
from specd.serving.vllm.shared.tracking import StepTracker
from specd.transport.bus import BusCounters, RecordSink

log = logging.getLogger(__name__)


class Publisher(RecordSink, Protocol):
    """Where records and acceptance reports leave the worker: specd's MQTT publisher."""

    connected: threading.Event
    counters: BusCounters
    reports_shed: int

    @property
    def backlog(self) -> int: ...

    def report(self, report: dict[str, Any]) -> None: ...


class Telemetry:
    def __init__(self, tracker: StepTracker, report_seconds: float, keep_recent: int = 64) -> None:
        self.tracker = tracker
        self.report_seconds = report_seconds
        self.lock = threading.Lock()   # tracker totals are read by the report thread
        self.publisher: Publisher | None = None
        self.table: TrafficTable | None = None
        self.recent: deque[dict[str, Any]] = deque(maxlen=keep_recent)  # the last finished records, newest last
        self._finished: queue.SimpleQueue[TrajectoryRecord] = queue.SimpleQueue()
        self.records_failed = 0

    def start(self, publisher: Publisher | None, table: TrafficTable | None) -> Telemetry:
        """Start both threads; they feed `table` and send through `publisher` (either may be None)."""
        self.publisher, self.table = publisher, table
        # both live as long as vLLM's worker process (daemon threads, nothing to shut down)
        for target, name in ((self._publish_records, "specd-vllm-records"), (self._report_loop, "specd-vllm-reports")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return self

    def finish(self, record: TrajectoryRecord) -> None:
        """A finished request's record, for the record thread."""
        self._finished.put(record)

    def _publish_records(self) -> None:
        while True:
            record = self._finished.get()
            try:  # one record's fault must not end the thread (records would pile up unsent, uncounted)
                self._publish(record)
            except Exception as error:
                self.records_failed += 1
                if self.records_failed <= 3 or self.records_failed % 1000 == 0:
                    log.error("a finished record could not be published (%d so far)", self.records_failed,
                              exc_info=error)

    def _publish(self, record: TrajectoryRecord) -> None:
        if self.table is not None:  # learned the moment a request ends, off the decoding thread
            self.table.add(record.prompt_ids + record.output_ids)
        payload = record.to_dict()
        self.recent.append(payload)
        if self.publisher is not None:
            self.publisher.publish(payload)  # bounded buffer: never blocks

    def _report_loop(self) -> None:
        while True:
            time.sleep(self.report_seconds)
            if self.publisher is None:
                continue
            with self.lock:
                report = self.tracker.report()
            if report.sources:
                self.publisher.report(report.to_dict())

    def status(self) -> dict[str, Any]:
        """Requests in flight, acceptance totals per version (the learned drafter's own drafts) and per
        drafting source, and where finished records went."""
        with self.lock:
            report = self.tracker.report()
            live_requests = len(self.tracker.live)
        return {"live_requests": live_requests,
                "traffic_table_contexts": len(self.table) if self.table is not None else None,
                "broker_connected": self.publisher.connected.is_set() if self.publisher else None,
                "records_published": self.publisher.counters.published if self.publisher else 0,
                "records_delivered": self.publisher.counters.delivered if self.publisher else 0,
                "records_shed": self.publisher.counters.shed if self.publisher else 0,
                "reports_shed": self.publisher.reports_shed if self.publisher else 0,
                "publisher_backlog": self.publisher.backlog if self.publisher else 0,
                "records_failed": self.records_failed,
                "totals": report.to_dict()["versions"], "totals_by_source": report.to_dict()["sources"]}
