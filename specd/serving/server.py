"""`specd serve`: wire target, drafter, store, swapper, learner and the HTTP API into one server.

Contract: `build_server(options)` returns an aiohttp application whose cleanup context starts the
engine thread, the swapper and (embedded mode) the learner when the app starts, and stops them
when it shuts down. With no options it runs the embedded default: the bundled target, a drafter
created at start, the in-process bus and the learner in the same process, the weight store in
`$SPECD_CACHE/store`. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from specd.bus import InProcessBus
from specd.drafter.checkpoint import load_drafter
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import Swapper
from specd.learner.learner import Learner, LearnerConfig
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
    learner: bool = True
    duty_cycle: float = 0.5
    server_id: str = "specd-0"
    model_name: str | None = None
    drafter_layers: int = 1
    drafter_head_vocab: int = 8192


def build_server(options: ServeOptions, loaded: LoadedTarget | None = None) -> web.Application:
    loaded = loaded or LoadedTarget.load(options.target)
    store = WeightStore(options.store or cache_dir() / "store")
    bus = InProcessBus()
    live = store.live_version()
    dtype = loaded.model.embed.weight.dtype
    if live is not None:
        model = load_drafter(store.weights_path(live), loaded.fingerprint, dtype)
    else:
        config = loaded.model.config
        shape = DrafterShape.like(config, options.drafter_layers, min(options.drafter_head_vocab, config.vocab_size))
        model = new_drafter_model(loaded.model, shape)
    learner = None
    if options.learner:
        learner = Learner(LearnerConfig(duty_cycle=options.duty_cycle, k=options.k), bus, store, model,
                          loaded.fingerprint, dtype)
    drafter = TokenDrafter(model, str(store.live_version() or "0"))
    swapper = Swapper(store, drafter, loaded.fingerprint)
    metrics = ServingMetrics()
    metrics.sources.update({"specd_drafter_swaps": lambda: drafter.num_swaps,
                            "specd_drafter_refused": lambda: len(swapper.refused),
                            "specd_records_shed": lambda: bus.counters.shed})
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=options.max_batch, num_draft_tokens=options.k,
                                                        eos_token_ids=loaded.eos_token_ids))
    worker = EngineWorker(engine, bus, options.server_id, metrics)
    name = options.model_name or Path(loaded.folder).name

    def status() -> dict[str, object]:
        return {"server_id": options.server_id, "live_version": store.live_version(),
                "records_published": worker.num_records_published, "records_shed": bus.counters.shed,
                "learner_steps": learner.stats.steps if learner is not None else None}

    app = create_app(ApiState(loaded, worker, metrics, name, status))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        worker.start()
        swapper.start()
        if learner is not None:
            learner.start()
        yield
        if learner is not None:
            learner.stop()
        swapper.stop()
        worker.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
