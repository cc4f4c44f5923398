"""Failures in background loops are seen: logged, counted in status and metrics, and the loop restarted."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specd.core.threads import BackgroundHealth, supervise, supervised_thread
from specd.drafter.factory import DrafterSpec
from specd.serving.http.metrics import ServingMetrics
from specd.serving.serve import REPORTS_TASK, ServeOptions, build_server
from specd.testing import tiny_loaded_target


def test_a_failing_async_task_is_restarted_and_its_failures_counted() -> None:
    health = BackgroundHealth()
    runs: list[int] = []

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"failure {len(runs)}")

    async def main() -> None:
        await asyncio.wait_for(supervise("flaky", body, health, asyncio.Event(), base_delay=0.01), timeout=10)

    asyncio.run(main())
    task = health.snapshot()["flaky"]
    assert len(runs) == 3                       # ran again after each failure, until it returned
    assert task["failures"] == 2 and task["restarts"] == 2
    assert task["last_error"] == "RuntimeError: failure 2" and task["last_failure_time"] is not None


def test_a_stop_ends_a_supervised_task_during_its_backoff() -> None:
    health = BackgroundHealth()

    async def always_fails() -> None:
        raise ValueError("broken")

    async def main() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(supervise("broken", always_fails, health, stop, base_delay=30, max_delay=30))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(task, timeout=5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 2
    assert health.failures()["broken"] >= 1


def test_a_failing_thread_is_restarted_and_its_failures_counted() -> None:
    health = BackgroundHealth()
    stop = threading.Event()
    runs: list[int] = []

    def body() -> None:
        runs.append(1)
        if len(runs) < 4:
            raise OSError("disk full")
        stop.wait()

    thread = supervised_thread("worker", body, health, stop, base_delay=0.01)
    thread.start()
    deadline = time.monotonic() + 10
    while len(runs) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and len(runs) == 4
    assert health.snapshot()["worker"]["failures"] == 3
    assert health.snapshot()["worker"]["last_error"] == "OSError: disk full"


def test_background_failures_are_exported_per_task() -> None:
    health = BackgroundHealth()
    health.register("quiet")
    health.failed("reports", RuntimeError("x"))
    health.failed("reports", RuntimeError("y"))
    text = ServingMetrics(background=health).exposition().decode()
    assert 'specd_background_failures_total{task="reports"} 2.0' in text
    assert 'specd_background_failures_total{task="quiet"} 0.0' in text


@pytest.mark.asyncio
async def test_a_failing_report_loop_is_restarted_and_seen_in_health_and_metrics(tmp_path, monkeypatch) -> None:
    loaded = tiny_loaded_target()
    app = build_server(ServeOptions(store=str(tmp_path / "store"), learner=False, model_name="tiny",
                                    drafter=DrafterSpec(head_vocab=200), report_seconds=0.05), loaded)
    calls: list[int] = []
    original = ServingMetrics.reports

    def flaky_reports(self, server_id):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("report failed")
        return original(self, server_id)

    monkeypatch.setattr(ServingMetrics, "reports", flaky_reports)
    async with TestClient(TestServer(app)) as client:
        deadline = time.monotonic() + 20
        while len(calls) < 5 and time.monotonic() < deadline:   # still reporting after two failures
            await asyncio.sleep(0.05)
        assert len(calls) >= 5
        health = await (await client.get("/health")).json()
        assert health["background"][REPORTS_TASK]["failures"] == 2
        assert health["background"][REPORTS_TASK]["last_error"] == "RuntimeError: report failed"
        metrics = await (await client.get("/metrics")).text()
        assert f'specd_background_failures_total{{task="{REPORTS_TASK}"}} 2.0' in metrics


@pytest.mark.mqtt
def test_a_publisher_whose_send_fails_keeps_publishing_and_loses_nothing(tmp_path, monkeypatch) -> None:
    import aiomqtt

    from specd.testing.processes import Broker, wait_for
    from specd.transport.mqtt import PUBLISHER_TASK, MqttPublisher, MqttSettings

    broker = Broker(tmp_path / "broker").start()
    failures_left = [2]
    real_publish = aiomqtt.Client.publish

    async def failing_publish(self, topic, payload=None, *args, **kwargs):
        if failures_left[0] > 0:
            failures_left[0] -= 1
            raise RuntimeError("send failed")
        return await real_publish(self, topic, payload, *args, **kwargs)

    monkeypatch.setattr(aiomqtt.Client, "publish", failing_publish)
    publisher = MqttPublisher(MqttSettings.from_url(broker.url, deployment="send-fails"), "server-a").start()
    try:
        for i in range(5):
            publisher.publish({"record_id": f"r{i}"})
        wait_for(lambda: publisher.counters.delivered == 5, 30, what="every record delivered")
        assert publisher.backlog == 0 and publisher.counters.shed == 0
        task = publisher.health.snapshot()[PUBLISHER_TASK]
        assert task["failures"] == 2 and task["last_error"] == "RuntimeError: send failed"
        publisher.publish({"record_id": "later"})   # and it keeps going
        wait_for(lambda: publisher.counters.delivered == 6, 30, what="a later record delivered")
    finally:
        publisher.stop()
        broker.stop()


@pytest.mark.mqtt
def test_an_announcement_the_server_cannot_take_is_counted_and_the_next_one_is_taken(tmp_path) -> None:
    import json

    from specd.testing.processes import Broker, wait_for
    from specd.transport.mqtt import ANNOUNCEMENTS_TASK, MqttPublisher, MqttSettings, announce

    broker = Broker(tmp_path / "broker").start()
    settings = MqttSettings.from_url(broker.url, deployment="bad-announcement")
    taken: list[dict] = []

    def on_announcement(payload: dict) -> None:
        if payload["version"] == 2:
            raise KeyError("url")  # a bug in the callback, not a malformed payload
        taken.append(payload)

    publisher = MqttPublisher(settings, "server-a", on_announcement=on_announcement).start()
    try:
        wait_for(publisher.connected.is_set, 20, what="the publisher connected")
        for version in (2, 3):
            asyncio.run(announce(settings, {"version": version}))
        wait_for(lambda: taken, 20, what="the next announcement taken")
        assert [t["version"] for t in taken] == [3]
        assert publisher.health.snapshot()[ANNOUNCEMENTS_TASK]["failures"] == 1
        assert json.dumps(publisher.health.snapshot())   # status can carry it
    finally:
        publisher.stop()
        broker.stop()


def test_the_sidecar_counts_failed_announcements_and_carries_the_learner_loop_failures(tmp_path) -> None:
    from specd.learner.sidecar import ANNOUNCER_TASK, Sidecar, SidecarOptions
    from specd.testing.processes import free_port
    from specd.transport.mqtt import MqttSettings

    unreachable = MqttSettings(port=free_port())   # nothing listens there
    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store"), mqtt=unreachable), tiny_loaded_target())
    assert sidecar.store.live_version() is not None   # the day-0 version, to announce

    async def announce_for_a_while() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sidecar.announcer(stop))
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(announce_for_a_while())
    status = sidecar.status()
    assert status["background"][ANNOUNCER_TASK]["failures"] >= 1   # it keeps trying, and it shows
    assert status["learner_loop_failures"] == getattr(sidecar.learner.stats, "loop_failures", 0)
    # the learner's own failure fields, once it has them, come through; an error object as its text
    stats = sidecar.learner.stats
    stats.loop_failures = 3
    stats.last_failure = RuntimeError("nan loss")
    status = sidecar.status()
    assert status["learner_loop_failures"] == 3 and status["learner_last_failure"] == "nan loss"


def test_a_stopped_publisher_keeps_what_is_published_after_it_and_never_raises() -> None:
    from specd.transport.mqtt import MqttPublisher, MqttSettings

    # no broker on this port: the loop runs, retries, and is stopped; the decoding thread's
    # publish after that (a request finishing during shutdown) must not raise
    publisher = MqttPublisher(MqttSettings(port=1), "server-a").start()
    time.sleep(0.3)
    publisher.stop(drain_seconds=0)
    publisher.publish({"record_id": "late"})
    publisher.report({"late": True})
    assert publisher.backlog == 2 and publisher.counters.published == 1
