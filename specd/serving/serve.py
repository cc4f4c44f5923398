"""`specd serve`: wire target, drafter, version source, bus, learner and the HTTP API into one server.

Contract: `build_server(options)` returns an aiohttp application whose cleanup context starts the
engine thread, the swapper, the report loop and (embedded mode) the learner when the app starts,
and stops them when it shuts down. Two modes, chosen by `mqtt`:
- embedded (no broker, the default): the bundled target, a drafter created at start, the weight
  store in `$SPECD_CACHE/store`, the control plane with the dashboard on this server's own port,
  and the learner: by default (`learner_mode` "auto", on a machine with more than one core) in a
  process of its own pinned to cores of its own (`specd.learner.process`; the server keeps the
  other cores, and the current drafter is published as the store's day-0 version if it has none),
  so that training never takes a decoding core; "thread" (and "auto" on one core) runs it as a
  thread of this process with a `duty_cycle`, records crossing an in-process bus;
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
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from specd.control.acceptance import AcceptanceLog
from specd.control.plane import ControlPlane, add_control_routes
from specd.core.errors import ConfigurationError, SpecdError
from specd.core.threads import BackgroundHealth, supervise
from specd.drafter.base import BUILT_IN_VERSION
from specd.drafter.checkpoint import DrafterModel, clone_drafter, load_drafter
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.worker import EngineWorker
from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper, VersionSource
from specd.learner.claim import LearnerClaim, claim
from specd.learner.collector import LearnerCollector
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner, LearnerHandle
from specd.learner.process import LearnerProcess, config_for_process, pin_serving, split_cores
from specd.model.bundled import cache_dir
from specd.model.target import LoadedTarget
from specd.serving.http.api import ApiState, create_app
from specd.serving.http.metrics import ServingMetrics
from specd.transport.bus import BusCounters, InProcessBus, RecordSink
from specd.transport.mqtt import MqttPublisher, MqttSettings

log = logging.getLogger(__name__)
REPORTS_TASK = "reports"


@dataclass(frozen=True)
class ServeOptions:
    target: str | None = None
    store: str | None = None
    k: int = 4
    max_batch: int = 8
    max_context: int | None = 4096    # prompt + output tokens per request; None: the target's own limit
    prefill_chunk: int | None = EngineConfig.prefill_chunk  # prompt tokens prefilled per step; None: whole
    learner: bool = True
    learner_mode: str = "auto"         # embedded: "process" (cores of its own), "thread", "auto" (process on 2+ cores)
    duty_cycle: float = 0.5            # a learner thread's share of wall time (a process trains all the time)
    server_id: str = "specd-0"
    model_name: str | None = None
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    mqtt: MqttSettings | None = None   # sidecar mode when set
    learner_url: str | None = None     # where to fetch weights before the first announcement names one
    token: str | None = None           # bearer token for the embedded control plane
    report_seconds: float = 2.0
    publish_records: bool = True       # off only to measure what the loop costs
    canary: bool = True                # the embedded learner rolls a regression back by itself (`learner.shadow`)
    max_queued: int | None = 64        # requests waiting for a batch slot before new ones get a 429 (None: no bound)
    api_key: str | None = None         # the OpenAI routes need `Authorization: Bearer <api_key>` (as vLLM's)
    shutdown_grace_s: float = 10.0     # how long a stopping server lets requests in flight finish (then a 503)


@dataclass
class Wiring:
    """What differs between embedded and sidecar mode."""

    bus: RecordSink
    counters: BusCounters
    source: VersionSource
    model: DrafterModel                # the drafter to serve until the source's live version arrives
    version: int
    store: WeightStore | None = None   # embedded: the local store, its learner and control plane
    learner: LearnerHandle | None = None
    serving_cores: list[int] | None = None  # the server's cores when the learner has others
    claim: LearnerClaim | None = None  # embedded: the store held for this server's learner
    publisher: MqttPublisher | None = None
    health: BackgroundHealth = field(default_factory=BackgroundHealth)


def _sidecar_wiring(options: ServeOptions, mqtt: MqttSettings, loaded: LoadedTarget, store_dir: Path) -> Wiring:
    remote = RemoteSource(store_dir / "fetched", options.learner_url)
    if options.learner_url:  # the live version now, not only once the broker announces it (it may be down)
        try:
            live = remote.learner_live()
        except SpecdError as error:
            log.warning("cannot ask the learner for its live version (%s): serving the built-in drafter until "
                        "the broker announces one", error)
        else:
            if live is not None:
                remote.announce({"version": live})
    health = BackgroundHealth()
    publisher = MqttPublisher(mqtt, options.server_id, on_announcement=remote.announce, health=health)
    model = initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint)
    return Wiring(publisher, publisher.counters, remote, model, BUILT_IN_VERSION, publisher=publisher, health=health)


LEARNER_MODES = ("auto", "process", "thread")


def _embedded_wiring(options: ServeOptions, loaded: LoadedTarget, store_dir: Path) -> Wiring:
    if options.learner_mode not in LEARNER_MODES:
        raise ConfigurationError(f"learner_mode must be one of {', '.join(LEARNER_MODES)}, "
                                 f"got {options.learner_mode!r}")
    store = WeightStore(store_dir)
    held = claim(store_dir, "stop it, give this server another --store, or --no-learner") if options.learner else None
    live = store.live_version()
    embedding = loaded.model.embed.weight
    model = (load_drafter(store.weights_path(live), loaded.fingerprint, embedding.dtype, target_embedding=embedding)
             if live is not None else initial_model(loaded.model, options.drafter, fingerprint=loaded.fingerprint))
    cores = split_cores() if options.learner and options.learner_mode != "thread" else None
    if options.learner_mode == "process" and cores is None and options.learner:
        raise ConfigurationError("learner_mode 'process' needs at least two cores (this process has one); "
                                 "use 'thread' or 'auto'")
    if cores is not None:
        serving_cores, learner_cores = cores
        if live is None:  # the child resumes the store's live version: the one this server starts with
            live = store.publish(clone_drafter(model).to(embedding.dtype), loaded.fingerprint, None,
                                 {"evaluation": None, "reason": "initial"}, embedding)
            store.set_live(live, "initial", if_live=None)
        with _serving_threads(serving_cores):  # sharing the target remakes its layouts: for the server's cores
            process = LearnerProcess(config_for_process(LearnerConfig(k=options.k, canary=options.canary)),
                                     store_dir, loaded.model, loaded.fingerprint, embedding.dtype, learner_cores)
        return Wiring(process.sink, process.sink.counters, LocalStore(store), model, live, store, process,
                      serving_cores=serving_cores, claim=held)
    bus = InProcessBus()
    learner = None
    if options.learner:
        learner = Learner(LearnerConfig(duty_cycle=options.duty_cycle, k=options.k, canary=options.canary), bus,
                          store, model,
                          loaded.fingerprint, embedding.dtype, embedding, target=loaded.model)
    return Wiring(bus, bus.counters, LocalStore(store), model, store.live_version() or BUILT_IN_VERSION, store, learner,
                  claim=held)


def build_server(options: ServeOptions, loaded: LoadedTarget | None = None) -> web.Application:
    loaded = loaded or LoadedTarget.load(options.target)
    store_dir = Path(options.store or cache_dir() / "store")
    wiring = (_sidecar_wiring(options, options.mqtt, loaded, store_dir) if options.mqtt is not None
              else _embedded_wiring(options, loaded, store_dir))
    drafter = build_drafter(options.drafter, wiring.model, wiring.version)
    table = drafter.table if isinstance(drafter, HybridDrafter) else None
    swapper = Swapper(wiring.source, drafter, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    metrics = ServingMetrics(background=wiring.health)
    metrics.sources.update({"specd_records_shed": lambda: wiring.counters.shed,
                            "specd_drafter_swaps": lambda: drafter.num_swaps,
                            "specd_drafter_refused": lambda: len(swapper.refused)})
    if table is not None:
        metrics.gauges["specd_traffic_table_contexts"] = (
            f"contexts the traffic table holds (at most {table.max_contexts})", table.__len__)
    # records need a reader, a learner here or a sidecar's over MQTT: with neither none are made (a
    # bundled record with its features is about 6 KB a token, and the bus would keep 4096 of them)
    records = options.publish_records and (options.mqtt is not None or options.learner)
    with _serving_threads(wiring.serving_cores):  # the engine makes its layouts for the cores it will decode on
        engine = Engine(loaded.model, drafter, EngineConfig(
            max_batch=options.max_batch, num_draft_tokens=options.k, max_context=options.max_context,
            prefill_chunk=options.prefill_chunk, eos_token_ids=loaded.eos_token_ids,
            shared_prefixes=loaded.shared_prefixes(), record_features=records and options.drafter.arch == "feature"))
    metrics.serving = lambda: (options.server_id, engine.drafter_version)
    worker = EngineWorker(engine, wiring.bus if records else None, options.server_id, metrics, table,
                          health=wiring.health)
    status = _status(options, wiring, worker)
    app = create_app(ApiState(loaded, worker, metrics, options.model_name or Path(loaded.folder).name, status,
                              options.max_queued, api_key=options.api_key,
                              shutdown_grace_s=options.shutdown_grace_s))
    acceptance = AcceptanceLog()
    if wiring.store is not None:
        learner = wiring.learner
        add_control_routes(app, ControlPlane(wiring.store, acceptance, options.token, _learner_status(wiring),
                                             submit=learner.submit if learner is not None else None,
                                             fingerprint=loaded.fingerprint,
                                             target_embedding=loaded.model.embed.weight))
        if learner is not None:  # embedded: the learner's metrics beside the serving ones, on one /metrics
            metrics.registry.register(LearnerCollector(learner, wiring.store))
    app.cleanup_ctx.append(_lifecycle(options, wiring, worker, swapper, metrics, acceptance))
    return app


def _status(options: ServeOptions, wiring: Wiring, worker: EngineWorker) -> Callable[[], dict[str, Any]]:
    def status() -> dict[str, Any]:
        counters, publisher, learner = wiring.counters, wiring.publisher, wiring.learner
        # first: a learner process's stats read its latest report, which also brings `delivered` up to date
        steps = learner.stats.steps if learner is not None else None
        return {"server_id": options.server_id, "live_version": wiring.source.live_version(),
                "requests_queued": worker.queued, "records_published": worker.num_records_published,
                "records_delivered": counters.delivered, "records_shed": counters.shed,
                "broker_connected": publisher.connected.is_set() if publisher else None,
                "learner_steps": steps, "background": wiring.health.snapshot(),
                "failing": wiring.health.failing(),  # background tasks that failed in the last minute
                "traffic_table": worker.table.stats() if worker.table is not None else None,
                **({"learner": learner.health()} if learner is not None else {})}
    return status


def _learner_status(wiring: Wiring) -> Callable[[], dict[str, Any]]:
    def status() -> dict[str, Any]:
        learner, counters = wiring.learner, wiring.counters
        if learner is None:
            return {}
        stats = learner.stats  # one read: a learner process builds it from its latest report
        waiting = max(0, counters.published - counters.shed - counters.delivered)  # shed ones wait no more
        return {"records_in": stats.records_in, "records_waiting": waiting,
                "records_refused": sum(stats.refused.values()), "records_refused_by_reason": dict(stats.refused),
                "learner_steps": stats.steps,
                "mean_record_age_s": learner.staleness.get("mean_record_age_s"),
                "learner_loop_failures": stats.loop_failures, "learner": learner.health(),
                "background": wiring.health.snapshot()}
    return status


@contextlib.contextmanager
def _serving_threads(cores: list[int] | None) -> Iterator[None]:
    """torch at the thread count the server will decode with once pinned to `cores` (None: as it is)
    while the engine and the learner process make the target's layouts: which layouts a layer uses
    depends on the thread count, and made at the machine's count the bundled target's server held
    a 513 MB copy it never used until its lifecycle pinned it and remade them."""
    threads = torch.get_num_threads()
    if cores is not None:
        torch.set_num_threads(len(cores))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pin(cores: list[int] | None) -> Callable[[], None]:
    """The server on its own cores (the learner process has the others); returns how to undo it."""
    if cores is None:
        return lambda: None
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    pin_serving(cores)

    def restore() -> None:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    return restore


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

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        if wiring.publisher is not None:
            wiring.publisher.start()
        restore = _pin(wiring.serving_cores)
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
        if wiring.claim is not None:
            wiring.claim.release()
        restore()

    return lifecycle
