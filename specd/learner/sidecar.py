"""`specd learner`: the learner as a sidecar process beside one or many servers, over MQTT.

Contract: the sidecar subscribes to every server's records and reports with a persistent QoS 1
session, validates each record as the learner's intake would (a refused one is counted by reason,
never spooled), stores each new valid record in its spool (`spool.py`) before training on it and
before the broker's message is acknowledged (so neither a restarted learner nor a killed one loses a record
the broker gave up; recent duplicates from QoS 1 redelivery are dropped by record id), trains
and publishes versions to its weight store, announces the live version as a retained MQTT
message whenever it changes (a publish, an operator's control operation, a canary rollback) and
every `REANNOUNCE_S` besides (a garbled retained message must not hide it from servers started
later), refuses and counts any message it cannot use without raising (an unacknowledged message
would come back at every reconnect), counts the records each server numbered that never arrived
(`records_missing`: a broker that dropped them for an absent learner; not with ranks),
and serves the control plane and dashboard over HTTP (127.0.0.1 by default; POSTs need the
bearer token when one is set). Reports feed the acceptance log that the dashboard shows; the
learner's canary (`specd.learner.shadow`) replays the live version and its predecessor on the
same records and rolls a regression back with the evidence.
The spool (SQLite) and the duplicate filter are bounded (`SpoolConfig`) and streamed back at a
restart; `records_in` in `/v1/status` counts unique valid records ever received, across restarts
and compaction.
The subscriber and the announcer are supervised: a failure is logged, counted under
`background` in `/v1/status` (with the learner loop's own failure count) and the loop restarts.
`/v1/status` breaks the learner's memory down by part (`memory.py`).
With data-parallel ranks (`specd learner --ranks N`, under torchrun; `specd.learner.ranks`) every
rank is a sidecar of its own: its spool under `<store>/rank-N/`, its own MQTT session
(`<client id>-rankN`) in the shared subscription `$share/<client id>/...` for records. Rank 0
alone takes the reports, announces, and serves HTTP; its `/v1/status` lists every rank's status.
Rank 0 also holds the store's own claim, so a plain learner and a group never run on one store; a
plain learner, or rank 0, takes over the spools and MQTT sessions of learners that will not run on
the store again (a group with fewer ranks, ranks after a plain learner: `takeover.py`). `/metrics` exposes the
learner's counters and lag, the store's live version and rollbacks (`collector.py`) and the
background failures. `POST /v1/live` of a candidate version goes through the learner's gate first
(`Learner.submit`), judged on a worker of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from specd.control.acceptance import AcceptanceLog
from specd.control.plane import ControlPlane, add_control_routes, control_app
from specd.core.background_metrics import BackgroundCollector
from specd.core.errors import BadRequest, RecordRefused, RefusalReason
from specd.core.http_requests import json_object
from specd.core.threads import BackgroundHealth, backoff_delay, supervise
from specd.drafter.factory import DrafterSpec, initial_model
from specd.hotswap.store import WeightStore
from specd.learner.claim import claim
from specd.learner.collector import LearnerCollector
from specd.learner.config import LearnerConfig
from specd.learner.intake import note_refusal
from specd.learner.learner import Learner
from specd.learner.memory import memory_breakdown
from specd.learner.ranks import RANK_STATUS_S, RankGroup, group_status, read_statuses
from specd.learner.spool import SPOOL_INDEX, RecordSpool, SpoolConfig
from specd.learner.takeover import LeftBehind, left_behind, mark_session, session_of
from specd.model.target import LoadedTarget
from specd.transport.bus import InProcessBus
from specd.transport.mqtt import MqttSettings, announce, subscribe_forever
from specd.transport.sequence import SequenceGaps

log = logging.getLogger(__name__)

REANNOUNCE_S = 30.0   # the live version is announced (retained) again this often, even unchanged
SUBSCRIBER_LOOP = "subscriber-loop"   # subscribe_forever counts its own failures as "mqtt-subscriber"
ANNOUNCER_TASK = "announcer"


@dataclass(frozen=True)
class SidecarOptions:
    store: str
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    public_url: str = "http://127.0.0.1:8100"
    token: str | None = None
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    client_id: str = "specd-learner"
    drafter: DrafterSpec = field(default_factory=DrafterSpec)   # the day-0 drafter's shape
    spool: SpoolConfig = field(default_factory=SpoolConfig)


class Sidecar:
    def __init__(self, options: SidecarOptions, loaded: LoadedTarget, group: RankGroup | None = None) -> None:
        self.options = options
        self.group = group
        self.store = WeightStore(options.store)
        self.bus = InProcessBus(capacity=100_000)
        self.acceptance = AcceptanceLog()
        self.health = BackgroundHealth()
        self.refused_messages: Counter = Counter()   # messages refused before they reached the learner, by reason
        # a rank receives only part of each server's numbers (the shared subscription): its gaps are not losses
        self.gaps = SequenceGaps() if group is None else None
        embedding = loaded.model.embed.weight
        initial = initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint)
        self.learner = Learner(options.learner, self.bus, self.store, initial, loaded.fingerprint, embedding.dtype,
                               embedding, target=loaded.model, group=group)
        spool_folder = Path(options.store) / (f"rank-{group.info.rank}" if group is not None else "")
        self.claim = claim(spool_folder, "stop it, or give this learner another --store")
        # rank 0 holds the store as a lone learner does: a plain learner and a group never share one
        self.store_claim = (claim(options.store, "stop it, or give this learner another --store")
                            if group is not None and group.is_root else None)
        session = self._session_id()
        mark_session(spool_folder, session[0], session[1])
        self.spool = RecordSpool(spool_folder, options.spool, self._records_of_use)
        for record in self.spool.load():  # what the learner had received, for its buffers again
            self.bus.publish(record)
        self.left_behind = self._take_over() if group is None or group.is_root else None
        self._announced: int | None = None
        self._announced_at = -REANNOUNCE_S
        self._changed = asyncio.Event()
        self.plane = ControlPlane(self.store, self.acceptance, options.token, self.status, self._changed.set,
                                  submit=self.learner.submit, fingerprint=loaded.fingerprint,
                                  target_embedding=embedding)
        self.registry = CollectorRegistry()  # the learner's /metrics: its counters, lag and background failures
        gaps = self.gaps
        self.registry.register(LearnerCollector(self.learner, self.store, lambda: dict(self.refused_messages),
                                                missing=None if gaps is None else lambda: gaps.missing,
                                                ranks=None if group is None else lambda: read_statuses(options.store)))
        self.registry.register(BackgroundCollector(self.health))

    def _session_id(self) -> tuple[str, str | None]:
        """(MQTT client id, shared group) of this learner's session."""
        return session_of(self.options.client_id, None if self.group is None else self.group.info.rank)

    def _take_over(self) -> LeftBehind:
        """The spools of learners that will not run on this store again, into this one's (`takeover.py`)."""
        store = Path(self.options.store)
        left = LeftBehind(store, self.options.spool, self._records_of_use)
        for folder in left_behind(store, None if self.group is None else self.group.info.world_size):
            for record in left.take(folder, self.options.client_id, self.store_claim):
                if self.spool.add(record):
                    self.bus.publish({**record, SPOOL_INDEX: self.spool.records_in})
        return left

    def release(self) -> None:
        """Give up this learner's claims on its folders (as a stopped process does)."""
        if self.left_behind is not None:
            self.left_behind.release()
        for held in (self.claim, self.store_claim):
            if held is not None:
                held.release()

    def _records_of_use(self) -> int:
        """Records a restarted learner can still use: its buffers' capacity (the held-out set fills
        from one record in `holdout_every`) and whatever still waits on the bus."""
        config = self.options.learner
        buffer = self.learner.buffer.maxlen or config.buffer_capacity
        return int(buffer + config.holdout_capacity * config.holdout_every + self.bus.backlog)

    def status(self) -> dict[str, object]:
        stats = self.learner.stats
        staleness = self.learner.staleness
        spool = self.spool
        return {"records_in": spool.records_in, "records_waiting": self.bus.backlog,
                "records_refused": sum(stats.refused.values()) + sum(self.refused_messages.values()),
                "records_refused_by_reason": dict(stats.refused + self.refused_messages),
                "records_duplicate": spool.duplicates,
                **self._missing(),
                "spool": {"records": spool.num_records, "bytes": spool.num_bytes, "compactions": spool.compactions,
                          "dropped_for_space": spool.dropped_for_space},
                "learner_steps": stats.steps, "tokens_trained": stats.tokens_trained,
                "mean_record_age_s": staleness.get("mean_record_age_s"),
                "published": len(stats.published), "rejected": len(stats.rejected),
                "learner_loop_failures": stats.loop_failures,
                "learner_last_failure": _plain(stats.last_failure),
                "learner": self.learner.health(),
                "memory": memory_breakdown(self.learner, self.bus.backlog),
                "background": self.health.snapshot(),
                "failing": self.health.failing(),  # background tasks that failed in the last minute
                **(group_status(self.options.store) if self.group is not None else {})}

    def _note_sequence(self, message: dict[str, object], report: bool = False) -> None:
        if self.gaps is not None:
            (self.gaps.note_sent if report else self.gaps.note)(message)

    def _missing(self) -> dict[str, object]:
        """Records the servers numbered that never arrived (`sequence.py`); a rank cannot tell."""
        if self.gaps is None:
            return {}
        return {"records_missing": self.gaps.missing, "records_missing_by_server": self.gaps.by_server()}

    def subscriber(self, stop: asyncio.Event) -> Awaitable[None]:
        """The records (and, alone or on rank 0, the reports) subscription, supervised by the caller."""
        return self._subscribe(stop)

    async def _subscribe(self, stop: asyncio.Event) -> None:
        # first the sessions of learners that will not run again: before this learner's own records,
        # so that nothing else adds to the spool meanwhile (its compaction runs on another thread)
        if self.left_behind is not None and self.left_behind.taken:
            await self.left_behind.end_sessions(self.options.mqtt, self.handle)
        client_id, share_group = self._session_id()
        await subscribe_forever(self.options.mqtt, client_id, self.handle, stop, self.health,
                                share_group=share_group, reports=self.group is None or self.group.is_root)

    async def handle(self, topic: str, payload: bytes) -> None:
        # whatever a message holds, it is refused and counted here, never raised: a message that
        # raised would go unacknowledged, and the broker would send it again after every reconnect
        try:
            message = json_object(payload)
        except BadRequest as error:
            note_refusal(self.refused_messages, str(RefusalReason.NOT_AN_OBJECT),
                         f"a malformed message on {topic}: {str(error)[:200]}")
            return
        if "/reports/" in topic:
            self._note_sequence(message, report=True)  # the records its server had sent by then
            try:
                self.acceptance.add(message)
            except Exception as error:  # RecordRefused, or what validation did not foresee
                note_refusal(self.refused_messages, str(RefusalReason.REPORT),
                             f"a malformed report: {type(error).__name__}: {str(error)[:200]}")
            return
        try:  # before the spool: a record the learner would refuse must not take a good one's place there
            await asyncio.to_thread(self.learner.check_record, message)
        except RecordRefused as error:
            self._note_sequence(message)  # it arrived: no gap in its server's numbers
            note_refusal(self.refused_messages, str(error.reason), f"a record on {topic}: {error}")
            return
        if not self.spool.add(message):
            return  # QoS 1 may deliver twice
        self._note_sequence(message)
        self.bus.publish({**message, SPOOL_INDEX: self.spool.records_in})  # its number, as `load` gives it
        if self.spool.needs_compaction():
            # off the event loop; the subscriber awaits it, so nothing appends meanwhile
            await asyncio.to_thread(self.spool.compact)

    async def announcer(self, stop: asyncio.Event) -> None:
        failures = 0  # in a row: while the broker is down, tries back off and only the first is a warning
        while not stop.is_set():
            live = self.store.live_version()
            # again every REANNOUNCE_S even when unchanged: the retained message is what a server
            # starting later reads first, and something else may have been retained over it
            due = time.monotonic() - self._announced_at >= REANNOUNCE_S
            if live is not None and (live != self._announced or due):
                try:
                    await announce(self.options.mqtt, {"version": live, "url": self.options.public_url,
                                                       "time": time.time()})
                    if failures:
                        log.warning("announced version %s after %d failed tries", live, failures)
                    self._announced, self._announced_at, failures = live, time.monotonic(), 0
                except Exception as error:  # the broker may be down: try again, later each time
                    failures += 1
                    log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                            "could not announce version %s (retrying with backoff): %s", live, error)
                    self.health.failed(ANNOUNCER_TASK, error)
            self._changed.clear()
            # wake on a change or a stop, else poll twice a second (after a failure: back off)
            waits = [asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waits, timeout=backoff_delay(failures) if failures else 0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()


def _plain(value: object) -> object:
    """A value that JSON can carry: an error (or anything unusual) as its text."""
    return value if value is None or isinstance(value, str | int | float | dict | list) else str(value)


async def report_rank_status(sidecar: Sidecar, stop: asyncio.Event) -> None:
    """A rank's status file every RANK_STATUS_S, with what it has received: also while it waits."""
    assert sidecar.group is not None
    while not stop.is_set():
        stats = sidecar.learner.stats
        sidecar.group.report(records_in=sidecar.spool.records_in, records_waiting=sidecar.bus.backlog,
                             steps=stats.steps, tokens_trained=stats.tokens_trained)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RANK_STATUS_S)


