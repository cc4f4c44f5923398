"""Nothing grows without bound: the learner sidecar's spool and duplicate filter (bounded, compacted,
crash-safe, counting every unique record across restarts), its acknowledgement of a message only
after the record is stored, and the server's per-version metric labels (bounded, scrapable while the
engine thread writes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from specd.learner.spool import RecordSpool, SpoolConfig
from specd.serving.http.metrics import ServingMetrics


def record(i: int, size: int = 0) -> dict:
    return {"record_id": f"r{i}", "server_id": "s", "pad": "x" * size}


def valid_record(i: int) -> dict:
    """A record any learner on the tiny target takes: ids inside its vocabulary, long enough to train on."""
    from specd.core.records import SCHEMA_VERSION

    return {"schema_version": SCHEMA_VERSION, "record_id": f"r{i}", "server_id": "s", "prompt_ids": [1, 2, 3],
            "output_ids": [4, 5, 6, 7], "steps": [], "temperature": 0.0, "top_p": 1.0, "created": 1.0,
            "finished": 2.0}


def open_spool(folder: Path, keep: int = 10, **config) -> tuple[RecordSpool, list[dict]]:
    spool = RecordSpool(folder, SpoolConfig(**config), keep=lambda: keep)
    return spool, list(spool.load())


def ids(records: list[dict]) -> list[str]:
    return [r["record_id"] for r in records]


# ---- the spool and its duplicate filter ---------------------------------------------------------

def test_duplicates_are_dropped_within_a_bounded_window(tmp_path) -> None:
    spool, _ = open_spool(tmp_path, dedup_window=5)
    assert [spool.add(record(i)) for i in range(8)] == [True] * 8
    spool.compact()
    assert spool.num_ids == 5             # the window: the newest five ids
    assert not spool.add(record(7)) and not spool.add(record(3))   # recent: a QoS 1 redelivery
    assert spool.add(record(0))           # fell out of the window: the filter forgot it, as designed
    assert spool.records_in == 9 and spool.duplicates == 2
    assert spool.num_records == 8         # the new copy of r0 replaced the old one


def test_a_redelivery_after_a_restart_is_still_dropped_and_the_count_continues(tmp_path) -> None:
    spool, _ = open_spool(tmp_path)
    for i in range(5):
        spool.add(record(i))
    spool.close()
    again, replayed = open_spool(tmp_path)
    assert ids(replayed) == [f"r{i}" for i in range(5)]
    assert again.records_in == 5
    assert not again.add(record(4))
    assert again.add(record(5)) and again.records_in == 6


def test_compaction_keeps_only_the_newest_useful_records_and_the_cumulative_count(tmp_path) -> None:
    spool, _ = open_spool(tmp_path, keep=10, dedup_window=50)
    for i in range(3000):  # past 2 * max(keep, 1000) spooled records: compaction is due
        spool.add(record(i))
        if spool.needs_compaction():
            spool.compact()
    assert spool.compactions >= 1
    assert spool.num_records <= 2000 and spool.num_ids <= 100   # 2 * dedup_window
    spool.close()
    again, replayed = open_spool(tmp_path, keep=10, dedup_window=50)
    assert again.records_in == 3000            # every unique record ever received, across compaction
    assert ids(replayed)[-1] == "r2999" and len(replayed) == again.num_records
    assert not again.add(record(2999))         # the filter survived the compaction and the restart


def test_the_spool_stays_within_its_byte_cap(tmp_path) -> None:
    cap = 20_000
    spool, _ = open_spool(tmp_path, keep=10_000, max_bytes=cap)
    for i in range(200):
        spool.add(record(i, size=500))
        if spool.needs_compaction():
            spool.compact()
        assert spool.num_bytes <= cap + 600
    assert spool.dropped_for_space > 0 and spool.records_in == 200
    spool.close()
    _, replayed = open_spool(tmp_path, keep=10_000, max_bytes=cap)
    assert ids(replayed)[-1] == "r199"         # the newest are the ones kept
    assert tmp_path.joinpath("spool.sqlite3").stat().st_size < 4 * cap   # freed pages are reused


KILLED_WRITER = """
import sys
from prometheus_client import generate_latest

from specd.learner.spool import RecordSpool, SpoolConfig
spool = RecordSpool(sys.argv[1], SpoolConfig(dedup_window=50), keep=lambda: 30)
list(spool.load())
for i in range(10**6):
    spool.add({"record_id": f"r{i}", "pad": "x" * 200})
    if spool.needs_compaction():
        spool.compact()
    print(f"r{i}", flush=True)   # add returned: the record is stored
