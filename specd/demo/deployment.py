"""`specd demo`: a sidecar deployment in miniature, replaying traffic with a shift in three modes.

Contract: the same requests, decoded greedily by three engines that share this process's serving
cores and threads:
- `adaptive`: the day-0 drafter (the shipped pretrained feature drafter unless the spec says
  otherwise), kept training by a learner on the records this mode produces. Where the machine has
  more than one core the learner is a process of its own on cores of its own
  (`specd.learner.process`), as a sidecar is; records reach it over a local queue and its versions
  reach the engine through the weight store and the swapper, between steps, as with `specd serve`;
- `static`: the same day-0 version, frozen;
- `none`: no speculation.
Both speculative modes are built alike (context matching, each its own traffic table, the same
lookahead policy on one set of step costs measured once before the run and then frozen), so they
choose differently only where their drafters are accepted differently: without learning
(`learning=False`) they give the same outputs, k choices and accept lengths.
Modes are interleaved in rounds: each round is `round_size` requests of one domain, decoded by
every mode in turn (the order rotating), so machine noise hits all alike; the report
(`specd.demo.report`) gives per-round figures, medians, spread and per-round ratios. The result is
a JSON document (top-level `summary`: mode -> domain -> requests, accept length, acceptance rate,
tokens/s; `rounds`, `swaps`, `learner` with its cost) and a PNG plot. Greedy outputs of every mode
are compared with `none`'s: they must be identical.
A `store_dir` given must be new or empty (`check_new_store`, before anything is written): the run
measures adaptation from its own day-0 version, and an earlier run's versions would be counted in.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specd.core.cpu import native_bfloat16
from specd.core.errors import ConfigurationError
from specd.core.traffic import TrafficItem
from specd.demo.report import MODES, adaptation_curve, round_figures, summarise, swap_timing, versions_served
from specd.drafter.checkpoint import clone_drafter, load_drafter
from specd.drafter.factory import DrafterSpec, build_drafter, initial_model
from specd.drafter.swap import ServingDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.lookahead import CalibrationSweep, LookaheadCosts
from specd.engine.request import SamplingParams, Sequence, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.process import LearnerProcess, config_for_process, learner_report, pin_serving, split_cores
from specd.model.target import LoadedTarget
from specd.transport.bus import InProcessBus, RecordSink

log = logging.getLogger(__name__)
__all__ = ["DEMO_LEARNER", "MODES", "DemoConfig", "encode", "run_demo"]


def training_precision() -> str:
    """bf16 autocast where the CPU computes bf16 itself, float32 where it would be emulated."""
    return "bfloat16" if native_bfloat16() else "float32"


# The demo's learner sees 20 requests of the new domain, not thousands: the gate needs 3 held-out
# records (one in 4 is held out, so evidence exists after 12 records) and a candidate is due every 4
# steps or 10 s, so a version trained after the shift can go live within a few rounds of it.
# It trains under bf16 autocast where the CPU has bf16 arithmetic (twice the steps on the Xeon's AMX
# cores) and in float32 elsewhere (emulated bf16 made a learner step about 15 times slower on an AVX2
# EPYC: 17 steps in a whole demo, no version passed; `specd.core.cpu`). Its learning rate,
# 1.5e-4 (the service's default is 5e-5), was chosen on validation code traffic that the demo never
# serves (benchmarks/demo_learner_sweep.py, benchmarks/results/demo_learner_sweep.json): after 20
# records and 50 steps it reached 1.764 / 1.742 (two seeds) against 1.706 / 1.711 at 5e-5, and
# 1.5e-3 fell below day 0 at first. Trained on a few chat records, though, the drafter got worse at
# chat (held-out 1.81 at day 0, 1.70 after 20 records): every weight is pulled 3% of the way back
# to day 0's after each step (`anchor_pull`), which kept chat at 1.79 and code at 1.72 against 1.74
# (the same sweep with `--chat-records 20`: demo_learner_sweep_anchor.json).
# Trained on a few records, a version loses some of the first domain for a while, so a gate that
# weighed every held-out record alike (5 of them chat, 1-2 code) refused the versions trained on 2-8
# code records (demo_deployment_b1.json: 2.10-2.17 against live's 2.24-2.27) and the first one after
# the shift went live two rounds after it. The gate weighs each domain by its share of the newest 8
# records (`gate_traffic_window`): a version is judged on the traffic it is about to serve. In the
# demo that did not bring the first version forward (still after 8 code records: judged on 1-2
# held-out code records the verdict is noise of about 0.1; docs/measurements.md).
DEMO_LEARNER = LearnerConfig(holdout_every=4, gate_min_held_out=3, publish_every_steps=4,
                             publish_every_seconds=10.0, recent_records=16,
                             precision=training_precision(),
                             feature_learning_rate=1.5e-4, anchor_pull=0.03, anchor="start", gate_traffic_window=8)


@dataclass(frozen=True)
class DemoConfig:
    max_tokens: int = 64
    # one request at a time: speculation buys latency, and on a CPU in float32 a pass over k + 1
    # tokens of one row costs about 1.15 passes over 1, while at batch 4 it is compute-bound
    # (docs/measurements.md, "The main job at batch 1")
    max_batch: int = 1
    k: int = 4
    # the same kind (context matching, a traffic table of its own) for the adaptive and the static run
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    # the lookahead controller picks k per step by default, from acceptance and the shared costs;
    # fixed k makes accept length measure the drafter, not the controller's choices
    adaptive_lookahead: bool = True
    round_size: int = 4            # requests of one domain per mode per round
    learning: bool = True          # False: no learner, adaptive is static by construction
    learner_process: bool = True   # the learner in a process and on cores of its own where there are two
    seed: int = 0
    learner: LearnerConfig = DEMO_LEARNER

    def __post_init__(self) -> None:
        if self.round_size < 1 or self.max_batch < 1 or self.max_tokens < 1:
            raise ConfigurationError("round_size, max_batch and max_tokens must be positive")


@dataclass
class ModeRun:
    mode: str
    engine: Engine
    drafter: ServingDrafter | None = None   # what the swapper follows versions into (the adaptive mode's)
    sink: RecordSink | None = None
    results: dict[int, Sequence] = field(default_factory=dict)
    rounds: list[dict[str, Any]] = field(default_factory=list)
    sent: list[tuple[float, str]] = field(default_factory=list)   # (time, domain) of each record sent
    step_seconds: list[float] = field(default_factory=list)
    step_versions: list[int | None] = field(default_factory=list)
    step_k: list[int] = field(default_factory=list)


def encode(loaded: LoadedTarget, item: TrafficItem) -> list[int]:
    if item.messages is not None:
        return loaded.encode_messages([{"role": r, "content": c} for r, c in item.messages])
    return loaded.encode(item.prompt or "")


def rounds_of(items: list[TrafficItem], size: int) -> list[tuple[str, list[int]]]:
    """Runs of one domain, in traffic order, cut into rounds of at most `size` requests."""
    runs: list[tuple[str, list[int]]] = []
    for index, item in enumerate(items):
        if not runs or runs[-1][0] != item.domain or len(runs[-1][1]) >= size:
            runs.append((item.domain, []))
        runs[-1][1].append(index)
    return runs


def serve_round(run: ModeRun, number: int, domain: str, indices: list[int], items: list[TrafficItem],
                prompts: list[list[int]], config: DemoConfig, bar: tqdm) -> None:
    engine = run.engine
    table = getattr(engine.drafter, "table", None)  # each mode's traffic table learns from its own requests
    waiting = {}
    begin, decoding = time.perf_counter(), 0.0
    for i in indices:
        params = SamplingParams(max_tokens=items[i].max_tokens or config.max_tokens)
        waiting[engine.add_request(prompts[i], params).request_id] = i
    while engine.has_work:
        before = engine.step_stats[-1] if engine.step_stats else None
        for seq in engine.step():
            run.results[waiting[seq.request_id]] = seq
            if table is not None:
                table.add(seq.prompt_ids + seq.output_ids)
            if run.sink is not None:
                run.sink.publish(record_from_sequence(seq, f"demo-{run.mode}", time.time(), domain).to_dict())
                run.sent.append((time.time(), domain))
            bar.update(1)
            bar.set_postfix(mode=run.mode, accept_len=f"{seq.accept_length:.2f}", drafter=engine.drafter_version)
        if not engine.step_stats or engine.step_stats[-1] is before:
            continue  # a step that only prefilled (a prompt longer than a chunk): no decoding pass to count
        last = engine.step_stats[-1]
        decoding += last.seconds
        run.step_seconds.append(last.seconds)
        run.step_versions.append(last.drafter_version)
        run.step_k.append(last.k)
    seconds = time.perf_counter() - begin
    done = [run.results[i] for i in indices]
    run.rounds.append({"round": number, "domain": domain, "first_request": indices[0], "requests": len(indices),
                       "tokens": sum(s.num_output_tokens for s in done),
                       "target_passes": sum(s.num_target_passes for s in done), "seconds": seconds,
                       # the decoding passes' own time (drafting and verifying); the rest is prefill and bookkeeping
                       "decoding_seconds": decoding})
    bar.set_postfix(mode=run.mode, tok_s=f"{run.rounds[-1]['tokens'] / max(seconds, 1e-9):.1f}",
                    drafter=engine.drafter_version)


CALIBRATION_TOKENS = 16   # new tokens per calibration request
CALIBRATION_STEPS_PER_K = 20  # about this many steps of a full batch at each k


def calibrated_costs(loaded: LoadedTarget, drafter: ServingDrafter, prompts: list[list[int]],
                     config: DemoConfig) -> LookaheadCosts:
    """`calibration_samples`, frozen (`LookaheadCosts.frozen_copy`)."""
    return calibration_samples(loaded, drafter, prompts, config).frozen_copy()


def calibration_samples(loaded: LoadedTarget, drafter: ServingDrafter, prompts: list[list[int]],
                        config: DemoConfig) -> LookaheadCosts:
    """Step costs at every width from 0 to the widest pass (config.k, or the continuations'
    context_k where larger) on this machine, measured once (and frozen by `calibrated_costs`): the
    cost model both speculative modes choose k and continuation reaches by. Each of two sweeps drafts k = 0, 1, ...
    in turn, a step each (`CalibrationSweep`), over enough requests to keep the batch full for about
    `CALIBRATION_STEPS_PER_K` steps at every k; the first warms up, the second measures: its
    samples are returned, to be frozen (`calibrated_costs`)."""
    # every width a pass can have: the learned drafter's k and the continuations' reach
    widest = max(config.k, config.drafter.context_k or 0)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=config.max_batch, num_draft_tokens=widest,
                                                        eos_token_ids=loaded.eos_token_ids))
    # requests x tokens = steps x rows x tokens a step (about 2)
    requests = max(1, (widest + 1) * CALIBRATION_STEPS_PER_K * config.max_batch * 2 // CALIBRATION_TOKENS)
    for costs in (LookaheadCosts(), LookaheadCosts(keep_samples=True)):  # warm-up, then measured
        engine.lookahead = CalibrationSweep(widest, costs)
        for i in range(requests):
            # never more than a request of the run asks for: a prompt that fits the run fits here
            engine.add_request(prompts[i % len(prompts)],
                               SamplingParams(max_tokens=min(CALIBRATION_TOKENS, config.max_tokens)))
        while engine.has_work:
            engine.step()
    return costs


def new_engine(loaded: LoadedTarget, drafter: ServingDrafter | None, config: DemoConfig, record_features: bool,
               costs: LookaheadCosts | None) -> Engine:
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=config.max_batch, num_draft_tokens=config.k,
                                                        eos_token_ids=loaded.eos_token_ids,
                                                        adaptive_lookahead=config.adaptive_lookahead,
                                                        record_features=record_features,
                                                        shared_prefixes=loaded.shared_prefixes()))
    if costs is not None:
        engine.lookahead.costs = costs
    return engine


def run_demo(loaded: LoadedTarget, items: list[TrafficItem], config: DemoConfig, store_dir: Path | None = None,
             held_out: list[TrafficItem] | None = None,
             after_round: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the three modes in rounds; the weight store is a temporary folder unless `store_dir` is
    given. `held_out` (requests of the last domain that the run never serves) gives the adaptation
    curve; `after_round(number, {"learner": ...})` is called between rounds (tests stop the learner there)."""
    if store_dir is not None:
        check_new_store(Path(store_dir))
        return _run_demo(loaded, items, config, Path(store_dir), held_out, after_round)
    with tempfile.TemporaryDirectory(prefix="specd-demo-store.") as folder:
        return _run_demo(loaded, items, config, Path(folder), held_out, after_round)


