"""The service under load: hot-swaps and record publishing, interleaved (SmolLM2, embedded `specd serve`).

Two `specd serve` processes, each with its own copy of the same weight store (versions 1..V of a
random day-0 drafter), all --no-canary (this measures swaps, not rollbacks), --no-learner (the
learner's own CPU use stays out) and --no-traffic-table (a table that learns the repeated
prompts would make later slices faster than earlier ones). Conditions, `--repeats` rounds,
interleaved (A B C, B C A, ...), each a slice of `--seconds` of `--clients` concurrent streaming clients:
- `with_swaps`: server A, its live version changed every `--swap-every` s (POST /v1/live);
- `records_on`: server A, no swaps (trajectory records published, as in production);
- `records_off`: server B, `--no-records`.
Tokens are tokens: before measuring, each server answers every prompt once non-streamed, and a
streamed answer counts its prompt's `usage.completion_tokens` (greedy decoding is lossless, so the
streamed answer has the same tokens; each streamed text is checked against it and mismatches are
counted). Per slice: failed requests, tokens/s, time to first token (TTFT, from sending the request
to the first content chunk), inter-chunk latency (ITL: gaps between content chunks after the
first; one chunk is one engine step's tokens) and time per output token (TPOT: (last − first
chunk) / (tokens − 1) per request). Goals: no failed request; ITL p99 with swaps / without ≤ 1.1;
tokens/s with records / without within 3%. Ratios are per round, then median and min–max.
Writes out/service_load.json.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from common import cell, dot_plot, field_spreads, interleaved, markdown_table, paired, parser, write_result

from specd.drafter.factory import DrafterSpec, initial_model
from specd.hotswap.store import WeightStore
from specd.model.target import LoadedTarget
from specd.testing.processes import SpecdProcess, free_port

PROMPTS = ["Write a haiku about the sea.", "What is recursion?", "List three fruits.", "Explain DNS briefly.",
           "Describe a cat.", "How do planes fly?", "Give me a pasta recipe.", "What is entropy?"]
FIELDS = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
          "requests", "failed", "swaps", "text_mismatches")


def prepare_store(folder: Path, versions: int) -> None:
    loaded = LoadedTarget.load(None)
    store = WeightStore(folder, keep_last=100)
    for seed in range(versions):
        version = store.publish(initial_model(loaded.model, DrafterSpec(), seed=seed), loaded.fingerprint,
                                store.live_version(), {})
        store.set_live(version)


def body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


async def references(url: str, max_tokens: int) -> dict[str, dict[str, Any]]:
    """Each prompt answered once, non-streamed: its text and usage.completion_tokens."""
    async with aiohttp.ClientSession() as session:
        async def one(prompt: str) -> tuple[str, dict[str, Any]]:
            async with session.post(url + "/v1/chat/completions", json=body(prompt, max_tokens, False)) as response:
                answer = await response.json()
            return prompt, {"text": answer["choices"][0]["message"]["content"],
                            "tokens": answer["usage"]["completion_tokens"]}
        return dict(await asyncio.gather(*(one(p) for p in PROMPTS)))


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request: arrival times of its content chunks and its text."""
    sent = time.perf_counter()
    times: list[float] = []
    pieces: list[str] = []
    async with session.post(url + "/v1/chat/completions", json=body(prompt, max_tokens, True)) as response:
        if response.status != 200:
            return {"ok": False}
        async for line in response.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
            if piece:
                times.append(time.perf_counter())
                pieces.append(piece)
    return {"ok": True, "sent": sent, "times": times, "text": "".join(pieces)}


async def client(session: aiohttp.ClientSession, url: str, deadline: float, max_tokens: int, index: int,
                 answers: list[dict[str, Any]]) -> None:
    n = index
    while time.monotonic() < deadline:
        prompt = PROMPTS[n % len(PROMPTS)]
        n += 3
        try:
            answers.append({"prompt": prompt, **await stream_one(session, url, prompt, max_tokens)})
        except (TimeoutError, aiohttp.ClientError):
            answers.append({"prompt": prompt, "ok": False})


async def swapper(url: str, deadline: float, every: float, versions: int, swaps: list[float]) -> None:
    async with aiohttp.ClientSession() as session:
        version = versions
        while time.monotonic() + every < deadline:
            await asyncio.sleep(every)
            version = version % versions + 1
            async with session.post(url + "/v1/live", json={"version": version}) as response:
                if response.status == 200:
                    swaps.append(time.time())


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return 1000 * values[round(q * (len(values) - 1))] if values else None


def slice_metrics(answers: list[dict[str, Any]], reference: dict[str, dict[str, Any]], elapsed: float,
                  swaps: int) -> dict[str, Any]:
    ok = [a for a in answers if a["ok"] and a["times"]]
    tokens = sum(reference[a["prompt"]]["tokens"] for a in ok)
    ttft = [a["times"][0] - a["sent"] for a in ok]
    gaps = [later - earlier for a in ok for earlier, later in zip(a["times"], a["times"][1:], strict=False)]
    tpot = [(a["times"][-1] - a["times"][0]) / (reference[a["prompt"]]["tokens"] - 1)
            for a in ok if reference[a["prompt"]]["tokens"] > 1]
    return {"requests": len(answers), "failed": len(answers) - len(ok), "swaps": swaps, "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "text_mismatches": sum(a["text"] != reference[a["prompt"]]["text"] for a in ok),
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "itl_p50_ms": percentile(gaps, 0.5), "itl_p99_ms": percentile(gaps, 0.99),
            "tpot_p50_ms": percentile(tpot, 0.5), "tpot_p99_ms": percentile(tpot, 0.99)}


