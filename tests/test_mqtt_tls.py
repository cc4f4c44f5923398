"""The broker with TLS and a password file: Mosquitto with a CA the test makes, a server certificate
for 127.0.0.1, one user, no anonymous access. Records flow over mqtts:// with the right credentials
and CA, through the transport and through `specd learner`'s command line; a wrong password and a
client that does not trust the CA are refused, and a refused publisher keeps its records."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import aiomqtt
import pytest

from specd.core.records import SCHEMA_VERSION
from specd.testing.processes import SpecdProcess, TlsBroker, free_port, get_json, tiny_checkpoint, wait_for
from specd.transport.mqtt import PUBLISHER_TASK, MqttPublisher, MqttSettings, subscribe_forever

pytestmark = pytest.mark.mqtt

USER, PASSWORD = "specd", "s3cret-pass"


@pytest.fixture
def broker(tmp_path):
    broker = TlsBroker(tmp_path / "broker", USER, PASSWORD).start()
    yield broker
    broker.stop()


def settings_for(broker: TlsBroker, deployment: str, password: str = PASSWORD,
                 ca: str | None = None) -> MqttSettings:
    url = f"mqtts://{USER}:{password}@127.0.0.1:{broker.port}"
    return MqttSettings.from_url(url, deployment=deployment, tls_ca=ca or str(broker.ca))


class Subscriber:
    """subscribe_forever on its own thread and loop, keeping what arrives."""

    def __init__(self, settings: MqttSettings, client_id: str) -> None:
        self.received: list[tuple[str, bytes]] = []
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()

        async def handle(topic: str, payload: bytes) -> None:
            self.received.append((topic, payload))

        self.task = self.loop.create_task(subscribe_forever(settings, client_id, handle, self.stop))
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            self.loop.run_until_complete(self.task)

    def of_kind(self, kind: str) -> list[bytes]:
        return [payload for topic, payload in self.received if f"/{kind}/" in topic]

    def __enter__(self) -> Subscriber:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(10)
        self.loop.close()


def wait_until_subscribed(publisher: MqttPublisher, subscriber: Subscriber) -> None:
    deadline = time.monotonic() + 20
    while not subscriber.of_kind("reports") and time.monotonic() < deadline:
        publisher.report({"probe": True})
        time.sleep(0.2)
    assert subscriber.of_kind("reports"), "the subscriber never received a probe"


def test_records_flow_over_tls_with_the_right_password_and_ca(broker) -> None:
    settings = settings_for(broker, "tls-ok")
    with Subscriber(settings, "tls-learner") as subscriber:
        publisher = MqttPublisher(settings, "server-a").start()
        try:
            wait_until_subscribed(publisher, subscriber)
            for i in range(3):
                publisher.publish({"record_id": f"r{i}"})
            wait_for(lambda: len(subscriber.of_kind("records")) == 3, 20, what="records over TLS")
            # the broker may forward a record before its acknowledgement reaches the publisher
            wait_for(lambda: publisher.counters.delivered == 3, 10, what="the broker's acknowledgements")
            assert publisher.health.snapshot()[PUBLISHER_TASK]["failures"] == 0
        finally:
            publisher.stop()


def test_a_wrong_password_is_refused_and_the_publisher_keeps_its_records(broker) -> None:
    publisher = MqttPublisher(settings_for(broker, "tls-wrong", password="wrong"), "server-a").start()
    try:
        for i in range(3):
            publisher.publish({"record_id": f"r{i}"})
        wait_for(lambda: publisher.health.snapshot()[PUBLISHER_TASK]["failures"] >= 2, 30,
                 what="refusals counted")
        task = publisher.health.snapshot()[PUBLISHER_TASK]
        assert "authori" in str(task["last_error"]).lower(), task   # "Not authorized"
        assert not publisher.connected.is_set()
        assert publisher.backlog == 3 and publisher.counters.delivered == 0 and publisher.counters.shed == 0
    finally:
        publisher.stop(drain_seconds=0)


@pytest.mark.parametrize("who", ["no password", "an untrusting client"])
def test_anonymous_and_untrusting_clients_are_refused(broker, who) -> None:
    if who == "no password":
        settings = MqttSettings(host="127.0.0.1", port=broker.port, tls_ca=str(broker.ca))
        needle = "authori"
    else:  # right credentials, but only the system's CAs: the test CA's certificate must not pass
        settings = settings_for(broker, "tls-untrusting", ca="system")
        needle = "certificate"

    async def connect() -> None:
        async with settings.client():
            pass

    with pytest.raises(aiomqtt.MqttError) as refusal:
        asyncio.run(connect())
    assert needle in str(refusal.value).lower()


@pytest.mark.slow
def test_the_learner_command_takes_records_over_tls(tmp_path: Path, broker) -> None:
    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    deployment = "tls-cli"
    learner = SpecdProcess(["learner", "--store", str(tmp_path / "store"), "--broker", broker.url,
                            "--tls-ca", str(broker.ca), "--deployment", deployment, "--target", str(checkpoint)],
                           free_port(), tmp_path / "learner.log").start()
    publisher = MqttPublisher(settings_for(broker, deployment), "server-a").start()
    try:
        # the learner's session exists once its subscriber has connected: records sent then reach it
        status = learner.url + "/v1/status"
        wait_for(lambda: get_json(status)["background"]["mqtt-subscriber"]["failures"] == 0, 20,
                 what="the learner's status")
        deadline = time.monotonic() + 60
        sent = 0
        while get_json(status)["records_in"] == 0 and time.monotonic() < deadline:
            publisher.publish({"schema_version": SCHEMA_VERSION, "record_id": f"probe-{sent}", "server_id": "server-a",
                               "prompt_ids": [1, 2, 3], "output_ids": [4, 5, 6, 7], "steps": [], "temperature": 0.0,
                               "top_p": 1.0, "created": 1.0, "finished": 2.0})  # a record the learner keeps
            sent += 1
            time.sleep(0.5)
        assert get_json(status)["records_in"] >= 1, learner.log.read_text()[-3000:]
    finally:
        publisher.stop()
        learner.stop()