def check_new_store(store_dir: Path) -> None:
    """Refuse a store folder that already holds versions (an earlier demo's, say) or a live pointer:
    the demo's day 0 would not be version 1 live, and the adaptation curve would count foreign versions."""
    if store_dir.exists() and not store_dir.is_dir():
        raise ConfigurationError(f"--store {store_dir} is a file, not a folder for the demo's weight store")
    versions = store_dir / "versions"
    held = sorted(p.name for p in versions.iterdir() if p.name.isdigit()) if versions.is_dir() else []
    if held or (store_dir / "live.json").exists():
        what = f"{len(held)} drafter version(s)" if held else "a live.json"
        raise ConfigurationError(f"--store {store_dir} already holds {what} (an earlier run's?): the demo "
                                 f"needs a new or empty store folder; give another one, or none for a temporary one")


def _publish_day0(store: WeightStore, loaded: LoadedTarget, config: DemoConfig) -> int:
    initial = initial_model(loaded.model, config.drafter, seed=config.seed, fingerprint=loaded.fingerprint)
    embedding = loaded.model.embed.weight
    version = store.publish(clone_drafter(initial).to(embedding.dtype), loaded.fingerprint, None,
                            {"evaluation": None, "reason": "initial"}, embedding)
    store.set_live(version, "initial", if_live=None)
    store.pin(version)
    return version