async def load(url: str, reference: dict[str, dict[str, Any]], args: Any, swap_every: float | None) -> dict[str, Any]:
    answers: list[dict[str, Any]] = []
    swaps: list[float] = []
    deadline = time.monotonic() + args.seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [client(session, url, deadline, args.max_tokens, i, answers) for i in range(args.clients)]
        if swap_every:
            tasks.append(swapper(url, deadline, swap_every, args.versions, swaps))
        begin = time.perf_counter()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
    return slice_metrics(answers, reference, elapsed, len(swaps))


def measure(work: Path, args: Any) -> dict[str, Any]:
    prepare_store(work / "store-a", args.versions)
    shutil.copytree(work / "store-a", work / "store-b")  # each server its own store, the same versions
    common = ["--no-learner", "--no-canary", "--no-traffic-table", "--model-name", "bench",
              "--batch", str(args.clients)]
    servers = {"a": SpecdProcess(["serve", "--store", str(work / "store-a"), *common], free_port(),
                                 work / "a.log").start(),
               "b": SpecdProcess(["serve", "--store", str(work / "store-b"), "--no-records", *common], free_port(),
                                 work / "b.log").start()}
    try:
        refs = {name: asyncio.run(references(s.url, args.max_tokens)) for name, s in servers.items()}  # + warm-up
        a, b = servers["a"].url, servers["b"].url
        runs = interleaved({"with_swaps": lambda _: asyncio.run(load(a, refs["a"], args, args.swap_every)),
                            "records_on": lambda _: asyncio.run(load(a, refs["a"], args, None)),
                            "records_off": lambda _: asyncio.run(load(b, refs["b"], args, None))}, args.repeats)
    finally:
        for server in servers.values():
            server.stop()
    return {
        "runs": runs,
        "summary": field_spreads(runs, FIELDS),
        "ratios": {"itl_p99_swaps_vs_none": paired(runs, "with_swaps", "records_on", "itl_p99_ms"),
                   "itl_p50_swaps_vs_none": paired(runs, "with_swaps", "records_on", "itl_p50_ms"),
                   "tpot_p99_swaps_vs_none": paired(runs, "with_swaps", "records_on", "tpot_p99_ms"),
                   "tokens_per_s_records_on_vs_off": paired(runs, "records_on", "records_off", "tokens_per_s")},
        "failed_requests_total": sum(r["failed"] for rs in runs.values() for r in rs),
        "swaps_total": sum(r["swaps"] for r in runs["with_swaps"]),
        "servers_agree": refs["a"] == refs["b"],
    }


def main() -> None:
    p = parser(__doc__, "out/service_load.json", repeats=3)
    p.add_argument("--seconds", type=float, default=20, help="length of one slice")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--swap-every", type=float, default=3.0)
    p.add_argument("--versions", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="specd-load.") as folder:
        result = measure(Path(folder), args)
    write_result(args.out, args, result)
    print(markdown(result, Path(args.out).parent))


def markdown(result: dict[str, Any], out: Path) -> str:
    s = result["summary"]
    rows = [[name, cell(v["tokens_per_s"]), cell(v["ttft_p50_ms"], 0), cell(v["ttft_p99_ms"], 0),
             cell(v["itl_p50_ms"], 0), cell(v["itl_p99_ms"], 0), cell(v["tpot_p50_ms"], 0),
             cell(v["tpot_p99_ms"], 0), f"{sum(r['requests'] for r in result['runs'][name])}",
             f"{sum(r['failed'] for r in result['runs'][name])}",
             f"{sum(r['text_mismatches'] for r in result['runs'][name])}"] for name, v in s.items()]
    text = markdown_table(["condition", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                           "TPOT p50 ms", "TPOT p99 ms", "requests", "failed", "text ≠ reference"], rows)
    r = result["ratios"]
    ratio_rows = [["ITL p99, swaps / no swaps", cell(r["itl_p99_swaps_vs_none"], 2), "≤ 1.10"],
                  ["ITL p50, swaps / no swaps", cell(r["itl_p50_swaps_vs_none"], 2), "–"],
                  ["TPOT p99, swaps / no swaps", cell(r["tpot_p99_swaps_vs_none"], 2), "–"],
                  ["tokens/s, records on / off", cell(r["tokens_per_s_records_on_vs_off"], 3), "0.97–1.03"]]
    text += "\n\n" + markdown_table(["per-round ratio", "median (min–max)", "goal"], ratio_rows)
    text += (f"\n\nSwaps taken: {result['swaps_total']}; failed requests in all slices: "
             f"{result['failed_requests_total']}; the two servers' reference answers agree: "
             f"{result['servers_agree']}.")
    groups = {field: {name: [x[field] for x in rs] for name, rs in result["runs"].items()}
              for field in ("tokens_per_s", "itl_p99_ms", "tpot_p50_ms")}
    path = dot_plot(groups, "service under load (each dot one slice)", "", out / "service_load.png")
    text += f"\n\n![service load]({path.name})"
    return text


if __name__ == "__main__":
    main()
