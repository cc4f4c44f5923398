"""The service under load, side by side in one run (SmolLM2, embedded `specd serve` processes).

1. Hot-swap under load: concurrent streaming clients, with the live version changed every
   `--swap-every` seconds (POST /v1/live, cycling through prepared versions) and without;
   failed requests (goal 0) and p50/p99 inter-token latency (goal: p99 ratio ≤ 1.1).
2. Cost of the loop: the same load against a server publishing trajectory records and one that
   does not (`--no-records`); serving throughput (goal: under 3% apart).
Both servers run at once and the conditions alternate in short slices over several rounds
(medians reported), because this machine is shared and noisy.
Both servers run with --no-learner so the learner's own CPU use does not enter the comparison
(the demo and the shift benchmark report it with the learner on). Writes out/service_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.model.target import LoadedTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the process harness lives with the tests
from harness import SpecdProcess, free_port

PROMPTS = ["Write a haiku about the sea.", "What is recursion?", "List three fruits.", "Explain DNS briefly.",
           "Describe a cat.", "How do planes fly?", "Give me a pasta recipe.", "What is entropy?"]


def prepare_store(folder: Path, versions: int) -> None:
    loaded = LoadedTarget.load(None)
    store = WeightStore(folder, keep_last=100)
    shape = DrafterShape.like(loaded.model.config, 1, 8192)
    for seed in range(versions):
        version = store.publish(new_drafter_model(loaded.model, shape, seed=seed), loaded.fingerprint,
                                store.live_version(), {})
        store.set_live(version)


async def client(session: aiohttp.ClientSession, url: str, deadline: float, gaps: list[float],
                 outcomes: list[bool], tokens: list[int], index: int) -> None:
    n = index
    while time.monotonic() < deadline:
        body = {"model": "bench", "messages": [{"role": "user", "content": PROMPTS[n % len(PROMPTS)]}],
                "max_tokens": 48, "temperature": 0, "stream": True}
        n += 3
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    outcomes.append(False)
                    continue
                last = time.perf_counter()
                async for line in response.content:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"][0].get("delta", {}).get("content"):
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
                        tokens[0] += 1
                outcomes.append(True)
        except (TimeoutError, aiohttp.ClientError):
            outcomes.append(False)


async def swapper(url: str, deadline: float, every: float, versions: int, swaps: list[float]) -> None:
    async with aiohttp.ClientSession() as session:
        version = versions
        while time.monotonic() + every < deadline:
            await asyncio.sleep(every)
            version = version % versions + 1
            async with session.post(url + "/v1/live", json={"version": version}) as response:
                if response.status == 200:
                    swaps.append(time.time())


async def load(url: str, seconds: float, clients: int, swap_every: float | None, versions: int) -> dict:
    gaps: list[float] = []
    outcomes: list[bool] = []
    tokens = [0]
    swaps: list[float] = []
    deadline = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [client(session, url, deadline, gaps, outcomes, tokens, i) for i in range(clients)]
        if swap_every:
            tasks.append(swapper(url, deadline, swap_every, versions, swaps))
        begin = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    gaps.sort()
    return {"requests": len(outcomes), "failed": outcomes.count(False), "swaps": len(swaps),
            "tokens_per_s": tokens[0] / elapsed, "itl_p50_ms": 1000 * statistics.median(gaps),
            "itl_p99_ms": 1000 * gaps[int(0.99 * (len(gaps) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20, help="length of one slice")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--swap-every", type=float, default=3.0)
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--out", default="out/service_load.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specd-load.") as folder:
        summary, runs = measure(Path(folder), args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "clients": args.clients,
                                          "seconds": args.seconds, "swap_every": args.swap_every}, indent=2))
    print(json.dumps(summary, indent=2))


def measure(work: Path, args: argparse.Namespace) -> tuple[dict, dict]:
    prepare_store(work / "store", args.versions)
    servers = {name: SpecdProcess(["serve", "--store", str(work / "store"), "--no-learner", "--model-name", "bench",
                                   "--batch", str(args.clients), *extra], free_port(), work / f"{name}.log").start()
               for name, extra in (("records_on", []), ("records_off", ["--no-records"]))}
    # the machine is shared and noisy: alternate short slices of each condition, several rounds
    conditions = (("with_swaps", "records_on", args.swap_every), ("records_on", "records_on", None),
                  ("records_off", "records_off", None))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in conditions}
    try:
        for server in servers.values():
            asyncio.run(load(server.url, 5, args.clients, None, args.versions))  # warm-up
        for round_number in range(args.rounds):
            for name, server_name, swap_every in conditions:
                runs[name].append(asyncio.run(load(servers[server_name].url, args.seconds, args.clients, swap_every,
                                                   args.versions)))
            print(f"round {round_number + 1}: " + json.dumps({n: r[-1] for n, r in runs.items()}), flush=True)
    finally:
        for server in servers.values():
            server.stop()

    def median(name: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[name])

    summary = {
        "failed_requests_with_swaps": sum(r["failed"] for r in runs["with_swaps"]),
        "failed_requests_total": sum(r["failed"] for rs in runs.values() for r in rs),
        "swaps": sum(r["swaps"] for r in runs["with_swaps"]),
        "itl_p99_ratio_swaps_vs_none": median("with_swaps", "itl_p99_ms") / median("records_on", "itl_p99_ms"),
        "itl_p50_ratio_swaps_vs_none": median("with_swaps", "itl_p50_ms") / median("records_on", "itl_p50_ms"),
        "throughput_records_on_vs_off": median("records_on", "tokens_per_s") / median("records_off", "tokens_per_s"),
    }
    return summary, runs


if __name__ == "__main__":
    main()