def _check_context(prompts: list[list[int]], items: list[TrafficItem], config: DemoConfig, window: int) -> None:
    """Every request fits the context window: found before calibration, whose own requests would name
    other numbers than the ones the traffic and --max-tokens give."""
    for number, (ids, item) in enumerate(zip(prompts, items, strict=True), start=1):
        wanted = item.max_tokens or config.max_tokens
        if len(ids) + wanted > window:
            named = f"its max_tokens {wanted}" if item.max_tokens else f"--max-tokens {wanted}"
            raise ConfigurationError(f"request {number} of the traffic: its prompt ({len(ids)} tokens) + {named} "
                                     f"exceeds the context window of {window} tokens")


def _run_demo(loaded: LoadedTarget, items: list[TrafficItem], config: DemoConfig, store_dir: Path,
              held_out: list[TrafficItem] | None,
              after_round: Callable[[int, dict[str, Any]], None] | None) -> dict[str, Any]:
    torch.manual_seed(config.seed)
    prompts = [encode(loaded, item) for item in items]
    _check_context(prompts, items, config, loaded.model.config.max_position)
    domains = list(dict.fromkeys(item.domain for item in items))
    store = WeightStore(store_dir, keep_last=1000)  # every version stays for the adaptation curve
    static_version = _publish_day0(store, loaded, config)
    embedding = loaded.model.embed.weight

    def day0() -> ServingDrafter:
        model = load_drafter(store.weights_path(static_version), loaded.fingerprint, embedding.dtype,
                             target_embedding=embedding)
        return build_drafter(config.drafter, model, static_version)

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    split = split_cores() if config.learning and config.learner_process else None
    try:
        if split is not None:
            pin_serving(split[0])  # every mode decodes on the same cores with the same threads
        costs = calibrated_costs(loaded, day0(), prompts, config) if config.adaptive_lookahead else None
        adaptive_drafter = day0()
        runs = {"adaptive": ModeRun("adaptive", new_engine(loaded, adaptive_drafter, config, config.learning and bool(
                    getattr(adaptive_drafter, "capture_layers", ())), costs), adaptive_drafter),
                "static": ModeRun("static", new_engine(loaded, day0(), config, False, costs)),
                "none": ModeRun("none", new_engine(loaded, None, config, False, None))}
        learner_info = _serve_all(loaded, items, prompts, config, store, split, runs, after_round)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
    outputs = {mode: [runs[mode].results[i].output_ids for i in range(len(items))] for mode in MODES}
    requests = {mode: _request_rows(runs[mode], items) for mode in MODES}
    second = domains[-1]
    return {
        "summary": {mode: summarise(requests[mode], runs[mode].rounds, domains) for mode in MODES},
        "domains": domains,
        "static_version": static_version,
        "lossless": {mode: outputs[mode] == outputs["none"] for mode in ("adaptive", "static")},
        "rounds": round_figures({mode: runs[mode].rounds for mode in MODES}),
        "swap_timing": swap_timing(runs["adaptive"].step_seconds, runs["adaptive"].step_versions),
        "swaps": {"applied": getattr(adaptive_drafter, "num_swaps", 0),
                  "versions_live_after_shift": versions_served(requests["adaptive"], second),
                  "versions": versions_served(requests["adaptive"], None)},
        "learner": learner_info,
        "lookahead_costs": None if costs is None else {"draft_seconds": costs.draft_seconds,
                                                       "verify_seconds": costs.verify_seconds,
                                                       "measured_verify_seconds": costs.measured_verify_seconds},
        "k_choices": {mode: runs[mode].step_k for mode in ("adaptive", "static")},
        "adaptation": (adaptation_curve(loaded, store, held_out, runs["adaptive"].sent, second, config.k,
                                        config.max_tokens, encode) if held_out else None),
        "config": {k: v for k, v in asdict(config).items() if k != "learner"},
        "context_matched_rows": getattr(adaptive_drafter, "num_matched_rows", None),
        "requests": requests,
    }


