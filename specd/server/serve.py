"""`specd serve`: wire target, drafter, version source, bus, learner and the HTTP API into one server.

Contract: `build_server(options)` returns an aiohttp application whose cleanup context starts the
engine thread, the swapper, the report loop and (embedded mode) the learner when the app starts,
and stops them when it shuts down. Two modes, chosen by `mqtt`:
- embedded (no broker, the default): the bundled target, a drafter created at start, the
  in-process bus, the learner in this process, the weight store in `$SPECD_CACHE/store`, and the
  control plane with the dashboard on this server's own port;
- sidecar (a broker URL): records and acceptance reports go to MQTT, the live version arrives as
  a retained announcement, and weights are fetched over HTTP from the learner that announced it.
Each mode is one function that returns the same `Wiring`; the app is then assembled once.
It binds 127.0.0.1 unless told otherwise.
Background loops (the report loop, the MQTT publisher's thread) are supervised: a failure is
logged, counted in one `BackgroundHealth` shown under `background` in `/health` (and, embedded,
in the control plane's `/v1/status`) and as `specd_background_failures_total{task}` in
`/metrics`, and the loop is restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from specd.bus import BusCounters, InProcessBus, RecordSink
from specd.drafter.checkpoint import DrafterModel, load_drafter
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.worker import EngineWorker
from specd.hotswap.canary import AcceptanceLog, CanaryConfig, apply_canary
from specd.hotswap.control import ControlPlane, add_control_routes
from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper, VersionSource
from specd.learner.learner import Learner, LearnerConfig
from specd.model.bundled import cache_dir
from specd.model.target import LoadedTarget
from specd.mqtt import MqttPublisher, MqttSettings
from specd.server.api import ApiState, create_app
from specd.server.learner_metrics import LearnerCollector
from specd.server.metrics import ServingMetrics
from specd.threads import BackgroundHealth, supervise

REPORTS_TASK = "reports"


@dataclass(frozen=True)
class ServeOptions:
    target: str | None = None
    store: str | None = None
    k: int = 4
    max_batch: int = 8
    max_context: int | None = 4096    # prompt + output tokens per request; None: the target's own limit
    learner: bool = True
    duty_cycle: float = 0.5
    server_id: str = "specd-0"
    model_name: str | None = None
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    mqtt: MqttSettings | None = None   # sidecar mode when set
    learner_url: str | None = None     # where to fetch weights before the first announcement names one
    token: str | None = None           # bearer token for the embedded control plane
    report_seconds: float = 2.0
    publish_records: bool = True       # off only to measure what the loop costs
    canary: bool = True                # embedded: roll a regression back by itself (off to measure without it)
    max_queued: int | None = 64        # requests waiting for a batch slot before new ones get a 429 (None: no bound)
    api_key: str | None = None         # the OpenAI routes need `Authorization: Bearer <api_key>` (as vLLM's)


@dataclass
class Wiring:
    """What differs between embedded and sidecar mode."""

    bus: RecordSink
    counters: BusCounters
    source: VersionSource
    model: DrafterModel                # the drafter to serve until the source's live version arrives
    version: str
    store: WeightStore | None = None   # embedded: the local store, its learner and control plane
    learner: Learner | None = None
    publisher: MqttPublisher | None = None
    health: BackgroundHealth = field(default_factory=BackgroundHealth)


def _sidecar_wiring(options: ServeOptions, mqtt: MqttSettings, loaded: LoadedTarget, store_dir: Path) -> Wiring:
    remote = RemoteSource(store_dir / "fetched", options.learner_url)
    health = BackgroundHealth()
    publisher = MqttPublisher(mqtt, options.server_id, on_announcement=remote.announce, health=health)
    model = initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint)
    return Wiring(publisher, publisher.counters, remote, model, "0", publisher=publisher, health=health)


def _embedded_wiring(options: ServeOptions, loaded: LoadedTarget, store_dir: Path) -> Wiring:
    store = WeightStore(store_dir)
    bus = InProcessBus()
    live = store.live_version()
    embedding = loaded.model.embed.weight
    model = (load_drafter(store.weights_path(live), loaded.fingerprint, embedding.dtype, target_embedding=embedding)
             if live is not None else initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint))
    learner = None
    if options.learner:
        learner = Learner(LearnerConfig(duty_cycle=options.duty_cycle, k=options.k), bus, store, model,
                          loaded.fingerprint, embedding.dtype, embedding, target=loaded.model)
    return Wiring(bus, bus.counters, LocalStore(store), model, str(store.live_version() or "0"), store, learner)


def build_server(options: ServeOptions, loaded: LoadedTarget | None = None) -> web.Application:
    loaded = loaded or LoadedTarget.load(options.target)
    store_dir = Path(options.store or cache_dir() / "store")
    wiring = (_sidecar_wiring(options, options.mqtt, loaded, store_dir) if options.mqtt is not None
              else _embedded_wiring(options, loaded, store_dir))
    drafter = build_drafter(options.drafter, wiring.model, wiring.version)
    table = getattr(drafter, "table", None)
    swapper = Swapper(wiring.source, drafter, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    metrics = ServingMetrics(background=wiring.health)
    metrics.sources.update({"specd_records_shed": lambda: wiring.counters.shed,
                            "specd_drafter_swaps": lambda: drafter.num_swaps,
                            "specd_drafter_refused": lambda: len(swapper.refused)})
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=options.max_batch, num_draft_tokens=options.k,
                                                        max_context=options.max_context,
                                                        eos_token_ids=loaded.eos_token_ids,
                                                        record_features=options.drafter.arch == "feature"))
    worker = EngineWorker(engine, wiring.bus if options.publish_records else None, options.server_id, metrics, table)
    status = _status(options, wiring, worker)
    app = create_app(ApiState(loaded, worker, metrics, options.model_name or Path(loaded.folder).name, status,
                              options.max_queued, api_key=options.api_key))
    acceptance = AcceptanceLog()
    if wiring.store is not None:
        learner = wiring.learner
        add_control_routes(app, ControlPlane(wiring.store, acceptance, options.token, _learner_status(wiring),
                                             submit=learner.submit if learner is not None else None))
        if learner is not None:  # embedded: the learner's metrics beside the serving ones, on one /metrics
            metrics.registry.register(LearnerCollector(learner, wiring.store))
    app.cleanup_ctx.append(_lifecycle(options, wiring, worker, swapper, metrics, acceptance))
    return app


def _status(options: ServeOptions, wiring: Wiring, worker: EngineWorker) -> Callable[[], dict[str, Any]]:
    def status() -> dict[str, Any]:
        counters, publisher, learner = wiring.counters, wiring.publisher, wiring.learner
        return {"server_id": options.server_id, "live_version": wiring.source.live_version(),
                "requests_queued": worker.queued, "records_published": worker.num_records_published,
                "records_delivered": counters.delivered, "records_shed": counters.shed,
                "broker_connected": publisher.connected.is_set() if publisher else None,
                "learner_steps": learner.stats.steps if learner is not None else None,
                "background": wiring.health.snapshot()}
    return status


def _learner_status(wiring: Wiring) -> Callable[[], dict[str, Any]]:
    def status() -> dict[str, Any]:
        learner, counters = wiring.learner, wiring.counters
        if learner is None:
            return {}
        return {"records_in": learner.stats.records_in, "records_waiting": counters.published - counters.delivered,
                "records_refused": sum(learner.stats.refused.values()), "learner_steps": learner.stats.steps,
                "mean_record_age_s": learner.staleness.get("mean_record_age_s"),
                # the learner loop counts its own failures (read defensively: older learners lack them)
                "learner_loop_failures": getattr(learner.stats, "loop_failures", 0),
                "background": wiring.health.snapshot()}
    return status


def _lifecycle(options: ServeOptions, wiring: Wiring, worker: EngineWorker, swapper: Swapper,
               metrics: ServingMetrics, acceptance: AcceptanceLog) -> Callable[[web.Application], AsyncIterator[None]]:
    async def report_loop(stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):  # a stop ends the wait at once
                await asyncio.wait_for(stop.wait(), timeout=options.report_seconds)
            for report in metrics.reports(options.server_id):
                if wiring.publisher is not None:
                    wiring.publisher.report(report.to_dict())
                elif wiring.store is not None:
                    acceptance.add(report)
            if wiring.publisher is None and wiring.store is not None and options.canary:
                apply_canary(wiring.store, acceptance, CanaryConfig())

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        if wiring.publisher is not None:
            wiring.publisher.start()
        worker.start()
        swapper.start(wiring.health)
        if wiring.learner is not None:
            wiring.learner.start()
        reports = asyncio.create_task(supervise(REPORTS_TASK, lambda: report_loop(stop), wiring.health, stop),
                                      name="specd-reports")
        yield
        stop.set()
        reports.cancel()
        if wiring.learner is not None:
            wiring.learner.stop()
        swapper.stop()
        worker.stop()
        if wiring.publisher is not None:
            wiring.publisher.stop()

    return lifecycle
