"""A server's resident memory over time, with specd's malloc arena cap and with glibc's default.

Two `specd serve` processes (bundled SmolLM2, MQTT sidecar mode, so each builds and publishes
records with their features as in production; no learner subscribes) run side by side, one
torch thread each, under the same traffic: `--clients` clients per server, each sending sampled
chat and code requests (half streamed) of `--max-tokens` tokens from the soak's prompts, with
the same random streams for both servers. One server runs as `specd serve` does by default
(`specd.core.allocator`: at most 2 malloc arenas), the other with `MALLOC_ARENA_MAX` at glibc's
own default (8 per core), which the cap leaves alone; `--against KEY=VALUE,...` gives the other
arm another environment instead (`MALLOC_MMAP_THRESHOLD_=131072`: capped arenas, and glibc's
threshold for serving a block from mmap fixed, which also stops glibc from raising it as blocks
are freed), and `--against-flags=...` adds flags to its `specd serve` (`--against ""
--against-flags=--no-records`: a server that makes and publishes no records, so that the growth
can be told to follow records or not). `--swap` gives the first server's port and log to the other
arm, to show that the position does not decide.

Each sample also reads how many contexts each server's traffic table holds (`/health`), and
before the servers start the benchmark measures what a context costs (tracemalloc over a table
filled to its bound from ShareGPT training conversations), so that the growth the table explains
can be told from the rest.

Written (`--out`): every sample (seconds, each arm's RSS in MB, requests answered and table
contexts), the measured bytes per context, and per arm the RSS at start, after warm-up (the first
sample past a quarter of the run), at the end, its growth after warm-up, the table's contexts at
those points and the MB its growth after warm-up accounts for, and the requests answered.

    python benchmarks/server_memory.py --minutes 10
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from common import parser, write_result
from soak import traffic
from soak_faults import rss_mb
from soak_traffic import Prompt, one_request

from specd.core.traffic import iter_training_conversations
from specd.drafter.traffic_table import TrafficTable
from specd.model.bundled import bundled_target_dir
from specd.model.target import load_tokenizer
from specd.testing.processes import Broker, SpecdProcess, free_port, get_json

SPECD_ARM = "specd (2 arenas)"
GLIBC_DEFAULT = f"MALLOC_ARENA_MAX={8 * (os.cpu_count() or 1)}"
SAMPLE_EVERY_S = 20.0


def arms_against(against: str, flags: str = "") -> dict[str, dict[str, Any]]:
    """The two arms: specd's default, and the other with `against` (KEY=VALUE,...) as its environment
    and `flags` (space-separated) added to its `specd serve` command; each {"env": ..., "flags": ...}."""
    pairs = [item.split("=", 1) for item in against.split(",") if item]
    if (not pairs and not flags) or any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise ValueError(f"--against takes KEY=VALUE[,KEY=VALUE...] (empty only with --against-flags), "
                         f"got {against!r}")
    name = "glibc default" if against == GLIBC_DEFAULT and not flags else " ".join(filter(None, [against, flags]))
    return {SPECD_ARM: {"env": {}, "flags": []}, name: {"env": dict(pairs), "flags": flags.split()}}


async def client(url: str, prompts: list[Prompt], seed: int, more: Callable[[], bool], max_tokens: int,
                 answered: dict[str, int]) -> None:
    """Sampled chat and code requests (half streamed) to `url` while `more()`; counts each 200 in `answered`."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        while more():
            kind = rng.choice(["sampled", "sampled_stream"])
            status, _, _ = await one_request(session, url, kind, rng.choice(prompts), max_tokens, rng)
            answered[url] = answered.get(url, 0) + (status == 200)


def table_bytes_per_context() -> float:
    """What one traffic-table context costs in Python allocations, with the table at its bound."""
    tokenizer = load_tokenizer(bundled_target_dir())  # the tokenizer alone: the weights are not needed here
    tracemalloc.start()
    try:
        table = TrafficTable()
        before = tracemalloc.get_traced_memory()[0]
        for messages in iter_training_conversations():
            table.add(tokenizer.encode(" ".join(m["content"] for m in messages[:4])[:4000]))
            if table.sequences_added >= 50 and len(table) >= table.max_contexts:  # full, and evicting
                break
        return (tracemalloc.get_traced_memory()[0] - before) / len(table)
    finally:
        tracemalloc.stop()