def build_sidecar(options: SidecarOptions, loaded: LoadedTarget, group: RankGroup | None = None) -> web.Application:
    sidecar = Sidecar(options, loaded, group)
    app = control_app()
    add_control_routes(app, sidecar.plane)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **sidecar.status()})

    app.router.add_get("/health", health)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(sidecar.registry), content_type="text/plain", charset="utf-8")

    app.router.add_get("/metrics", metrics)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        health = sidecar.health
        tasks = [asyncio.create_task(supervise(SUBSCRIBER_LOOP, lambda: sidecar.subscriber(stop), health, stop),
                                     name="specd-subscriber"),
                 asyncio.create_task(supervise(ANNOUNCER_TASK, lambda: sidecar.announcer(stop), health, stop),
                                     name="specd-announcer")]
        if sidecar.group is not None:
            tasks.append(asyncio.create_task(report_rank_status(sidecar, stop), name="specd-rank-status"))
        sidecar.learner.start()
        yield
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # no append may race the spool's close
        sidecar.learner.stop()
        sidecar.spool.close()
        sidecar.release()

    app.cleanup_ctx.append(lifecycle)
    return app


async def run_rank(options: SidecarOptions, loaded: LoadedTarget, group: RankGroup) -> None:
    """A rank other than 0: its records, its spool and its share of training, no HTTP, until SIGTERM."""
    import signal

    sidecar = Sidecar(options, loaded, group)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    subscriber = asyncio.create_task(supervise(SUBSCRIBER_LOOP, lambda: sidecar.subscriber(stop), sidecar.health,
                                               stop), name="specd-subscriber")
    reporter = asyncio.create_task(report_rank_status(sidecar, stop), name="specd-rank-status")
    sidecar.learner.start()
    await stop.wait()
    subscriber.cancel()
    await asyncio.gather(subscriber, reporter, return_exceptions=True)
    sidecar.learner.stop()
    sidecar.spool.close()
    sidecar.release()