def _serve_all(loaded: LoadedTarget, items: list[TrafficItem], prompts: list[list[int]], config: DemoConfig,
               store: WeightStore, split: tuple[list[int], list[int]] | None, runs: dict[str, ModeRun],
               after_round: Callable[[int, dict[str, Any]], None] | None) -> dict[str, Any]:
    """Start the learner (a process, a thread, or none), serve every round, stop it; its report."""
    embedding = loaded.model.embed.weight
    process: LearnerProcess | None = None
    thread: Learner | None = None
    adaptive = runs["adaptive"].drafter
    assert adaptive is not None, "the adaptive mode runs a drafter"
    swapper = Swapper(LocalStore(store), adaptive, loaded.fingerprint, target_embedding=embedding)
    began, began_cpu = time.monotonic(), time.process_time()
    if config.learning and split is not None:
        process = LearnerProcess(config_for_process(config.learner), store.root, loaded.model, loaded.fingerprint,
                                 embedding.dtype, split[1], keep_last=1000).start()
        process.wait_ready()
        runs["adaptive"].sink = process.sink
    elif config.learning:
        bus = InProcessBus()
        live = load_drafter(store.weights_path(store.live_version() or 0), loaded.fingerprint,
                            target_embedding=embedding)
        thread = Learner(config.learner, bus, store, live, loaded.fingerprint, embedding.dtype, embedding,
                         target=loaded.model).start()
        runs["adaptive"].sink = bus
    swapper.start()
    bar = tqdm(total=len(items) * len(MODES), desc="demo", unit="req")
    try:
        for number, (domain, indices) in enumerate(rounds_of(items, config.round_size)):
            for mode in MODES[number % len(MODES):] + MODES[:number % len(MODES)]:
                serve_round(runs[mode], number, domain, indices, items, prompts, config, bar)
            if after_round is not None:
                after_round(number, {"learner": process or thread})
    finally:
        bar.close()
        swapper.stop()
        if process is not None:
            report = process.stop()
        elif thread is not None:
            thread.stop()
            # a thread's CPU time is not its own: the process's is everything serving did too
            report = {**learner_report(thread, began_cpu, began, False), "cpu_seconds": None,
                      "cores": "shared with serving", "duty_cycle": config.learner.duty_cycle}
        else:
            report = {"alive": False, "steps": 0, "tokens_trained": 0, "published": [], "disabled": True}
    return {**report, "config": asdict(config.learner),
            "arrangement": "process" if process else "thread" if thread else "off"}


def _request_rows(run: ModeRun, items: list[TrafficItem]) -> list[dict[str, Any]]:
    rows = []
    for i, item in enumerate(items):
        seq = run.results[i]
        versions = [s.drafter_version for s in seq.steps]
        rows.append({"index": i, "domain": item.domain, "tokens": seq.num_output_tokens,
                     "target_passes": seq.num_target_passes, "drafts_proposed": seq.num_drafts_proposed,
                     "drafts_accepted": seq.num_drafts_accepted, "accept_length": seq.accept_length,
                     "drafter_version": max(set(versions), key=versions.count) if versions else None})
    return rows
