"""The `specd` command line.

Contract: every subcommand either does its job or prints one line `specd: error: <reason>` to
stderr and exits 2; a traceback is never the answer to bad input. `--json` output is one JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from specd.core.errors import ConfigurationError, SpecdError, StoreError, TransportError, VersionNotFound
from specd.drafter.base import Drafter
from specd.drafter.checkpoint import load_drafter
from specd.drafter.factory import DrafterSpec, build_drafter
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.greedy_recording import record_greedy
from specd.engine.request import SamplingParams
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.model.target import DTYPES, LoadedTarget
from specd.serving.vllm.shared.command import add_vllm_parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="decode one prompt with speculative decoding")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--drafter", default="random",
                   help="a drafter checkpoint file, or random | replay | none (default: random)")
    p.add_argument("-k", type=int, default=4, help="drafts per step (default: 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_generate)


def _build_drafter(choice: str, loaded: LoadedTarget, prompt_ids: list[int], params: SamplingParams,
                   dtype: str, device: str) -> Drafter | None:
    if choice == "none":
        return None
    if choice == "random":
        shape = DrafterShape.like(loaded.model.config)
        return TokenDrafter(new_drafter_model(loaded.model, shape, copy_from_target=True, seed=params.seed or 0))
    if choice == "replay":
        return record_greedy(loaded.model, [prompt_ids], params.max_tokens, loaded.eos_token_ids, max_batch=1)
    path = Path(choice)
    if not path.is_file():
        raise ConfigurationError(f"--drafter {choice!r}: not a file, and not one of random, replay, none")
    model = load_drafter(path, loaded.fingerprint, DTYPES[dtype], device, target_embedding=loaded.model.embed.weight)
    return build_drafter(DrafterSpec(kind="learned"), model, path.stem)


def run_generate(args: argparse.Namespace) -> int:
    loaded = LoadedTarget.load(args.target, args.dtype, args.device)
    prompt_ids = loaded.encode(args.prompt, chat=args.chat)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    drafter = _build_drafter(args.drafter, loaded, prompt_ids, params, args.dtype, args.device)
    engine = Engine(loaded.model, drafter, EngineConfig(max_batch=1, num_draft_tokens=args.k,
                                                        eos_token_ids=loaded.eos_token_ids))
    seq = engine.add_request(prompt_ids, params)
    begin = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - begin
    text = loaded.decode(seq.output_ids)
    result = {
        "text": text,
        "token_ids": seq.output_ids,
        "finish_reason": seq.finish_reason,
        "drafter": args.drafter,
        "k": engine.k,
        "accept_length": round(seq.accept_length, 4),
        "acceptance_rate": round(seq.acceptance_rate, 4),
        "target_passes": seq.num_target_passes,
        "tokens_per_s": round(seq.num_output_tokens / seconds, 2),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(text)
        print(f"\n[{seq.num_output_tokens} tokens, {result['tokens_per_s']} tok/s, accept length "
              f"{result['accept_length']}, acceptance {result['acceptance_rate']:.1%}, "
              f"{seq.num_target_passes} target passes]", file=sys.stderr)
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="replay traffic with a shift: adaptive vs static vs no speculation")
    p.add_argument("--traffic", default=None, help="JSONL traffic file (default: ShareGPT then HumanEval)")
    p.add_argument("--requests", type=int, default=40, help="requests to replay (default 40)")
    p.add_argument("--max-tokens", type=int, default=64, help="output budget per request (default 64)")
    p.add_argument("--batch", type=int, default=4, help="requests decoded together (default 4)")
    p.add_argument("-k", type=int, default=None,
                   help="fix k drafts per step (for drafter comparisons: accept length then measures the drafter); "
                        "default: the lookahead controller picks k per step, up to 4 (the faster setting here)")
    p.add_argument("--round-size", type=int, default=4,
                   help="requests per mode per round: the modes take turns, round by round (default 4)")
    p.add_argument("--learner", choices=["process", "thread", "off"], default="process",
                   help="process: its own process on cores of its own where there are two or more (default); "
                        "thread: beside serving, on the same cores; off: no learning (adaptive = static)")
    p.add_argument("--duty-cycle", type=float, default=0.5,
                   help="a learner thread's share of wall time (default 0.5; a process trains all the time)")
    _add_drafter_flags(p)
    p.add_argument("--adaptive-k", action="store_true", help="with -k N: let the controller pick k per step, up to N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None)
    p.add_argument("--json-out", default="out/demo.json")
    p.add_argument("--plot-out", default="out/demo.png")
    p.add_argument("--store", default=None, help="weight store directory (default: a temporary one)")
    p.set_defaults(run=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    from specd.core.traffic import default_held_out, default_shift_traffic, load_jsonl
    from specd.demo.deployment import DEMO_LEARNER, DemoConfig, plot, run_demo

    if args.requests < 2:
        raise ConfigurationError("--requests must be at least 2 (one per domain)")
    if args.round_size < 1:
        raise ConfigurationError("--round-size must be at least 1")
    if args.traffic:
        items, held_out = load_jsonl(args.traffic)[:args.requests], None
    else:
        items = default_shift_traffic(args.requests, args.seed)
        held_out = default_held_out(args.requests, args.seed)
    loaded = LoadedTarget.load(args.target)
    k = args.k or 4
    config = DemoConfig(max_tokens=args.max_tokens, max_batch=args.batch, k=k, seed=args.seed,
                        adaptive_lookahead=args.k is None or args.adaptive_k, drafter=_drafter_spec(args),
                        round_size=args.round_size, learner_process=args.learner == "process",
                        learning=args.learner != "off",
                        learner=replace(DEMO_LEARNER, duty_cycle=args.duty_cycle, k=k, seed=args.seed))
    result = run_demo(loaded, items, config, Path(args.store) if args.store else None, held_out=held_out)
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    plot(result, Path(args.plot_out))
    print_demo(result)
    print(f"wrote {args.json_out} and {args.plot_out}")
    return 0


def print_demo(result: dict[str, Any]) -> None:
    from specd.demo.deployment import MODES

    by_domain = result["rounds"]["by_domain"]
    print(f"\n{'mode':9} {'domain':10} {'requests':>8} {'accept len':>10} {'acceptance':>10} {'tok/s':>7} "
          f"{'tok/s per round: median (min-max)':>34}")
    for mode in MODES:
        for domain, row in result["summary"][mode].items():
            spread = by_domain[domain]["tokens_per_s"][mode]
            print(f"{mode:9} {domain:10} {row['requests']:8d} {row['accept_length']:10.2f} "
                  f"{row['acceptance_rate']:10.1%} {row['tokens_per_s']:7.1f} "
                  f"{spread['median']:17.1f} ({spread['min']:.1f}-{spread['max']:.1f})")
    print("\nper-round ratios, median (min-max):")
    for domain, figures in by_domain.items():
        cells = [f"{name} {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" for name, r in figures["ratios"].items()]
        print(f"  {domain} ({figures['rounds']} rounds): " + "; ".join(cells))
    learner, swaps = result["learner"], result["swaps"]
    print(f"\nlossless (greedy outputs equal to no speculation): {result['lossless']}")
    print(f"static = version {result['static_version']}; {swaps['applied']} swaps; versions serving after the "
          f"shift: {', '.join(swaps['versions_live_after_shift'])}")
    print(f"learner ({learner['arrangement']}, cores {learner.get('cores')}): {learner['steps']} steps, "
          f"{learner['tokens_trained']} tokens trained, {len(learner['published'])} versions passed the gate, "
          f"{learner.get('rejected', 0)} rejected, {learner.get('cpu_seconds')} CPU s")
    for point in result["adaptation"] or []:
        print(f"  version {point['version']:>3} ({point['status']}): after {point['records_after_shift']:>3} "
              f"records of the new domain, held-out accept length {point['accept_length']:.2f}")


def _add_drafter_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-kind", choices=["hybrid", "learned"], default="hybrid",
                   help="hybrid: context matches first, the learned drafter elsewhere (default); learned: only it")
    p.add_argument("--drafter-arch", choices=["feature", "token"], default="feature",
                   help="the learned drafter: feature (reads the target's hidden states; default) or token "
                        "(token ids only, for comparison)")
    p.add_argument("--from-scratch", action="store_true",
                   help="feature drafter: start from a fresh drafter, not the shipped pretrained version")


def _drafter_spec(args: argparse.Namespace, **fields: bool) -> DrafterSpec:
    return DrafterSpec(kind=args.drafter_kind, arch=args.drafter_arch, pretrained=not args.from_scratch, **fields)


def _where(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="weight store directory")
    where.add_argument("--url", help="a running learner (or embedded server), e.g. http://127.0.0.1:8100")
    p.add_argument("--token", default=None, help="bearer token for control operations (or $SPECD_TOKEN)")


def _add_store_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("versions", help="list drafter versions")
    _where(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_versions)
    p = sub.add_parser("rollback", help="make an earlier version live again")
    p.add_argument("version", nargs="?", type=int, help="version to restore (default: the previous live one)")
    _where(p)
    p.set_defaults(run=run_rollback)
    p = sub.add_parser("pin", help="keep a version forever, as a floor to fall back to")
    p.add_argument("version", type=int)
    _where(p)
    p.add_argument("--unpin", action="store_true")
    p.set_defaults(run=run_pin)
    p = sub.add_parser("status", help="live version, learner and store status")
    _where(p)
    p.set_defaults(run=run_status)


def _open_store(path: str) -> WeightStore:
    if not Path(path, "versions").is_dir():
        raise StoreError(f"{path}: not a specd weight store (no versions/ folder)")
    return WeightStore(path)


def _http(args: argparse.Namespace, path: str, body: dict | None = None) -> dict:
    """GET (or POST with a JSON body) against a learner's control plane.

    An error answer becomes the SpecdError of its status (404: VersionNotFound, other 4xx: StoreError,
    401: ConfigurationError, a missing token); no answer at all is a TransportError.
    """
    import os
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    token = args.token or os.environ.get("SPECD_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return dict(json.loads(response.read()))
    except urllib.error.HTTPError as error:
        try:
            message = json.loads(error.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = error.reason
        kind: type[SpecdError] = {401: ConfigurationError, 404: VersionNotFound}.get(error.code, StoreError)
        if error.code >= 500:
            kind = TransportError
        raise kind(f"{args.url}{path}: {error.code} {message}") from None
    except (urllib.error.URLError, OSError) as error:
        raise TransportError(f"{args.url}: unreachable ({error})") from None


def run_status(args: argparse.Namespace) -> int:
    if args.url:
        print(json.dumps(_http(args, "/v1/status"), indent=2))
        return 0
    store = _open_store(args.store)
    print(json.dumps({"live": store.live_version(), "versions": len(store.versions()),
                      "history": store.live_state()["history"]}, indent=2))
    return 0


def run_versions(args: argparse.Namespace) -> int:
    if args.url:
        listing = _http(args, "/v1/versions")
        live, manifests = listing["live"], listing["versions"]
    else:
        store = _open_store(args.store)
        live, manifests = store.live_version(), [store.manifest(v) for v in store.versions()]
    if args.json:
        print(json.dumps({"live": live, "versions": manifests}))
        return 0
    print(f"live: {live}")
    print(f"{'version':>7}  {'status':11} {'pinned':6} {'parent':>6}  {'accept len (cand/live)':22} created")
    for m in manifests:
        evaluation = m.get("evaluation") or {}
        scores = f"{evaluation.get('candidate') or '-'}/{evaluation.get('live') or '-'}"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["created"]))
        print(f"{m['version']:>7}  {m['status']:11} {'yes' if m.get('pinned') else '':6} "
              f"{m.get('parent') or '-':>6}  {scores:22} {created}")
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    if args.url:
        restored = _http(args, "/v1/rollback", {"version": args.version})["live"]
    else:
        restored = _open_store(args.store).rollback(args.version, {"by": "operator"})
    print(f"version {restored} is live")
    return 0


def run_pin(args: argparse.Namespace) -> int:
    if args.url:
        _http(args, "/v1/pin", {"version": args.version, "pinned": not args.unpin})
    else:
        _open_store(args.store).pin(args.version, not args.unpin)
    print(f"version {args.version} {'unpinned' if args.unpin else 'pinned'}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (embedded default: bundled target, learner inside)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--target", default=None)
    p.add_argument("--store", default=None, help="weight store directory (default: $SPECD_CACHE/store)")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="most requests decoded together")
    p.add_argument("--max-context", type=int, default=4096,
                   help="prompt + output tokens per request; KV caches are sized for it (default 4096, "
                        "capped at the target's own limit)")
    p.add_argument("--max-queued", type=int, default=64,
                   help="requests waiting for a batch slot beyond which new ones get a 429 with Retry-After "
                        "(default 64; 0: no bound)")
    p.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"),
                   help="as vLLM's: the OpenAI routes answer only `Authorization: Bearer KEY` (default: "
                        "$SPECD_API_KEY; none: open)")
    p.add_argument("--no-learner", action="store_true", help="serve the store's live version without training")
    p.add_argument("--learner-mode", choices=("auto", "process", "thread"), default="auto",
                   help="where the embedded learner runs: a process pinned to cores of its own (the server keeps "
                        "the others), a thread of the server with --duty-cycle, or auto: a process on 2+ cores")
    p.add_argument("--no-records", action="store_true", help="publish no trajectory records (to measure their cost)")
    p.add_argument("--no-canary", action="store_true", help="embedded mode: never roll a version back automatically")
    p.add_argument("--no-traffic-table", action="store_true",
                   help="draft only from each request's own context and the learned drafter")
    _add_drafter_flags(p)
    p.add_argument("--duty-cycle", type=float, default=0.5)
    p.add_argument("--server-id", default="specd-0")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target folder name)")
    _add_broker(p)
    p.add_argument("--learner-url", default=None, help="learner to fetch weights from (announcements name it too)")
    p.add_argument("--token", default=None, help="bearer token for the embedded control plane")
    p.set_defaults(run=run_serve)


def _add_broker(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", default=None, help="MQTT broker URL, e.g. mqtt://127.0.0.1:1883 (sidecar mode)")
    p.add_argument("--deployment", default="default", help="MQTT topic namespace (default: default)")
    p.add_argument("--tls-ca", default=None, help="CA file for an mqtts:// broker (default: system CAs)")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)


def _mqtt_settings(args: argparse.Namespace):
    from specd.transport.mqtt import MqttSettings

    if not args.broker:
        return None
    try:
        return MqttSettings.from_url(args.broker, args.deployment, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                     tls_key=args.tls_key)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def _add_learner(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("learner", help="the learner sidecar: MQTT records in, versions out, control plane over HTTP")
    p.add_argument("--store", required=True, help="weight store directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--public-url", default=None, help="URL servers use to fetch weights (default: http://host:port)")
    p.add_argument("--token", default=None, help="bearer token required by control operations (or $SPECD_TOKEN)")
    p.add_argument("--target", default=None)
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--duty-cycle", type=float, default=0.5,
                   help="share of wall time spent training (default 0.5: servers may share the machine)")
    p.add_argument("--publish-every", type=float, default=15.0, help="seconds between candidates (default 15)")
    p.add_argument("--client-id", default="specd-learner", help="MQTT client id of the persistent session")
    p.add_argument("--spool-max-mb", type=float, default=1024,
                   help="bound on the received-records spool on disk, in MiB (default 1024)")
    p.add_argument("--dedup-window", type=int, default=200_000,
                   help="recent record ids remembered to drop QoS 1 redeliveries (default 200000)")
    p.add_argument("--holdout-every", type=int, default=8,
                   help="hold every N-th record out of training, for the gate (default 8)")
    p.add_argument("--gate-min-held-out", type=int, default=4,
                   help="held-out records the gate needs before any candidate may pass (default 4)")
    _add_drafter_flags(p)
    _add_broker(p)
    p.set_defaults(run=run_learner)


def _spool_config(max_mb: float, dedup_window: int):
    from specd.learner.spool import SpoolConfig

    try:
        return SpoolConfig(max_bytes=int(max_mb * (1 << 20)), dedup_window=dedup_window)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def run_learner(args: argparse.Namespace) -> int:
    import os

    from aiohttp import web

    from specd.learner.sidecar import SidecarOptions, build_sidecar

    settings = _mqtt_settings(args)
    if settings is None:
        raise ConfigurationError("specd learner needs --broker mqtt://host:port")
    options = SidecarOptions(store=args.store, mqtt=settings, client_id=args.client_id,
                             public_url=args.public_url or f"http://{args.host}:{args.port}",
                             token=args.token or os.environ.get("SPECD_TOKEN"), drafter=_drafter_spec(args),
                             learner=LearnerConfig(k=args.k, duty_cycle=args.duty_cycle,
                                                   publish_every_seconds=args.publish_every,
                                                   holdout_every=args.holdout_every,
                                                   gate_min_held_out=args.gate_min_held_out),
                             spool=_spool_config(args.spool_max_mb, args.dedup_window))
    app = build_sidecar(options, LoadedTarget.load(args.target))
    web.run_app(app, host=args.host, port=args.port, print=lambda line: print(line, flush=True))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from specd.serving.serve import ServeOptions, build_server

    if args.max_queued < 0:
        raise ConfigurationError(f"--max-queued must be 0 (no bound) or more, got {args.max_queued}")
    options = ServeOptions(target=args.target, store=args.store, k=args.k, max_batch=args.batch,
                           max_context=args.max_context, max_queued=args.max_queued or None, api_key=args.api_key,
                           learner=not args.no_learner, learner_mode=args.learner_mode, duty_cycle=args.duty_cycle,
                           server_id=args.server_id,
                           model_name=args.model_name, mqtt=_mqtt_settings(args), learner_url=args.learner_url,
                           token=args.token, publish_records=not args.no_records, canary=not args.no_canary,
                           drafter=_drafter_spec(args, traffic_table=not args.no_traffic_table))
    web.run_app(build_server(options), host=args.host, port=args.port, print=lambda line: print(line, flush=True))
    return 0


# `specd pretrain` flags and the PretrainConfig fields they set (None: the recipe's value)
PRETRAIN_FLAGS = {"data": "data", "conversations": "conversations", "max_length": "max_length",
                  "draft_vocab": "draft_vocab", "steps": "steps", "batch": "batch_size", "lr": "learning_rate",
                  "unroll": "unroll", "objective": "objective", "eval_every": "eval_every", "seed": "seed",
                  "max_seconds": "max_seconds"}


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    from specd.offline.pretrain import RECIPES

    p = sub.add_parser("pretrain", help="train a feature drafter offline (by default on the target's own responses)")
    p.add_argument("--out", required=True, help="the version file to write (a .json manifest goes beside it)")
    p.add_argument("--work", required=True, help="work folder: generated data, features, checkpoints; rerun to resume")
    p.add_argument("--target", default=None)
    p.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                   help="a named recipe (shipped: the bundled drafter's); the flags below override it")
    p.add_argument("--data", choices=["distilled", "sharegpt"], default=None,
                   help="distilled: the target's own responses (default); sharegpt: ShareGPT's own text")
    p.add_argument("--conversations", type=int, default=None, help="sharegpt: conversations read")
    p.add_argument("--max-length", type=int, default=None, help="sharegpt: tokens kept per conversation")
    p.add_argument("--draft-vocab", type=int, default=None, help="ids the output head covers")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="examples per step")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--unroll", type=int, default=None, help="drafting steps trained per position")
    p.add_argument("--objective", choices=["kl", "accept"], default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--max-seconds", type=float, default=None, help="stop training after this many training seconds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(run=run_pretrain)


def pretrain_config(args: argparse.Namespace):
    """The recipe (or the defaults) with the flags given on the command line in place of its values."""
    from dataclasses import replace

    from specd.offline.pretrain import PretrainConfig, recipe

    overrides = {name: getattr(args, flag) for flag, name in PRETRAIN_FLAGS.items() if getattr(args, flag) is not None}
    try:
        return recipe(args.recipe, **overrides) if args.recipe else replace(PretrainConfig(), **overrides)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def run_pretrain(args: argparse.Namespace) -> int:
    import shlex

    import torch

    from specd.offline.pretrain import pretrain

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.getLogger("specd").setLevel(logging.INFO)
    config = pretrain_config(args)
    command = "specd " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    manifest = pretrain(LoadedTarget.load(args.target), config, Path(args.work), Path(args.out), command)
    held_out = manifest["held_out"]
    print(f"wrote {args.out}: held-out accept length {held_out['accept_length']:.3f} on evaluation prompts "
          f"(validation {held_out['validation']['accept_length']:.3f}, k = {held_out['k']}) after "
          f"{manifest['steps']} steps, {manifest['tokens_trained']} tokens")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_demo(sub)
    _add_store_commands(sub)
    _add_serve(sub)
    _add_learner(sub)
    _add_pretrain(sub)
    add_vllm_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.run(args))
    except SpecdError as error:  # every failure a person can fix; anything else is a bug and shows as one
        print(f"specd: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
