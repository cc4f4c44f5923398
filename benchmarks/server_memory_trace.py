"""What part of a server's memory growth Python's own objects hold: tracemalloc against the RSS.

One `specd serve` server built in this process (bundled SmolLM2, embedded, no learner and so no
records, batch 4, one torch thread, malloc arenas capped as `specd serve` caps them) on a loopback
port, under the traffic of benchmarks/server_memory.py (3 clients, sampled chat and code requests,
half streamed, `--max-tokens` tokens; its `client`). After about `--warm-up` answered requests
tracemalloc starts; after about `--requests` more (each client checks before it sends, so up to 2
more), the RSS growth in between is set against the growth tracemalloc saw (every
allocation Python's allocator makes, objects and buffers; not what torch, oneDNN or MKL allocate
with malloc themselves), with the largest growths by traceback. tracemalloc slows the server (300
requests took 14 minutes on a 2-core EPYC) and its own bookkeeping counts in the RSS, so the RSS
growth is an upper bound on the server's own.

    python benchmarks/server_memory_trace.py --warm-up 150 --requests 300
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from common import parser, write_result
from server_memory import client
from soak import traffic
from soak_faults import rss_mb
from soak_traffic import Prompt

from specd.core.allocator import cap_malloc_arenas
from specd.model.bundled import bundled_target_dir
from specd.serving.serve import ServeOptions, build_server
from specd.testing.processes import free_port

CLIENTS = 3
TOP = 10  # growths reported by traceback


async def serve_requests(url: str, prompts: list[Prompt], count: int, seed: int, max_tokens: int) -> int:
    """About `count` answered requests from `CLIENTS` concurrent clients (server_memory.py's); how many."""
    answered: dict[str, int] = {}
    await asyncio.gather(*[client(url, prompts, seed * 100 + c, lambda: answered.get(url, 0) < count, max_tokens,
                                  answered) for c in range(CLIENTS)])
    return answered.get(url, 0)


async def run(args: Any) -> dict[str, Any]:
    cap_malloc_arenas()
    torch.set_num_threads(1)
    options = ServeOptions(target=str(bundled_target_dir()), store=str(Path(args.work) / "store"), learner=False,
                           max_batch=4, server_id="memory-trace", model_name="soak")
    runner = web.AppRunner(build_server(options))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url, pid = f"http://127.0.0.1:{port}", os.getpid()
    _, prompts = traffic(400, args.seed)
    try:
        started = time.time()
        warm_requests = await serve_requests(url, prompts, args.warm_up, args.seed, args.max_tokens)
        warm_seconds, rss_start = time.time() - started, rss_mb(pid) or 0.0   # this process: never gone
        print(f"warm-up: {warm_requests} requests in {warm_seconds:.0f} s, RSS {rss_start:.0f} MB", flush=True)
        tracemalloc.start(12)
        gc.collect()
        first = tracemalloc.take_snapshot()
        started = time.time()
        traced_requests = await serve_requests(url, prompts, args.requests, args.seed + 1, args.max_tokens)
        gc.collect()
        second, rss_end = tracemalloc.take_snapshot(), rss_mb(pid) or 0.0
        measured_seconds = time.time() - started
    finally:
        await runner.cleanup()
    growths = second.compare_to(first, "traceback")
    traced_growth = sum(stat.size_diff for stat in growths) / 1e6
    top = [{"mb": stat.size_diff / 1e6, "blocks": stat.count_diff, "traceback": stat.traceback.format()[-8:]}
           for stat in growths[:TOP]]
    return {"warm_up_seconds": warm_seconds, "measured_seconds": measured_seconds, "rss_start_mb": rss_start,
            "rss_end_mb": rss_end, "rss_growth_mb": rss_end - rss_start, "traced_growth_mb": traced_growth,
            "requests_traced": traced_requests,
            "rss_growth_kb_per_request": (rss_end - rss_start) * 1000 / max(traced_requests, 1), "top_growths": top}


def main() -> None:
    p = parser(__doc__, "out/server_memory_trace.json", repeats=None)
    p.add_argument("--warm-up", type=int, default=150, help="requests before tracing starts")
    p.add_argument("--requests", type=int, default=300, help="requests traced")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="out/server-memory-trace")
    args = p.parse_args()
    if args.warm_up < 1 or args.requests < 1 or args.max_tokens < 1:
        p.error("--warm-up, --requests and --max-tokens must be at least 1")
    result = asyncio.run(run(args))
    print(f"RSS {result['rss_start_mb']:.0f} -> {result['rss_end_mb']:.0f} MB over "
          f"{result['requests_traced']} requests ({result['rss_growth_kb_per_request']:.0f} KB a request); "
          f"tracemalloc saw {result['traced_growth_mb']:+.1f} MB")
    for growth in result["top_growths"]:
        print(f"{growth['mb']:+.2f} MB, {growth['blocks']:+d} blocks: {growth['traceback'][-2].strip()}")
    write_result(args.out, args, result)


if __name__ == "__main__":
    main()
