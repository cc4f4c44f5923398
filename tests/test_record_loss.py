"""Records lost on the way are counted, never silent: the learner counts the numbers a server gave
its records that never arrived (a broker that dropped them for an absent learner), and a server's
buffer sheds by bytes as well as by count, counting what is still waiting when it stops."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import sqlite3
import threading
import time

import pytest
from prometheus_client import generate_latest

from specd.transport.sequence import SEQUENCE_FIELD, SequenceGaps, SequenceStamp


def valid_record(i: int) -> dict:
    """A record the learner on the tiny target takes."""
    from specd.core.records import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "record_id": f"r{i}", "server_id": "s", "prompt_ids": [1, 2, 3],
            "output_ids": [4, 5, 6, 7], "steps": [], "temperature": 0.0, "top_p": 1.0, "created": 1.0,
            "finished": 2.0}


def stamped(server: str, run: str, n: int) -> dict:
    return {"server_id": server, SEQUENCE_FIELD: {"run": run, "n": n}}


def test_a_publishers_stamps_number_its_records_in_order_under_one_run() -> None:
    stamp = SequenceStamp()
    first = json.loads(stamp.stamp_json(json.dumps({"record_id": "a", "n": [1, 2]}).encode()))
    second = json.loads(stamp.stamp_json(b"{}"))
    assert first == {SEQUENCE_FIELD: {"run": stamp.run, "n": 1}, "record_id": "a", "n": [1, 2]}
    assert second == {SEQUENCE_FIELD: {"run": stamp.run, "n": 2}}
    assert SequenceStamp().run != stamp.run   # a restarted server starts a run of its own
    with pytest.raises(ValueError):
        stamp.stamp_json(b"[1, 2]")


def test_records_are_numbered_as_they_leave_and_a_resent_one_keeps_its_number() -> None:
    """A record the server shed before sending is counted there and takes no number: no gap here."""
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    publisher = MqttPublisher(MqttSettings(port=1), "server-a", capacity=2)   # never started: sent by hand below
    for i in range(5):
        publisher.publish({"record_id": f"r{i}"})   # r0-r2 shed by the full buffer, counted there
    sent: list[dict] = []

    class Broker:   # stands for the connection: the first send fails, as a dropped connection does
        failed = False

        async def publish(self, topic: str, payload: bytes, qos: int) -> None:
            if not Broker.failed:
                Broker.failed = True
                raise OSError("connection lost")
            sent.append(json.loads(payload))
            if len(sent) == 2:
                publisher._stop.set()

    async def drain() -> None:
        publisher._wake = asyncio.Event()
        with pytest.raises(OSError):
            await publisher._drain(Broker())
        await publisher._drain(Broker())   # the reconnected loop sends the head again

    asyncio.run(drain())
    assert [(r["record_id"], r[SEQUENCE_FIELD]["n"]) for r in sent] == [("r3", 1), ("r4", 2)]
    assert publisher.counters.shed == 3 and publisher.counters.delivered == 2 and publisher.pending_bytes == 0


def test_gaps_between_received_numbers_are_counted_per_server_and_run() -> None:
    gaps = SequenceGaps()
    for n in (1, 2, 5, 3):            # 4 never came; order does not matter
        gaps.note(stamped("a", "run1", n))
    for n in (7, 10):                 # a run first heard of at 7: 8 and 9 missing, nothing before 7 counted
        gaps.note(stamped("b", "run2", n))
    gaps.note(stamped("a", "run3", 1))  # the same server restarted
    gaps.note({"server_id": "a"})       # unstamped (the in-process bus, an older server): not counted
    gaps.note({"server_id": "a", SEQUENCE_FIELD: {"run": "run1", "n": "9"}})   # garbled: says nothing
    assert gaps.missing == 3 and gaps.by_server() == {"a": 1, "b": 2}


def test_a_report_counts_the_records_its_run_sent_after_the_last_one_received() -> None:
    gaps = SequenceGaps()
    for n in (3, 4):
        gaps.note(stamped("a", "run1", n))
    gaps.note_sent({"server_id": "a", SEQUENCE_FIELD: {"run": "run1", "sent": 7}})   # 5-7 never came
    gaps.note_sent({"server_id": "a", SEQUENCE_FIELD: {"run": "run1", "sent": 6}})   # an older report
    gaps.note_sent({"server_id": "b", SEQUENCE_FIELD: {"run": "run2", "sent": 9}})   # a run no record came from
    gaps.note_sent({"server_id": "a", SEQUENCE_FIELD: {"run": "run1", "sent": "99"}})  # garbled: says nothing
    gaps.note_sent({"server_id": "a"})
    assert gaps.missing == 3 and gaps.by_server() == {"a": 3}
    gaps.note(stamped("a", "run1", 6))   # one counted missing that arrives after all: no longer missing
    assert gaps.missing == 2


def test_a_publishers_report_carries_the_last_number_sent_before_it() -> None:
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    publisher = MqttPublisher(MqttSettings(port=1), "server-a")   # never started: sent by hand below
    publisher.report({"server_id": "server-a", "versions": {}})
    for i in range(3):
        publisher.publish({"record_id": f"r{i}"})
    publisher.report({"server_id": "server-a", "versions": {}})
    sent: list[dict] = []

    class Broker:
        async def publish(self, topic: str, payload: bytes, qos: int) -> None:
            sent.append(json.loads(payload))
            if len(sent) == 5:
                publisher._stop.set()

    async def drain() -> None:
        publisher._wake = asyncio.Event()
        await publisher._drain(Broker())

    asyncio.run(drain())
    run = publisher.sequence.run
    assert [m[SEQUENCE_FIELD] for m in sent] == [{"run": run, "sent": 0}, {"run": run, "n": 1}, {"run": run, "n": 2},
                                                 {"run": run, "n": 3}, {"run": run, "sent": 3}]
    assert sent[-1]["versions"] == {} and publisher.counters.delivered == 3


def test_a_record_being_sent_when_the_buffer_overflows_keeps_its_place_and_the_next_one_is_shed() -> None:
    """The head took its number as it left and may have reached the broker: shedding it would count
    it twice (shed here, missing at the learner)."""
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    publisher = MqttPublisher(MqttSettings(port=1), "s", capacity=2)   # never started
    publisher.publish({"record_id": "r0"})
    head = publisher._pending[0]   # numbered as the sending loop numbers the head it sends
    numbered = publisher.sequence.stamp_json(head.payload)
    publisher.pending_bytes += len(numbered) - len(head.payload)
    head.payload, head.numbered = numbered, True
    publisher.publish({"record_id": "r1"})
    publisher.publish({"record_id": "r2"})   # over the bound: r1 goes, not r0
    assert [json.loads(w.payload)["record_id"] for w in publisher._pending] == ["r0", "r2"]
    assert publisher.counters.shed == 1 and publisher.pending_bytes == sum(len(w.payload) for w in publisher._pending)


def test_gaps_of_runs_dropped_from_the_bounded_table_still_count() -> None:
    gaps = SequenceGaps(max_runs=2)
    gaps.note(stamped("a", "old", 1))
    gaps.note(stamped("a", "old", 4))
    for run in ("r1", "r2", "r3"):
        gaps.note(stamped("b", run, 1))
    assert gaps.missing == 2 and gaps.by_server() == {}


def test_the_sidecar_reports_records_that_never_arrived_in_its_status_and_metrics(tmp_path) -> None:
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store")), tiny_loaded_target())
    stamp = SequenceStamp()
    messages = [json.loads(stamp.stamp_json(json.dumps(valid_record(i)).encode())) for i in range(6)]
    refused = {**messages[1], "output_ids": [10**9]}          # arrived, though refused: not missing
    deliveries = [messages[0], refused, messages[2], messages[2], messages[5]]   # 3 and 4 lost; 2 twice

    async def deliver() -> None:
        for message in deliveries:
            await sidecar.handle("specd/default/records/s", json.dumps(message).encode())

    asyncio.run(deliver())
    status = sidecar.status()
    assert status["records_missing"] == 2 and status["records_missing_by_server"] == {"s": 2}
    assert status["records_duplicate"] == 1 and status["records_refused"] == 1
    assert "specd_learner_records_missing 2.0" in generate_latest(sidecar.registry).decode()


def test_a_server_buffer_sheds_its_oldest_records_beyond_its_byte_bound_and_counts_them() -> None:
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    publisher = MqttPublisher(MqttSettings(port=1), "server-a", capacity_bytes=3000)  # never started: no broker
    for i in range(10):
        publisher.publish({"record_id": f"r{i}", "pad": "x" * 900})
    assert publisher.backlog == 3 and publisher.pending_bytes <= 3000
    assert publisher.counters.published == 10 and publisher.counters.shed == 7
    publisher.publish({"record_id": "big", "pad": "x" * 5000})   # over the bound alone: still kept, the freshest
    assert publisher.backlog == 1 and publisher.counters.shed == 10


def test_records_still_waiting_when_a_server_stops_are_counted_as_shed() -> None:
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    publisher = MqttPublisher(MqttSettings(port=1), "server-a").start()   # nothing listens on port 1
    for i in range(4):
        publisher.publish({"record_id": f"r{i}"})
    publisher.report({"server_id": "server-a"})
    publisher.stop(drain_seconds=0.2)
    assert publisher.counters.shed == 4 and publisher.reports_shed == 1
    assert publisher.backlog == 0 and publisher.pending_bytes == 0


@pytest.mark.mqtt
@pytest.mark.parametrize("then", ["record", "report"])
def test_records_a_broker_dropped_for_an_absent_learner_are_counted_when_it_returns(tmp_path, then) -> None:
    """Mosquitto queues at most `max_queued_messages` for a disconnected persistent session and
    drops the rest; the learner that comes back counts exactly the ones it never got, once the
    server's next record or its next acceptance report arrives."""
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target
    from specd.testing.processes import Broker
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    broker = Broker(tmp_path / "broker", max_queued_messages=4).start()
    settings = MqttSettings.from_url(broker.url, deployment="loss")
    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store"), mqtt=settings, client_id="loss-learner"),
                      tiny_loaded_target())
    publisher = MqttPublisher(settings, "s").start()

    def wait_until(condition, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert condition(), what

    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()

    def run_subscriber() -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(sidecar.subscriber(asyncio.Event()), loop)

    def end(subscriber: concurrent.futures.Future) -> None:
        subscriber.cancel()   # the task's connection closes as the cancellation unwinds it
        wait_until(lambda: subscriber.done(), 10, "the subscriber did not stop")
        time.sleep(0.5)

    try:
        running = run_subscriber()
        sent = 0

        def send() -> None:
            nonlocal sent
            publisher.publish(valid_record(sent))
            sent += 1

        # the session exists once a record got through (the first may precede the subscription)
        wait_until(lambda: (send(), time.sleep(0.3), sidecar.spool.records_in > 0)[2], 30, "no record arrived")
        end(running)                                  # the learner goes away; its session stays
        for _ in range(12):
            send()
        wait_until(lambda: publisher.backlog == 0, 20, "the broker never took the records")
        before = sidecar.spool.records_in
        running = run_subscriber()                     # the learner returns: the broker hands it its queue
        wait_until(lambda: sidecar.spool.records_in == before + 4, 30, "the queued records never came")
        if then == "record":                           # and the session is live again
            send()
            wait_until(lambda: f"r{sent - 1}" in _spooled_ids(sidecar), 30, "the last record never came")
        else:                                          # no more records: the report says what was sent
            publisher.report({"server_id": "s", "versions": {}})
            wait_until(lambda: sidecar.status()["records_missing"] > 0, 30, "the report never came")
        end(running)
        numbers = sorted(int(i[1:]) for i in _spooled_ids(sidecar))
        status = sidecar.status()
        assert status["records_missing"] == 12 - 4      # the broker kept 4 of the 12 sent while it was away
        assert status["records_missing"] == sent - 1 - numbers[0] + 1 - len(numbers)
    finally:
        publisher.stop(drain_seconds=0)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        sidecar.spool.close()
        sidecar.claim.release()
        broker.stop()


def _spooled_ids(sidecar) -> list[str]:
    """The record ids in the sidecar's spool, read beside it (the spool's own `load` reopens it)."""
    with contextlib.closing(sqlite3.connect(sidecar.spool.path)) as db:
        return [json.loads(body)["record_id"] for (body,) in db.execute("SELECT body FROM records")]
