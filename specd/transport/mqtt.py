"""The MQTT transport (aiomqtt): records from servers to the learner, live-version announcements back.

Contract:
- Topics, under a deployment name D: `specd/D/records/<server>` (trajectory records, QoS 1),
  `specd/D/reports/<server>` (acceptance reports, QoS 1), `specd/D/live` (the live version,
  retained, so a server that starts late learns it at once).
- `MqttPublisher` runs its own thread and event loop; `publish()` (the `Bus` interface) only
  appends to a bounded buffer and never blocks a decoding step. Records leave the buffer only
  after the broker acknowledged them (QoS 1 PUBACK); while the broker is down they wait, the
  oldest are shed (and counted) beyond the bound (`capacity` messages or `capacity_bytes`, since
  a record with the target's features is kilobytes a token), and the client reconnects with
  jittered exponential backoff. Records still waiting when `stop` gives up are counted as shed too.
  Every record that leaves carries its sequence number (`sequence.py`), and every report the last
  number given before it, so a learner can count the records a broker dropped. Its `counters`
  count trajectory records only; acceptance reports share the buffer but are cumulative, so a
  shed one (counted in `reports_shed`) is replaced by the next.
- The publisher's thread is supervised: any exception that ends a connection (a broker that is
  down or refuses the credentials, a failed send, a bug) is logged and counted in its
  `health` under the task `mqtt-publisher`, and the thread reconnects with backoff; the record
  being sent stays at the head of the buffer and is sent again. An announcement that its
  callback cannot take is counted under `mqtt-announcements` and skipped.
- `subscribe_forever` (the learner's side) keeps a persistent session (fixed client id,
  clean_session False, QoS 1), so records published while the learner is away are delivered
  when it returns. It acknowledges a message (PUBACK) only after `handle` returned: paho would
  otherwise acknowledge on receipt, before the learner has stored it, and a learner killed in
  between would lose a message the broker no longer holds. When `handle` raises, the message is
  not acknowledged: the failure is counted under `mqtt-subscriber`, the session reconnects and
  the broker delivers the message again, with a backoff that keeps growing until no failure came
  for `BACKOFF_RESET_S`; the same failure again (a full spool) is counted, not logged again. A
  broker keeps one connection per client id and closes the older when another connects with the
  same id: `TAKEN_OVER_DROPS` accepted connections closed within a minute are logged as a
  second learner with this id (give each its own --client-id), not as a broker that is down.
  With `share_group` (data-parallel learner ranks) it speaks MQTT v5 with a session that never
  expires and takes records through the shared subscription `$share/<group>/specd/D/records/+`:
  the broker gives each record to one member of the group, and a member's unacknowledged records
  wait in its session for its return.
  `reports=False` leaves the acceptance reports to another subscriber (rank 0).
- `retire_session` (`retirement.py`) ends the session of a learner that will not run again.
- Username/password and TLS (a CA file, optional client certificate) pass straight through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import aiomqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from specd.core.errors import ConfigurationError, SpecdError
from specd.core.threads import BackgroundHealth, backoff_delay, supervised_thread
from specd.transport.bus import BusCounters
from specd.transport.sequence import SequenceStamp

log = logging.getLogger(__name__)

# names under which the transport's background work reports its failures
PUBLISHER_TASK = "mqtt-publisher"
DEFAULT_CAPACITY_BYTES = 512 * 2**20   # about 1,400 records of 64 tokens with SmolLM2's features
ANNOUNCEMENTS_TASK = "mqtt-announcements"
SUBSCRIBER_TASK = "mqtt-subscriber"


@dataclass(frozen=True)
class MqttSettings:
    host: str = "127.0.0.1"
    port: int = 1883
    deployment: str = "default"
    username: str | None = None
    password: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_url(cls, url: str, deployment: str = "default", **extra: Any) -> MqttSettings:
        """mqtt://[user:password@]host[:port] or mqtts://... (TLS with the system's CAs unless tls_ca)."""
        parsed = urlparse(url)
        if parsed.scheme not in ("mqtt", "mqtts") or not parsed.hostname:
            raise ConfigurationError(f"broker URL {url!r}: expected mqtt://host[:port] or mqtts://host[:port]")
        tls = parsed.scheme == "mqtts"
        return cls(host=parsed.hostname, port=parsed.port or (8883 if tls else 1883), deployment=deployment,
                   username=parsed.username, password=parsed.password,
                   tls_ca=extra.pop("tls_ca", None) or ("system" if tls else None), **extra)

    def topic(self, kind: str, server: str | None = None) -> str:
        return f"specd/{self.deployment}/{kind}" + (f"/{server}" if server else "")

    def client(self, identifier: str | None = None, clean_session: bool | None = None,
               persistent_v5: bool = False, end_v5: bool = False) -> aiomqtt.Client:
        """A client; `persistent_v5`: MQTT v5, resuming a session that never expires (what a
        shared subscription's member needs to find its unacknowledged messages again); `end_v5`:
        MQTT v5 with a clean start and no expiry, which ends such a session when it disconnects."""
        context = None
        if self.tls_ca is not None:
            context = ssl.create_default_context(cafile=None if self.tls_ca == "system" else self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
        if persistent_v5 or end_v5:
            properties = Properties(PacketTypes.CONNECT)
            properties.SessionExpiryInterval = 0 if end_v5 else 0xFFFFFFFF
            return aiomqtt.Client(self.host, self.port, username=self.username, password=self.password,
                                  identifier=identifier, protocol=aiomqtt.ProtocolVersion.V5, clean_start=end_v5,
                                  properties=properties, tls_context=context, timeout=5)
        return aiomqtt.Client(self.host, self.port, username=self.username, password=self.password,
                              identifier=identifier, clean_session=clean_session, tls_context=context,
                              timeout=5)


backoff = backoff_delay  # jittered exponential backoff, shared with every supervised loop
BACKOFF_RESET_S = 30.0   # the subscriber's backoff starts anew only after this long without a failure
TAKEN_OVER_DROPS, TAKEN_OVER_WINDOW_S = 3, 60.0   # drops after connecting that point to a second client


class _Drops:
    """Connections the broker closed after it had accepted them (see the contract)."""

    def __init__(self, client_id: str) -> None:
        self.client_id, self.times, self.said_at = client_id, deque[float](maxlen=TAKEN_OVER_DROPS), -1e9

    def dropped(self, error: Exception) -> None:
        now = time.monotonic()
        self.times.append(now)
        if len(self.times) < TAKEN_OVER_DROPS or now - self.times[0] > TAKEN_OVER_WINDOW_S:
            log.warning("MQTT connection to the broker lost (%s); reconnecting", error)
        elif now - self.said_at > 10 * TAKEN_OVER_WINDOW_S:
            self.said_at = now
            log.warning("the broker closed this learner's connection %d times in %.0f s after accepting it: another "
                        "client is connected with the same client id %r (a second learner on this broker?); the "
                        "broker keeps one connection per id, so give each learner its own --client-id",
                        len(self.times), now - self.times[0], self.client_id)


@dataclass(eq=False)
class _Waiting:
    """A message in the publisher's buffer; a record gets its sequence number as it first leaves."""

    topic: str
    payload: bytes
    is_record: bool
    numbered: bool = False


class MqttPublisher:
    """A never-blocking `Bus` whose records (and reports) reach the broker from a background thread."""

    def __init__(self, settings: MqttSettings, server_id: str, capacity: int = 10_000,
                 on_announcement: Callable[[dict[str, Any]], None] | None = None,
                 health: BackgroundHealth | None = None, capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        self.settings = settings
        self.server_id = server_id
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.pending_bytes = 0
        self.sequence = SequenceStamp()
        self.on_announcement = on_announcement
        self.counters = BusCounters()
        self.connected = threading.Event()
        self._pending: deque[_Waiting] = deque()
        self.reports_shed = 0
        self.health = health or BackgroundHealth()
        self.health.register(PUBLISHER_TASK)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # ---- the Bus interface ----------------------------------------------------------------
    def publish(self, record: dict[str, Any]) -> None:
        self._enqueue(self.settings.topic("records", self.server_id), record, is_record=True)

    def report(self, report: dict[str, Any]) -> None:
        self._enqueue(self.settings.topic("reports", self.server_id), report, is_record=False)

    def _enqueue(self, topic: str, payload: dict[str, Any], is_record: bool) -> None:
        # `counters` count records only: reports are cumulative, and a lost one is replaced by the next
        encoded = json.dumps(payload).encode()
        with self._lock:
            # the newest message is always kept (one over `capacity_bytes` alone too): it is the freshest signal
            while self._pending and (len(self._pending) >= self.capacity
                                     or self.pending_bytes + len(encoded) > self.capacity_bytes):
                self._shed_head()
            self._pending.append(_Waiting(topic, encoded, is_record))
            self.pending_bytes += len(encoded)
            self.counters.published += is_record
        self._wake_loop()

    def _shed_head(self) -> None:
        """Drop the oldest waiting message and count it (the caller holds the lock). Not a head that
        already took its number (it was being sent when the broker went away, and may have reached
        it): shed there and missing at the learner, it would be counted twice; the next one goes."""
        at = 1 if len(self._pending) > 1 and self._pending[0].numbered else 0
        shed = self._pending[at]
        del self._pending[at]
        self.pending_bytes -= len(shed.payload)
        if shed.is_record:
            self.counters.shed += 1
        else:
            self.reports_shed += 1

    def _wake_loop(self) -> None:
        """Wake the sending loop. Its loop may have just closed (stopped, or between two runs of
        the supervised thread): the record waits in the buffer for the next loop, and the caller
        (the decoding thread) never sees an error."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(wake.set)

    @property
    def backlog(self) -> int:
        return len(self._pending)

    # ---- the thread -----------------------------------------------------------------------
    def start(self) -> MqttPublisher:
        # `_main` survives its own failures; the supervisor restarts the thread's body if even that fails
        self._thread = supervised_thread("specd-mqtt", lambda: asyncio.run(self._main()), self.health, self._stop)
        self._thread.start()
        return self

    def stop(self, drain_seconds: float = 2.0) -> None:
        """Give queued records up to `drain_seconds` to leave (if connected), then stop."""
        deadline = time.monotonic() + drain_seconds
        while self.connected.is_set() and self._pending and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._wake_loop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            records_left = sum(waiting.is_record for waiting in self._pending)
            while self._pending:
                self._shed_head()
        if records_left:
            log.warning("%d records never reached the broker before the server stopped; counted as shed",
                        records_left)

    async def _main(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        attempt = 0
        while not self._stop.is_set():
            try:
                async with self.settings.client() as client:
                    if attempt:  # said, as the loss was
                        log.warning("MQTT broker reachable again; %d records waiting", len(self._pending))
                    attempt = 0
                    self.connected.set()
                    await client.subscribe(self.settings.topic("live"), qos=1)
                    await _first_of(self._drain(client), self._listen(client))
            except aiomqtt.MqttError as error:
                log.warning("MQTT broker unreachable (%s); %d records waiting", error, len(self._pending))
                self.health.failed(PUBLISHER_TASK, error)
            except Exception as error:  # a failed send or a bug: reconnect and send the head again
                log.exception("MQTT publisher failed; %d records waiting", len(self._pending))
                self.health.failed(PUBLISHER_TASK, error)
            self.connected.clear()
            if not self._stop.is_set():
                await asyncio.sleep(backoff(attempt))
                attempt += 1

    async def _drain(self, client: aiomqtt.Client) -> None:
        assert self._wake is not None
        while not self._stop.is_set():
            with self._lock:
                head = self._pending[0] if self._pending else None
                if head is not None and not head.numbered:
                    # numbered as it first leaves (a resend keeps its number): one shed here is not a gap;
                    # a report carries the last number given, every record before it acknowledged
                    mark = self.sequence.stamp_json if head.is_record else self.sequence.mark_json
                    numbered = mark(head.payload)
                    self.pending_bytes += len(numbered) - len(head.payload)
                    head.payload, head.numbered = numbered, True
            if head is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await client.publish(head.topic, head.payload, qos=1)  # returns once the broker acknowledged it
            with self._lock:
                if self._pending and self._pending[0] is head:
                    self._pending.popleft()
                    self.pending_bytes -= len(head.payload)
                    self.counters.delivered += head.is_record

    async def _listen(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            if self.on_announcement is None:
                continue
            try:
                self.on_announcement(json.loads(bytes(message.payload)))
            except Exception as error:  # one bad announcement must not stop the next ones
                log.warning("ignored an announcement that could not be taken: %s", error)
                self.health.failed(ANNOUNCEMENTS_TASK, error)


async def _first_of(*bodies: Awaitable[None]) -> None:
    """Run the bodies together until the first ends; cancel the rest and raise what it raised."""
    tasks = [asyncio.ensure_future(body) for body in bodies]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # the others' errors, if any, are moot
    for task in done:
        task.result()


async def subscribe_forever(settings: MqttSettings, client_id: str,
                            handle: Callable[[str, bytes], Awaitable[None]], stop: asyncio.Event,
                            health: BackgroundHealth | None = None, share_group: str | None = None,
                            reports: bool = True) -> None:
    """The learner's side: a persistent QoS 1 session on records and reports, reconnecting forever;
    a message is acknowledged only once `handle` has returned. `share_group`: records through
    that shared subscription (one member of the group gets each)."""
    health = health or BackgroundHealth()
    health.register(SUBSCRIBER_TASK)
    attempt, drops, unreachable = 0, _Drops(client_id), False
    failed_at, said = -BACKOFF_RESET_S, ""   # the last failure: when, and what was logged of it
    while not stop.is_set():
        connected = False
        try:
            client = settings.client(identifier=client_id, clean_session=False,
                                     persistent_v5=share_group is not None)
            # aiomqtt has no ack API; its paho client does (paho >= 2.0): PUBACK only after `handle`
            client._client.manual_ack_set(True)
            records = settings.topic("records") + "/+"
            async with client:
                connected = True
                if unreachable:  # said, as the loss was
                    log.warning("MQTT broker reachable again; subscribing")
                    unreachable = False
                await client.subscribe(records if share_group is None else f"$share/{share_group}/{records}", qos=1)
                if reports:
                    await client.subscribe(settings.topic("reports") + "/+", qos=1)
                async for message in client.messages:
                    await handle(str(message.topic), bytes(message.payload))
                    client._client.ack(message.mid, message.qos)
                    # reset only once messages went through for a while: a message whose handling
                    # fails each time it comes back must meet a growing backoff, even while others
                    # (reports) go through between its returns
                    if time.monotonic() - failed_at > BACKOFF_RESET_S:
                        attempt, said = 0, ""
        except aiomqtt.MqttError as error:
            if connected:
                drops.dropped(error)
            else:
                log.warning("MQTT broker unreachable (%s); retrying", error)
            unreachable = True
            health.failed(SUBSCRIBER_TASK, error)
        except Exception as error:  # `handle` failed: the message stays unacknowledged and comes again
            health.failed(SUBSCRIBER_TASK, error)
            failed_at = time.monotonic()
            if str(error) == said:  # the same failure again (a full spool): counted, not logged again
                log.debug("MQTT subscriber failed again: %s", error)
            elif isinstance(error, SpecdError):  # a condition with its own words: no traceback
                log.warning("MQTT subscriber cannot take a message (it comes again): %s", error)
            else:
                log.exception("MQTT subscriber failed; reconnecting")
            said = str(error)
        if not stop.is_set():
            await asyncio.sleep(backoff(attempt))
            attempt += 1


async def announce(settings: MqttSettings, payload: dict[str, Any]) -> None:
    """Publish the live version as a retained message (one short connection)."""
    async with settings.client() as client:
        await client.publish(settings.topic("live"), json.dumps(payload).encode(), qos=1, retain=True)
