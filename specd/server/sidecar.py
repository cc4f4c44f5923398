"""`specd learner`: the learner as a sidecar process beside one or many servers, over MQTT.

Contract: the sidecar subscribes to every server's records and reports with a persistent QoS 1
session, appends each new record to a spool file before training on it (so a restarted learner
reloads what it had received; duplicates from QoS 1 redelivery are dropped by record id), trains
and publishes versions to its weight store, announces the live version as a retained MQTT
message whenever it changes (a publish, an operator's control operation, a canary rollback),
and serves the control plane and dashboard over HTTP (127.0.0.1 by default; POSTs need the
bearer token when one is set). Reports feed the acceptance log; after every report the canary
checks the live version against its predecessor and rolls a regression back with the evidence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from specd.bus import InProcessBus
from specd.drafter.factory import DrafterSpec, initial_model
from specd.hotswap.canary import AcceptanceLog, CanaryConfig, apply_canary
from specd.hotswap.control import ControlPlane, add_control_routes
from specd.hotswap.store import WeightStore
from specd.learner.learner import Learner, LearnerConfig
from specd.model.target import LoadedTarget
from specd.mqtt import MqttSettings, announce, subscribe_forever

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SidecarOptions:
    store: str
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    public_url: str = "http://127.0.0.1:8100"
    token: str | None = None
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    client_id: str = "specd-learner"
    drafter: DrafterSpec = field(default_factory=DrafterSpec)   # the day-0 drafter's shape


class Sidecar:
    def __init__(self, options: SidecarOptions, loaded: LoadedTarget) -> None:
        self.options = options
        self.store = WeightStore(options.store)
        self.bus = InProcessBus(capacity=100_000)
        self.acceptance = AcceptanceLog()
        self.spool = Path(options.store) / "received.jsonl"
        self.seen: set[str] = set()
        self.refused_messages = 0
        embedding = loaded.model.embed.weight
        initial = initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint)
        self.learner = Learner(options.learner, self.bus, self.store, initial, loaded.fingerprint, embedding.dtype,
                               embedding, target=loaded.model)
        self._replay_spool()
        self._announced: int | None = None
        self._changed = asyncio.Event()
        self.plane = ControlPlane(self.store, self.acceptance, options.token, self.status, self._changed.set)

    def _replay_spool(self) -> None:
        if not self.spool.is_file():
            return
        for line in self.spool.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash mid-write
            self.seen.add(str(record.get("record_id")))
            self.bus.publish(record)

    def status(self) -> dict[str, object]:
        stats = self.learner.stats
        staleness = self.learner.staleness
        return {"records_in": len(self.seen), "records_waiting": self.bus.backlog,
                "records_refused": sum(stats.refused.values()) + self.refused_messages,
                "learner_steps": stats.steps, "tokens_trained": stats.tokens_trained,
                "mean_record_age_s": staleness.get("mean_record_age_s"),
                "published": len(stats.published), "rejected": len(stats.rejected)}

    async def handle(self, topic: str, payload: bytes) -> None:
        try:
            message = json.loads(payload)
            if not isinstance(message, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            self.refused_messages += 1
            log.warning("refused a malformed message on %s: %s", topic, error)
            return
        if "/reports/" in topic:
            try:
                self.acceptance.add(message)
            except ValueError as error:
                self.refused_messages += 1
                log.warning("refused a malformed report: %s", error)
                return
            self.check_canary()
            return
        record_id = str(message.get("record_id"))
        if record_id in self.seen:
            return  # QoS 1 may deliver twice
        self.seen.add(record_id)
        with self.spool.open("a") as handle:
            handle.write(json.dumps(message) + "\n")
        self.bus.publish(message)

    def check_canary(self) -> None:
        evidence = apply_canary(self.store, self.acceptance, self.options.canary)
        if evidence is not None:
            log.warning("canary rolled back to version %s: %s", evidence["restored"], evidence)
            self._changed.set()

    async def announcer(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            live = self.store.live_version()
            if live is not None and live != self._announced:
                try:
                    await announce(self.options.mqtt, {"version": live, "url": self.options.public_url,
                                                       "time": time.time()})
                    self._announced = live
                except Exception as error:  # the broker may be down: try again shortly
                    log.warning("could not announce version %s: %s", live, error)
            self._changed.clear()
            with contextlib.suppress(TimeoutError):  # wake on a change, or poll twice a second
                await asyncio.wait_for(self._changed.wait(), timeout=0.5)


def build_sidecar(options: SidecarOptions, loaded: LoadedTarget) -> web.Application:
    sidecar = Sidecar(options, loaded)
    app = web.Application()
    add_control_routes(app, sidecar.plane)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **sidecar.status()})

    app.router.add_get("/health", health)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        tasks = [asyncio.create_task(subscribe_forever(options.mqtt, options.client_id, sidecar.handle, stop),
                                     name="specd-subscriber"),
                 asyncio.create_task(sidecar.announcer(stop), name="specd-announcer")]
        sidecar.learner.start()
        yield
        stop.set()
        for task in tasks:
            task.cancel()
        sidecar.learner.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