"""


def test_a_writer_killed_mid_run_loses_no_record_it_had_stored(tmp_path) -> None:
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    stored = [child.stdout.readline().strip() for _ in range(1500)]  # past a compaction or two
    child.send_signal(signal.SIGKILL)
    child.wait()
    again, replayed = open_spool(tmp_path, keep=30, dedup_window=50)
    last = int(ids(replayed)[-1][1:])                       # the child may have stored more than we read
    assert last >= len(stored) - 1 and again.records_in == last + 1   # each record counted exactly once
    assert ids(replayed) == [f"r{i}" for i in range(last + 1 - len(replayed), last + 1)]  # no gap, no mix
    assert all(r["pad"] == "x" * 200 for r in replayed)     # each whole
    assert not again.add(record(last))                      # its redelivery is still dropped


def test_a_jsonl_spool_of_an_earlier_version_is_imported_once(tmp_path) -> None:
    lines = [json.dumps(record(i)) for i in range(4)] + [json.dumps(record(4))[:10]]   # the last cut by a crash
    tmp_path.joinpath("received.jsonl").write_text("\n".join(lines))
    # r3's id line was cut off: it is counted at the import
    tmp_path.joinpath("received-ids.jsonl").write_text("\n".join(json.dumps([n + 1, f"r{n}"]) for n in range(3)))
    spool, replayed = open_spool(tmp_path)
    assert ids(replayed) == ["r0", "r1", "r2", "r3"] and spool.records_in == 4
    assert not spool.add(record(3)) and spool.add(record(4))
    assert not tmp_path.joinpath("received.jsonl").exists() and tmp_path.joinpath("received.jsonl.imported").exists()
    spool.close()
    again, replayed = open_spool(tmp_path)
    assert ids(replayed) == ["r0", "r1", "r2", "r3", "r4"] and again.records_in == 5


def test_the_sidecar_counts_records_across_restarts_and_spools_only_what_it_keeps(tmp_path) -> None:
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    loaded = tiny_loaded_target()
    options = SidecarOptions(store=str(tmp_path / "store"))

    async def deliver(sidecar: Sidecar, numbers: range) -> None:
        for i in numbers:
            await sidecar.handle("specd/default/records/s", json.dumps(valid_record(i)).encode())

    first = Sidecar(options, loaded)
    asyncio.run(deliver(first, range(5)))
    asyncio.run(deliver(first, range(3, 5)))       # redelivered
    assert first.status()["records_in"] == 5 and first.status()["records_duplicate"] == 2
    first.spool.close()
    first.claim.release()  # as the stopped process did
    second = Sidecar(options, loaded)
    assert second.bus.backlog == 5                 # the learner gets its records again
    asyncio.run(deliver(second, range(4, 7)))
    status = second.status()
    assert status["records_in"] == 7
    assert status["learner_loop_failures"] == getattr(second.learner.stats, "loop_failures", 0)
    assert second._records_of_use() >= second.learner.buffer.maxlen


def test_a_record_keeps_its_role_held_out_or_trained_across_a_restart_after_compaction(tmp_path) -> None:
    import sqlite3

    from specd.learner.config import LearnerConfig
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    loaded = tiny_loaded_target()
    options = SidecarOptions(store=str(tmp_path / "store"), learner=LearnerConfig(holdout_every=3))

    def roles(sidecar: Sidecar) -> tuple[set[str], set[str]]:
        sidecar.learner.intake()
        return ({r.record_id for r in sidecar.learner.holdout}, {r.record_id for r in sidecar.learner.buffer})

    first = Sidecar(options, loaded)
    for i in range(9):
        asyncio.run(first.handle("specd/default/records/s", json.dumps(valid_record(i)).encode()))
    held, trained = roles(first)
    assert len(held) == 3 and len(trained) == 6
    first.spool.close()
    first.claim.release()
    with sqlite3.connect(first.spool.path) as db:  # compaction dropped the two oldest records
        db.execute("DELETE FROM records WHERE n <= 2")
    again_held, again_trained = roles(Sidecar(options, loaded))
    assert again_held == held - {"r0", "r1"} and again_trained == trained - {"r0", "r1"}


def test_a_record_the_learner_would_refuse_is_counted_and_never_spooled(tmp_path) -> None:
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store")), tiny_loaded_target())
    bad = [{**valid_record(1), "output_ids": [3, 10**9]}, {**valid_record(2), "prompt_ids": [1], "output_ids": [3]},
           {"record_id": "r3", "server_id": "s"}]
    for message in [*bad, valid_record(4)]:
        asyncio.run(sidecar.handle("specd/default/records/s", json.dumps(message).encode()))
    status = sidecar.status()
    assert status["records_in"] == 1 and status["spool"]["records"] == 1 and sidecar.bus.backlog == 1
    assert status["records_refused_by_reason"] == {"tokens": 1, "too-short": 1, "schema": 1}
    scraped = generate_latest(sidecar.registry).decode()  # /metrics counts them as /v1/status does
    assert "specd_learner_records_refused_total 3.0" in scraped


@pytest.mark.mqtt
def test_a_message_is_acknowledged_only_after_its_handler_stored_it(tmp_path) -> None:
    """A handler that dies before storing (as a killed learner would) gets the message again:
    the broker still holds it because no PUBACK was sent."""
    from specd.core.threads import BackgroundHealth
    from specd.testing.processes import Broker
    from specd.transport.mqtt import MqttPublisher, MqttSettings, subscribe_forever

    broker = Broker(tmp_path / "broker").start()
    settings = MqttSettings.from_url(broker.url, deployment="manual-ack")
    deliveries: list[str] = []
    probes: list[bytes] = []
    health = BackgroundHealth()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def handle(topic: str, payload: bytes) -> None:
        if "/reports/" in topic:
            probes.append(payload)
            return
        deliveries.append(json.loads(payload)["record_id"])
        if len(deliveries) == 1:
            raise OSError("disk full")  # stands for a learner that dies before the record is spooled

    task = loop.create_task(subscribe_forever(settings, "ack-test-learner", handle, stop, health))

    def subscriber() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    thread = threading.Thread(target=subscriber, daemon=True)
    thread.start()
    publisher = MqttPublisher(settings, "server-a").start()
    try:
        deadline = time.monotonic() + 20   # the subscription is in place once a probe report gets through
        while not probes and time.monotonic() < deadline:
            publisher.report({"probe": True})
            time.sleep(0.2)
        assert probes, "the subscriber never received a probe"
        publisher.publish(record(1))
        deadline = time.monotonic() + 30
        while len(deliveries) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert deliveries[:2] == ["r1", "r1"], deliveries   # delivered again after the failed handling
        assert health.snapshot()["mqtt-subscriber"]["failures"] >= 1
        assert "disk full" in str(health.snapshot()["mqtt-subscriber"]["last_error"])
    finally:
        publisher.stop()
        loop.call_soon_threadsafe(stop.set)
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        with contextlib.suppress(Exception):
            loop.close()
        broker.stop()


# ---- per-version metric labels ------------------------------------------------------------------

def labelled_versions(metrics: ServingMetrics) -> set[str]:
    text = metrics.exposition().decode()
    return set(re.findall(r'specd_spec_decode_num_draft_tokens_total\{source="[^"]+",version="([^"]+)"\}', text))


def test_only_the_most_recent_versions_keep_their_own_metric_labels(tmp_path) -> None:
    metrics = ServingMetrics(max_versions=8)
    for version in range(1, 101):
        metrics.observe_verification(version, "learned", drafts=4, accepted=2, emitted=3)
    assert labelled_versions(metrics) == {str(v) for v in range(93, 101)}
    # an evicted version's series ends; no other series jumps by its lifetime count
    assert "older" not in metrics.exposition().decode()
    (report,) = metrics.reports("s")
    assert set(report.versions) == set(range(93, 101))
    # the reports' per-source figures stay cumulative across evictions: every draft of every version
    assert report.sources["learned"].drafts == 400
    # the version served again (a rollback) is recent again and is not the next evicted
    metrics.observe_verification(93, "learned", 4, 4, 5)
    metrics.observe_verification(101, "learned", 4, 4, 5)
    assert "93" in labelled_versions(metrics) and "94" not in labelled_versions(metrics)


def test_a_version_served_again_after_its_eviction_is_counted_whole_by_the_acceptance_log() -> None:
    """Its counts once restarted at zero, and the log, which reads a rise as new drafts, took 7 of
    12 drafts served to it as 2."""
    from specd.control.acceptance import AcceptanceLog

    metrics, log = ServingMetrics(max_versions=2), AcceptanceLog()

    def serve(version: int, passes: int, accepted: int) -> None:
        for _ in range(passes):
            metrics.observe_verification(version, "learned", 1, accepted, 1 + accepted, "prose")
        for report in metrics.reports("s"):
            log.add(report)

    serve(1, 5, 1)
    serve(2, 3, 0)
    serve(3, 3, 0)  # 1 is evicted
    serve(1, 7, 1)  # and served again (a rollback to it)
    assert log.totals[1].as_dict() == {"drafts": 12, "accepted": 12, "passes": 12, "emitted": 24}
    assert log.source_totals["learned"].drafts == 18  # every version's drafts, once each


def test_metrics_scrape_while_the_engine_thread_counts(tmp_path) -> None:
    metrics = ServingMetrics(max_versions=4)
    stop = threading.Event()
    errors: list[BaseException] = []

    def engine() -> None:
        i = 0
        try:
            while not stop.is_set():
                source = "context4" if i % 3 else "learned"
                metrics.observe_verification(i % 50, source, 4, i % 5, 2, domain=f"d{i % 7}")
                i += 1
        except BaseException as error:  # kept: the assertion below names it
            errors.append(error)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        for _ in range(200):  # each scrape contends with the engine thread for the GIL
            assert b"specd_spec_decode_acceptance_rate" in metrics.exposition()
            metrics.reports("s")
    finally:
        stop.set()
        thread.join()
    assert not errors


def test_records_shed_by_a_full_bus_are_not_counted_as_waiting() -> None:
    from types import SimpleNamespace

    from specd.core.threads import BackgroundHealth
    from specd.learner.config import LearnerStats
    from specd.serving.serve import _learner_status
    from specd.transport.bus import InProcessBus

    bus = InProcessBus(capacity=2)
    for i in range(5):
        bus.publish(record(i))   # three shed: the oldest go first
    bus.take(1, 0.0)
    learner = SimpleNamespace(stats=LearnerStats(), staleness={}, health=lambda: {})
    status = _learner_status(SimpleNamespace(learner=learner, counters=bus.counters, health=BackgroundHealth()))()
    assert status["records_waiting"] == bus.backlog == 1
