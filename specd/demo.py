"""`specd demo`: replay traffic with a distribution shift through the engine in three modes.

Contract: the same requests, in the same order, decoded greedily three times:
- `adaptive`: the day-0 drafter (the shipped pretrained feature drafter unless the spec says
  otherwise) that a learner thread keeps training from the records this run produces; new
  versions reach the engine through the weight store and the swapper, between steps;
- `static`: the same day-0 drafter, frozen;
- `none`: no speculation.
Both speculative modes use the same non-learned parts (context matching, each its own traffic
table, the same lookahead setting), so the gap between them is learning alone.
Requests of one domain are decoded together (continuous batching up to `max_batch`); domains
run one after another, so per-domain tokens/s is wall time of that domain alone. The result is a
JSON document (top-level `summary`: mode -> domain -> requests, accept length, acceptance rate,
tokens/s) and a PNG plot of accept length over requests with swaps and the shift marked.
Greedy outputs of every mode are compared with `none`'s: they must be identical.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specd.bus import InProcessBus
from specd.drafter.checkpoint import load_drafter
from specd.drafter.factory import DrafterSpec, ServingDrafter, build_drafter, initial_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, Sequence, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import Swapper
from specd.learner.learner import Learner, LearnerConfig
from specd.model.target import LoadedTarget
from specd.traffic import TrafficItem

log = logging.getLogger(__name__)
MODES = ("adaptive", "static", "none")


@dataclass(frozen=True)
class DemoConfig:
    max_tokens: int = 64
    max_batch: int = 4
    k: int = 4
    # the same kind (context matching, a traffic table of its own) for the adaptive and the static run
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    # the lookahead controller picks k per step by default (the faster setting in `specd demo`);
    # fixed k makes accept length measure the drafter, not the controller's choices
    adaptive_lookahead: bool = True
    seed: int = 0
    learner: LearnerConfig = field(default_factory=LearnerConfig)


@dataclass
class ModeRun:
    mode: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    domain_seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: list[float] = field(default_factory=list)
    step_versions: list[str] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)


def encode(loaded: LoadedTarget, item: TrafficItem) -> list[int]:
    if item.messages is not None:
        return loaded.encode_messages([{"role": r, "content": c} for r, c in item.messages])
    return loaded.encode(item.prompt or "")


def segments(items: list[TrafficItem]) -> list[tuple[str, list[int]]]:
    """Contiguous runs of one domain: [(domain, indices)], in traffic order."""
    runs: list[tuple[str, list[int]]] = []
    for index, item in enumerate(items):
        if not runs or runs[-1][0] != item.domain:
            runs.append((item.domain, []))
        runs[-1][1].append(index)
    return runs


def run_mode(mode: str, loaded: LoadedTarget, items: list[TrafficItem], prompts: list[list[int]],
             config: DemoConfig, drafter: ServingDrafter | None, bus: InProcessBus | None) -> ModeRun:
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=config.max_batch, num_draft_tokens=config.k,
                                                        eos_token_ids=loaded.eos_token_ids,
                                                        adaptive_lookahead=config.adaptive_lookahead,
                                                        record_features=bus is not None and bool(
                                                            getattr(drafter, "capture_layers", ()))))
    run = ModeRun(mode)
    table = getattr(drafter, "table", None)  # each mode's traffic table learns from its own finished requests
    results: dict[int, Sequence] = {}
    bar = tqdm(total=len(items), desc=f"{mode:>8}", unit="req", leave=True)
    for domain, indices in segments(items):
        begin = time.perf_counter()
        waiting = {}
        for i in indices:
            params = SamplingParams(max_tokens=items[i].max_tokens or config.max_tokens)
            waiting[engine.add_request(prompts[i], params).request_id] = i
        while engine.has_work:
            for seq in engine.step():
                results[waiting[seq.request_id]] = seq
                if table is not None:
                    table.add(seq.prompt_ids + seq.output_ids)
                if bus is not None:
                    bus.publish(record_from_sequence(seq, f"demo-{mode}", time.time(), domain).to_dict())
                bar.update(1)
                bar.set_postfix(accept_len=f"{seq.accept_length:.2f}", drafter=engine.drafter_version)
            run.step_seconds.append(engine.step_stats[-1].seconds)
            run.step_versions.append(engine.step_stats[-1].drafter_version)
        run.domain_seconds[domain] = run.domain_seconds.get(domain, 0.0) + time.perf_counter() - begin
    bar.close()
    for i, item in enumerate(items):
        seq = results[i]
        versions = [s.drafter_version for s in seq.steps]
        run.requests.append({"index": i, "domain": item.domain, "tokens": seq.num_output_tokens,
                             "target_passes": seq.num_target_passes, "drafts_proposed": seq.num_drafts_proposed,
                             "drafts_accepted": seq.num_drafts_accepted, "accept_length": seq.accept_length,
                             "drafter_version": max(set(versions), key=versions.count) if versions else "none"})
        run.outputs.append(seq.output_ids)
    return run


def summarise(run: ModeRun, domains: list[str]) -> dict[str, Any]:
    summary = {}
    for domain in domains:
        rows = [r for r in run.requests if r["domain"] == domain]
        tokens = sum(r["tokens"] for r in rows)
        proposed = sum(r["drafts_proposed"] for r in rows)
        summary[domain] = {
            "requests": len(rows),
            "accept_length": tokens / max(sum(r["target_passes"] for r in rows), 1),
            "acceptance_rate": sum(r["drafts_accepted"] for r in rows) / proposed if proposed else 0.0,
            "tokens_per_s": tokens / run.domain_seconds[domain]}
    return summary


def swap_timing(run: ModeRun) -> dict[str, Any]:
    """The longest step at or right after a drafter change, against the median step."""
    swaps = [i for i in range(1, len(run.step_versions)) if run.step_versions[i] != run.step_versions[i - 1]]
    around = [run.step_seconds[j] for i in swaps for j in (i, i + 1) if j < len(run.step_seconds)]
    median = statistics.median(run.step_seconds) if run.step_seconds else 0.0
    return {"swaps": len(swaps), "median_step_s": median, "max_step_around_swap_s": max(around, default=0.0),
            "ratio": max(around, default=0.0) / median if median else None}


def run_demo(loaded: LoadedTarget, items: list[TrafficItem], config: DemoConfig,
             store_dir: Path | None = None) -> dict[str, Any]:
    """Run the three modes; the weight store is a temporary folder unless `store_dir` is given."""
    if store_dir is not None:
        return _run_demo(loaded, items, config, Path(store_dir))
    with tempfile.TemporaryDirectory(prefix="specd-demo-store.") as folder:
        return _run_demo(loaded, items, config, Path(folder))


def _run_demo(loaded: LoadedTarget, items: list[TrafficItem], config: DemoConfig, store_dir: Path) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    prompts = [encode(loaded, item) for item in items]
    domains = list(dict.fromkeys(item.domain for item in items))
    store = WeightStore(store_dir, keep_last=5)
    initial = initial_model(loaded.model, config.drafter, seed=config.seed, fingerprint=loaded.fingerprint)
    bus = InProcessBus()
    embedding = loaded.model.embed.weight
    learner = Learner(config.learner, bus, store, initial, loaded.fingerprint, embedding.dtype, embedding,
                      target=loaded.model)
    static_version = store.live_version()  # the day-0 version the learner published as its first
    assert static_version is not None
    store.pin(static_version)
    drafter = build_drafter(config.drafter, initial, str(static_version))
    swapper = Swapper(store, drafter, loaded.fingerprint, target_embedding=embedding)
    learner.start()
    swapper.start()
    try:
        adaptive = run_mode("adaptive", loaded, items, prompts, config, drafter, bus)
    finally:
        swapper.stop()
        learner.stop()
    static_model = load_drafter(store.weights_path(static_version), loaded.fingerprint, embedding.dtype,
                                target_embedding=embedding)
    static_drafter = build_drafter(config.drafter, static_model, str(static_version))
    static = run_mode("static", loaded, items, prompts, config, static_drafter, None)
    plain = run_mode("none", loaded, items, prompts, config, None, None)
    runs = {"adaptive": adaptive, "static": static, "none": plain}
    return {
        "summary": {mode: summarise(runs[mode], domains) for mode in MODES},
        "domains": domains,
        "static_version": static_version,
        "lossless": {mode: runs[mode].outputs == plain.outputs for mode in ("adaptive", "static")},
        "swap_timing": swap_timing(adaptive),
        "swaps": {"prepared": [asdict(e) for e in swapper.prepared], "refused": swapper.refused,
                  "applied": drafter.num_swaps},
        "learner": {"config": asdict(config.learner), "steps": learner.stats.steps,
                    "tokens_trained": learner.stats.tokens_trained, "records_in": learner.stats.records_in,
                    "published": learner.stats.published, "rejected": learner.stats.rejected,
                    "training_seconds": learner.stats.training_seconds,
                    "torch_threads": torch.get_num_threads(), "records_shed": bus.counters.shed,
                    "recomputed_features": getattr(learner.objective, "recompute_stats", None)},
        "config": {k: v for k, v in asdict(config).items() if k != "learner"},
        "context_matched_rows": getattr(drafter, "num_matched_rows", None),
        "requests": {mode: runs[mode].requests for mode in MODES},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    colours = {"adaptive": "tab:green", "static": "tab:orange", "none": "tab:gray"}
    for mode in MODES:
        rows = result["requests"][mode]
        ax.plot([r["index"] for r in rows], [r["accept_length"] for r in rows], marker=".", lw=1,
                color=colours[mode], label=mode)
    adaptive = result["requests"]["adaptive"]
    swaps = [r["index"] for a, r in itertools.pairwise(adaptive) if r["drafter_version"] != a["drafter_version"]]
    for i, x in enumerate(swaps):
        ax.axvline(x, color="tab:green", alpha=0.25, lw=1, label="drafter swap" if i == 0 else None)
    first = result["domains"][0]
    boundary = sum(1 for r in adaptive if r["domain"] == first)
    ax.axvline(boundary - 0.5, color="black", ls="--", label=f"shift: {first} → {result['domains'][-1]}")
    ax.set_xlabel("request")
    ax.set_ylabel("accept length (tokens per target pass)")
    ax.set_title("specd demo: accept length over requests")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
