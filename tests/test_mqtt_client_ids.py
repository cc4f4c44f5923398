"""A second learner with the same MQTT client id is named as such, not blamed on the broker: a
broker keeps one connection per client id and closes the older one whenever another connects, so
two learners with one id keep throwing each other off (each would otherwise log "broker
unreachable" over and over)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiomqtt
import pytest

from specd.core.threads import BackgroundHealth
from specd.testing.processes import Broker
from specd.transport.mqtt import SUBSCRIBER_TASK, TAKEN_OVER_DROPS, MqttSettings, subscribe_forever


async def handle(topic: str, payload: bytes) -> None:
    """A learner that takes every message and does nothing with it."""


async def stop_learner(stop: asyncio.Event, learner: asyncio.Task[None]) -> None:
    stop.set()
    learner.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await learner


@pytest.mark.mqtt
def test_a_second_client_with_the_learners_id_is_named_in_the_log(tmp_path, caplog) -> None:
    broker = Broker(tmp_path / "broker").start()
    settings = MqttSettings.from_url(broker.url, deployment="ids")

    async def intrude_until_thrown_off() -> None:
        """Connect as the learner's id and stay until the learner's reconnection throws this off."""
        with contextlib.suppress(aiomqtt.MqttError):
            async with settings.client(identifier="learner-x", clean_session=False) as intruder:
                async for _ in intruder.messages:
                    pass

    async def run() -> None:
        stop, health = asyncio.Event(), BackgroundHealth()
        learner = asyncio.create_task(subscribe_forever(settings, "learner-x", handle, stop, health))
        await asyncio.sleep(1.0)  # connected and subscribed
        for _ in range(TAKEN_OVER_DROPS):
            await asyncio.wait_for(intrude_until_thrown_off(), 30)
        await stop_learner(stop, learner)
        assert health.snapshot()[SUBSCRIBER_TASK]["failures"] >= TAKEN_OVER_DROPS

    try:
        with caplog.at_level(logging.WARNING, logger="specd.transport.mqtt"):
            asyncio.run(run())
    finally:
        broker.stop()
    said = [r.getMessage() for r in caplog.records]
    assert any("another client is connected with the same client id 'learner-x'" in m for m in said), said
    assert not any("unreachable" in m for m in said), said


@pytest.mark.mqtt
def test_the_learner_and_a_server_say_when_the_broker_is_reachable_again(tmp_path, caplog) -> None:
    """A log that says "unreachable" and never says otherwise leaves an operator guessing."""
    import time

    from specd.transport.mqtt import MqttPublisher

    broker = Broker(tmp_path / "broker").start()
    settings = MqttSettings.from_url(broker.url, deployment="again")

    async def learner_through_a_restart(publisher: MqttPublisher) -> None:
        stop = asyncio.Event()
        learner = asyncio.create_task(subscribe_forever(settings, "learner-y", handle, stop, BackgroundHealth()))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(broker.stop)
        await asyncio.sleep(1.5)  # both find it gone and retry
        await asyncio.to_thread(broker.start)
        for _ in range(100):  # both back within the backoff
            if publisher.connected.is_set() and any("reachable again; subscribing" in m for m in said()):
                break
            await asyncio.sleep(0.2)
        await stop_learner(stop, learner)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records]

    try:
        with caplog.at_level(logging.WARNING, logger="specd.transport.mqtt"):
            publisher = MqttPublisher(settings, "server-y").start()
            deadline = time.monotonic() + 20
            while not publisher.connected.is_set() and time.monotonic() < deadline:
                time.sleep(0.1)
            asyncio.run(learner_through_a_restart(publisher))
            publisher.stop()
    finally:
        broker.stop()
    assert any("MQTT broker reachable again; subscribing" in m for m in said()), said()
    assert any("MQTT broker reachable again; 0 records waiting" in m for m in said()), said()
