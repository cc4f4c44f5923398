"""`specd serve`: wire target, drafter, version source, bus, learner and the HTTP API into one server.

Contract: `build_server(options)` returns an aiohttp application whose cleanup context starts the
engine thread, the swapper, the report loop and (embedded mode) the learner when the app starts,
and stops them when it shuts down. Two modes, chosen by `broker`:
- embedded (no broker, the default): the bundled target, a drafter created at start, the
  in-process bus, the learner in this process, the weight store in `$SPECD_CACHE/store`, and the
  control plane with the dashboard on this server's own port;
- sidecar (a broker URL): records and acceptance reports go to MQTT, the live version arrives as
  a retained announcement, and weights are fetched over HTTP from the learner that announced it.
It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from specd.bus import InProcessBus, RecordSink
from specd.drafter.checkpoint import load_drafter
from specd.drafter.context_match import HybridDrafter, wrap_drafter
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.drafter.traffic_table import TrafficTable
from specd.hotswap.control import ControlPlane, add_control_routes
from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper, VersionSource
from specd.learner.canary import AcceptanceLog, CanaryConfig, apply_canary
from specd.learner.learner import Learner, LearnerConfig
from specd.mqtt import MqttPublisher, MqttSettings
from specd.serving.api import ApiState, create_app
from specd.serving.bundled import cache_dir
from specd.serving.engine import Engine, EngineConfig
from specd.serving.metrics import ServingMetrics
from specd.serving.target import LoadedTarget
from specd.serving.worker import EngineWorker


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
    drafter_layers: int = 1
    drafter_head_vocab: int = 8192
    mqtt: MqttSettings | None = None   # sidecar mode when set
    learner_url: str | None = None     # where to fetch weights before the first announcement names one
    token: str | None = None           # bearer token for the embedded control plane
    report_seconds: float = 2.0
    drafter_kind: str = "hybrid"       # context matches first, the learned drafter elsewhere; or "learned"
    publish_records: bool = True       # off only to measure what the loop costs
    traffic_table: bool = True         # hybrid drafter: continuations learned across requests


def _reports(server_id: str, metrics: ServingMetrics) -> list[dict[str, Any]]:
    """One cumulative report per traffic domain: counters per drafter version."""
    by_domain: dict[str, dict[str, dict[str, int]]] = {}
    for (version, domain), totals in list(metrics.totals.items()):
        counts = dict(zip(("drafts", "accepted", "passes", "emitted"), totals, strict=True))
        by_domain.setdefault(domain, {})[version] = counts
    now = time.time()
    return [{"server_id": server_id, "time": now, "domain": domain, "versions": versions}
            for domain, versions in by_domain.items()]


def build_server(options: ServeOptions, loaded: LoadedTarget | None = None) -> web.Application:
    loaded = loaded or LoadedTarget.load(options.target)
    config, dtype = loaded.model.config, loaded.model.embed.weight.dtype
    store_dir = Path(options.store or cache_dir() / "store")
    shape = DrafterShape.like(config, options.drafter_layers, min(options.drafter_head_vocab, config.vocab_size))
    metrics = ServingMetrics()
    acceptance = AcceptanceLog()
    learner: Learner | None = None
    publisher: MqttPublisher | None = None
    bus: RecordSink
    source: VersionSource
    if options.mqtt is not None:
        remote = RemoteSource(store_dir / "fetched", options.learner_url)
        publisher = MqttPublisher(options.mqtt, options.server_id, on_announcement=remote.announce)
        bus, source, store = publisher, remote, None
        learned = TokenDrafter(new_drafter_model(loaded.model, shape), "0")  # until the first announcement
        counters = publisher.counters
    else:
        store = WeightStore(store_dir)
        in_process = InProcessBus()
        bus, source = in_process, LocalStore(store)
        live = store.live_version()
        model = (load_drafter(store.weights_path(live), loaded.fingerprint, dtype,
                              target_embedding=loaded.model.embed.weight) if live is not None
                 else new_drafter_model(loaded.model, shape))
        if options.learner:
            learner = Learner(LearnerConfig(duty_cycle=options.duty_cycle, k=options.k), in_process, store, model,
                              loaded.fingerprint, dtype, loaded.model.embed.weight)
        learned = TokenDrafter(model, str(store.live_version() or "0"))
        counters = in_process.counters
    drafter = wrap_drafter(learned, options.drafter_kind)
    table = TrafficTable() if isinstance(drafter, HybridDrafter) and options.traffic_table else None
    if isinstance(drafter, HybridDrafter):
        drafter.table = table
    swapper = Swapper(source, drafter, loaded.fingerprint, target_embedding=loaded.model.embed.weight)
    metrics.sources.update({"specd_records_shed": lambda: counters.shed,
                            "specd_drafter_swaps": lambda: drafter.num_swaps,
                            "specd_drafter_refused": lambda: len(swapper.refused)})
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=options.max_batch, num_draft_tokens=options.k,
                                                        max_context=options.max_context,
                                                        eos_token_ids=loaded.eos_token_ids))
    worker = EngineWorker(engine, bus if options.publish_records else None, options.server_id, metrics, table)

    def status() -> dict[str, Any]:
        return {"server_id": options.server_id, "live_version": source.live_version(),
                "records_published": worker.num_records_published,
                "records_delivered": counters.delivered, "records_shed": counters.shed,
                "broker_connected": publisher.connected.is_set() if publisher else None,
                "learner_steps": learner.stats.steps if learner is not None else None}

    app = create_app(ApiState(loaded, worker, metrics, options.model_name or Path(loaded.folder).name, status))
    if store is not None:
        def learner_status() -> dict[str, Any]:
            if learner is None:
                return {}
            staleness = learner.staleness
            return {"records_in": learner.stats.records_in, "records_waiting": counters.published - counters.delivered,
                    "records_refused": sum(learner.stats.refused.values()), "learner_steps": learner.stats.steps,
                    "mean_record_age_s": staleness.get("mean_record_age_s")}

        add_control_routes(app, ControlPlane(store, acceptance, options.token, learner_status))

    async def report_loop(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(options.report_seconds)
            for report in _reports(options.server_id, metrics):
                if publisher is not None:
                    publisher.report(report)
                elif store is not None:
                    acceptance.add(report)
            if publisher is None and store is not None:
                apply_canary(store, acceptance, CanaryConfig())

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        stop = asyncio.Event()
        if publisher is not None:
            publisher.start()
        worker.start()
        swapper.start()
        if learner is not None:
            learner.start()
        reports = asyncio.create_task(report_loop(stop), name="specd-reports")
        yield
        stop.set()
        reports.cancel()
        if learner is not None:
            learner.stop()
        swapper.stop()
        worker.stop()
        if publisher is not None:
            publisher.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