def table_contexts(server: SpecdProcess) -> float:
    """The server's traffic-table contexts now (-1 where a busy server did not answer in time)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        return float(get_json(server.url + "/health", timeout=5.0)["traffic_table"]["contexts"])
    return -1.0


async def watch(servers: dict[str, SpecdProcess], deadline: float, answered: dict[str, int],
                series: list[list[float]]) -> None:
    start = time.time()
    while time.time() < deadline:
        rss = [rss_mb(s.process.pid) or 0.0 for s in servers.values() if s.process is not None]
        contexts = [await asyncio.to_thread(table_contexts, s) for s in servers.values()]
        series.append([round(time.time() - start, 1), *rss, *[answered.get(s.url, 0) for s in servers.values()],
                       *contexts])
        print(f"[{series[-1][0]:6.1f} s] " + ", ".join(f"{name} {mb:.0f} MB" for name, mb in zip(servers, rss,
                                                                                               strict=True)),
              flush=True)
        await asyncio.sleep(SAMPLE_EVERY_S)


def summary(names: list[str], series: list[list[float]], bytes_per_context: float) -> dict[str, dict[str, float]]:
    warm = next(row for row in series if row[0] >= 0.25 * series[-1][0])
    out = {}
    n = len(names)
    for i, name in enumerate(names):
        # the last answered count at or before each point (a server that did not answer a sample reads -1)
        def contexts_at(row: list[float], column: int = 1 + 2 * n + i) -> float:
            return next((r[column] for r in reversed(series) if r[0] <= row[0] and r[column] >= 0), 0.0)
        contexts_warm, contexts_end = contexts_at(warm), contexts_at(series[-1])
        out[name] = {"start_mb": series[0][1 + i], "warm_mb": warm[1 + i], "end_mb": series[-1][1 + i],
                     "growth_after_warm_mb": series[-1][1 + i] - warm[1 + i],
                     "table_contexts_warm": contexts_warm, "table_contexts_end": contexts_end,
                     "table_growth_after_warm_mb": (contexts_end - contexts_warm) * bytes_per_context / 1e6,
                     "requests_answered": series[-1][1 + n + i]}
    return out


async def run(args: Any, work: Path) -> dict[str, Any]:
    bytes_per_context = table_bytes_per_context()
    print(f"a traffic-table context: {bytes_per_context:.0f} bytes", flush=True)
    broker = Broker(work / "broker").start()
    arms = arms_against(args.against, args.against_flags)
    names = list(arms)[::-1] if args.swap else list(arms)
    servers: dict[str, SpecdProcess] = {}
    try:
        for i, name in enumerate(names):
            env = {"OMP_NUM_THREADS": "1", **arms[name]["env"]}
            servers[name] = SpecdProcess(
                ["serve", "--target", str(bundled_target_dir()), "--broker", broker.url, "--deployment", "memory",
                 "--server-id", f"memory-{i}", "--model-name", "soak", "--store", str(work / f"store-{i}"),
                 "--batch", "4", *arms[name]["flags"]], free_port(), work / f"server-{i}.log", env=env).start()
        _, prompts = traffic(400, args.seed)
        deadline = time.time() + args.minutes * 60
        answered: dict[str, int] = {}
        series: list[list[float]] = []
        await asyncio.gather(watch(servers, deadline, answered, series),
                             *[client(s.url, prompts, args.seed * 100 + c, lambda: time.time() < deadline,
                                      args.max_tokens, answered)
                               for s in servers.values() for c in range(args.clients)])
    finally:
        for server in servers.values():
            server.stop()
        broker.stop()
    return {"arms": {name: arms[name] for name in names}, "series_columns": ["seconds", *names,
            *[f"{name} answered" for name in names], *[f"{name} table contexts" for name in names]],
            "series": series, "table_bytes_per_context": bytes_per_context,
            "summary": summary(names, series, bytes_per_context)}


def main() -> None:
    p = parser(__doc__, "benchmarks/results/server_memory.json", repeats=None)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=3, help="clients per server")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--swap", action="store_true", help="the other arm takes the first server's place")
    p.add_argument("--against", default=GLIBC_DEFAULT,
                   help=f"the other arm's environment, KEY=VALUE[,KEY=VALUE...] (default {GLIBC_DEFAULT}: "
                        "glibc's own arena count)")
    p.add_argument("--against-flags", default="",
                   help="flags added to the other arm's `specd serve`, written with = (--against-flags=--no-records, "
                        "or =--no-traffic-table; with --against \"\" to leave its environment alone), to tell what "
                        "the growth follows")
    p.add_argument("--work", default="out/server-memory")
    args = p.parse_args()
    if not (args.minutes > 0 and args.clients >= 1 and args.max_tokens >= 1):
        p.error("--minutes must be above 0, --clients and --max-tokens at least 1")
    try:
        arms_against(args.against, args.against_flags)
    except ValueError as error:
        p.error(str(error))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args, work))
    for name, s in result["summary"].items():
        print(f"{name}: {s['start_mb']:.0f} -> {s['warm_mb']:.0f} (warm) -> {s['end_mb']:.0f} MB, "
              f"{s['growth_after_warm_mb']:+.0f} MB after warm-up (the table's contexts "
              f"{s['table_contexts_warm']:.0f} -> {s['table_contexts_end']:.0f}: "
              f"{s['table_growth_after_warm_mb']:+.0f} MB), {s['requests_answered']} requests")
    write_result(args.out, args, result)


if __name__ == "__main__":
    main()
