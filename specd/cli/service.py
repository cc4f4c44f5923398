"""`specd serve` and `specd learner`: the server (embedded learner by default) and the learner sidecar."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
from typing import Any

from specd.core.allocator import cap_malloc_arenas
from specd.core.arguments import at_least, fraction, non_negative_number, port_number, positive_number, pull_share
from specd.core.errors import ConfigurationError
from specd.core.listening import cannot_listen, check_address
from specd.drafter.factory import DrafterSpec
from specd.drafter.hybrid import WIDE_PASS_ROWS
from specd.engine.engine import EngineConfig
from specd.learner.config import LearnerConfig
from specd.model.target import LoadedTarget

log = logging.getLogger(__name__)

# continuations up to 8 drafts: the reach the vLLM route's context rows measured best
# (docs/measurements.md, "Context rows past EAGLE-3's k")
CONTEXT_K = 8


def add_drafter_flags(p: argparse.ArgumentParser, serving: bool = True) -> None:
    """The drafter's flags; `--context-k` (how far continuations reach when serving) only where `serving`."""
    p.add_argument("--drafter-kind", choices=["hybrid", "learned"], default="hybrid",
                   help="hybrid: context matches first, the learned drafter elsewhere (default); learned: only it")
    p.add_argument("--drafter-arch", choices=["feature", "token"], default="feature",
                   help="the learned drafter: feature (reads the target's hidden states; default) or token "
                        "(token ids only, for comparison)")
    p.add_argument("--from-scratch", action="store_true",
                   help="feature drafter: start from a fresh drafter, not the shipped pretrained version")
    if not serving:
        return
    p.add_argument("--context-k", type=at_least(1), default=None,
                   help="hybrid: the most drafts a context match or traffic-table continuation may propose in a "
                        "step, past k where larger, while the pass stays within "
                        f"{WIDE_PASS_ROWS} positions in all (default {CONTEXT_K}; the demo with a fixed -k: k)")


def drafter_spec(args: argparse.Namespace, **fields: Any) -> DrafterSpec:
    return DrafterSpec(kind=args.drafter_kind, arch=args.drafter_arch, pretrained=not args.from_scratch,
                       context_k=getattr(args, "context_k", None) or CONTEXT_K, **fields)



def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (embedded default: bundled target, learner inside)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000, help="port to listen on (default 8000; 0: any free one)")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--store", default=None, help="weight store directory (default: $SPECD_CACHE/store)")
    p.add_argument("-k", type=at_least(0), default=4,
                   help="most drafts of the learned drafter a step; the lookahead controller picks fewer where "
                        "they do not pay (default 4; 0: no speculation)")
    p.add_argument("--batch", type=at_least(1), default=8, help="most requests decoded together")
    p.add_argument("--max-context", type=at_least(2), default=4096,
                   help="prompt + output tokens per request; KV caches are sized for it (default 4096, "
                        "capped at the target's own limit)")
    p.add_argument("--prefill-chunk", type=at_least(0), default=EngineConfig.prefill_chunk,
                   help="prompt tokens prefilled per decoding step, so that a long prompt never stalls the "
                        f"running streams for its whole prefill (0: each prompt whole; default "
                        f"{EngineConfig.prefill_chunk})")
    p.add_argument("--max-queued", type=at_least(0), default=64,
                   help="requests waiting for a batch slot beyond which new ones get a 429 with Retry-After "
                        "(default 64; 0: no bound)")
    p.add_argument("--api-key", default=os.environ.get("SPECD_API_KEY"),
                   help="as vLLM's: the OpenAI routes answer only `Authorization: Bearer KEY` (default: "
                        "$SPECD_API_KEY; none: open)")
    p.add_argument("--shutdown-grace", type=non_negative_number, default=10.0, metavar="SECONDS",
                   help="how long a stopping server (SIGTERM, Ctrl+C) lets requests in flight finish before "
                        "ending them with a 503 (default 10)")
    p.add_argument("--no-learner", action="store_true",
                   help="serve the store's live version without training (and without records, unless --broker)")
    p.add_argument("--learner-mode", choices=("auto", "process", "thread"), default="auto",
                   help="where the embedded learner runs: a process pinned to cores of its own (the server keeps "
                        "the others), a thread of the server with --duty-cycle, or auto: a process on 2+ cores")
    p.add_argument("--no-records", action="store_true", help="publish no trajectory records (to measure their cost)")
    p.add_argument("--no-canary", action="store_true", help="embedded mode: never roll a version back automatically")
    p.add_argument("--no-traffic-table", action="store_true",
                   help="draft only from each request's own context and the learned drafter")
    add_drafter_flags(p)
    p.add_argument("--duty-cycle", type=fraction, default=0.5,
                   help="with --learner-mode thread: the learner's share of wall time (default 0.5)")
    p.add_argument("--server-id", default="specd-0", help="this server's name in records and on the dashboard")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target folder name)")
    _add_broker(p)
    p.add_argument("--learner-url", default=None, help="learner to fetch weights from (announcements name it too)")
    p.add_argument("--token", default=None,
                   help="bearer token for the embedded control plane's live, rollback and pin (or $SPECD_TOKEN)")
    p.set_defaults(run=run_serve)


def _add_broker(p: argparse.ArgumentParser, required: bool = False) -> None:
    # not argparse's required: its error would come before the rest of the line is checked, and
    # `specd learner` says what it needs in its own words
    p.add_argument("--broker", default=None, help="MQTT broker URL, e.g. mqtt://127.0.0.1:1883 "
                   + ("(required)" if required else "(sidecar mode)"))
    p.add_argument("--deployment", default="default", help="MQTT topic namespace (default: default)")
    p.add_argument("--tls-ca", default=None, help="CA file for an mqtts:// broker (default: system CAs)")
    p.add_argument("--tls-cert", default=None, help="client certificate file for an mqtts:// broker")
    p.add_argument("--tls-key", default=None, help="the client certificate's key file")


def _mqtt_settings(args: argparse.Namespace):
    from specd.transport.mqtt import MqttSettings

    if not args.broker:
        return None
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not os.path.isfile(path):  # found out up front, not as a traceback at every reconnect
            raise ConfigurationError(f"{flag} {path}: no such file")
    try:
        return MqttSettings.from_url(args.broker, args.deployment, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                                     tls_key=args.tls_key)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def add_learner_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("learner", help="the learner sidecar: MQTT records in, versions out, control plane over HTTP")
    p.add_argument("--store", required=True, help="weight store directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8100)
    p.add_argument("--public-url", default=None, help="URL servers use to fetch weights (default: http://host:port)")
    p.add_argument("--token", default=None, help="bearer token required by control operations (or $SPECD_TOKEN)")
    p.add_argument("--target", default=None)
    p.add_argument("-k", type=at_least(1), default=4)
    p.add_argument("--duty-cycle", type=fraction, default=0.5,
                   help="share of wall time spent training (default 0.5: servers may share the machine)")
    p.add_argument("--publish-every", type=positive_number, default=15.0,
                   help="seconds between candidates (default 15)")
    p.add_argument("--client-id", default="specd-learner", help="MQTT client id of the persistent session")
    p.add_argument("--spool-max-mb", type=positive_number, default=1024,
                   help="bound on the received-records spool on disk, in MiB (default 1024)")
    p.add_argument("--dedup-window", type=at_least(1), default=200_000,
                   help="recent record ids remembered to drop QoS 1 redeliveries (default 200000)")
    p.add_argument("--holdout-every", type=at_least(1), default=8,
                   help="hold every N-th record out of training, for the gate (default 8)")
    p.add_argument("--gate-min-held-out", type=at_least(1), default=4,
                   help="held-out records the gate needs before any candidate may pass (default 4)")
    p.add_argument("--gate-traffic-window", type=at_least(0), default=LearnerConfig.gate_traffic_window,
                   help="the gate weighs each domain's held-out records by its share of the newest N records "
                        f"(default {LearnerConfig.gate_traffic_window}; 0 weighs every held-out record alike)")
    p.add_argument("--gate-confidence", type=non_negative_number, default=LearnerConfig.gate_confidence_z,
                   help="standard errors the gate takes off a candidate's paired advantage on the held-out records "
                        f"before comparing it with the margin (default {LearnerConfig.gate_confidence_z:g}; "
                        "0 compares the accept lengths alone)")
    p.add_argument("--anchor-pull", type=pull_share, default=LearnerConfig.anchor_pull,
                   help="after every step each weight moves this share of the way back to the anchor "
                        f"(default {LearnerConfig.anchor_pull:g}; 0 is off)")
    p.add_argument("--anchor", choices=("start", "live"), default=LearnerConfig.anchor,
                   help="the anchor: the weights training started from, or also each version of the learner's "
                        f"own that goes live (default {LearnerConfig.anchor})")
    p.add_argument("--ranks", type=at_least(1), default=1,
                   help="data-parallel learner ranks on this machine, started by torchrun; records are shared "
                        "among them through an MQTT shared subscription (default 1: one learner process)")
    p.add_argument("--max-restarts", type=at_least(0), default=3,
                   help="with --ranks (ignored without): times torchrun restarts the group after a rank dies "
                        "(default 3)")
    p.add_argument("--rank-status-every", type=at_least(1), default=50,
                   help="with --ranks (ignored without): steps between the digests of each rank's weights in its "
                        "status file (default 50)")
    add_drafter_flags(p, serving=False)  # the learner trains the drafter; how far it reaches is the servers' flag
    _add_broker(p, required=True)
    p.set_defaults(run=run_learner)


def _spool_config(max_mb: float, dedup_window: int):
    from specd.learner.spool import SpoolConfig

    try:
        return SpoolConfig(max_bytes=int(max_mb * (1 << 20)), dedup_window=dedup_window)
    except ValueError as error:
        raise ConfigurationError(str(error)) from None


def run_learner(args: argparse.Namespace) -> int:
    import asyncio

    from specd.learner.ranks import RankGroup, RankInfo, launch_ranks
    from specd.learner.sidecar import SidecarOptions, build_sidecar, run_rank

    settings = _mqtt_settings(args)
    if settings is None:
        raise ConfigurationError("specd learner needs --broker mqtt://host:port")
    cap_malloc_arenas()  # before its threads and its ranks start (core/allocator.py says why)
    info = RankInfo.from_env()
    if info is None and args.ranks > 1:
        _check_before_ranks(args)  # a rank that fails on these would be restarted by torchrun, to no end
        return launch_ranks(args.ranks, args.max_restarts)  # torchrun runs this same command once per rank
    options = SidecarOptions(store=args.store, mqtt=settings, client_id=args.client_id,
                             public_url=args.public_url or f"http://{args.host}:{args.port}",
                             token=control_token(args), drafter=drafter_spec(args),
                             learner=LearnerConfig(k=args.k, duty_cycle=args.duty_cycle,
                                                   publish_every_seconds=args.publish_every,
                                                   holdout_every=args.holdout_every,
                                                   gate_min_held_out=args.gate_min_held_out,
                                                   gate_traffic_window=args.gate_traffic_window,
                                                   gate_confidence_z=args.gate_confidence,
                                                   anchor_pull=args.anchor_pull, anchor=args.anchor),
                             spool=_spool_config(args.spool_max_mb, args.dedup_window))
    group = RankGroup(info, status_folder=args.store, status_every=args.rank_status_every) if info else None
    if group is None or group.is_root:
        check_address(args.host, args.port)
    loaded = LoadedTarget.load(args.target)
    if group is not None and not group.is_root:
        asyncio.run(run_rank(options, loaded, group))
        return 0
    app = build_sidecar(options, loaded, group)
    listen(app, args.host, args.port)
    return 0


def _check_before_ranks(args: argparse.Namespace) -> None:
    """What would make every rank fail at start, said once: rank 0's address taken, the store or a
    rank's folder held by a learner still running (a plain one, a leftover rank); more ranks than cores."""
    from pathlib import Path

    from specd.learner.claim import claim

    check_address(args.host, args.port)
    store = Path(args.store)
    folders = {store, *(store / f"rank-{rank}" for rank in range(args.ranks)),
               *(path for path in store.glob("rank-*") if path.is_dir())}
    for folder in sorted(folders):
        claim(folder, "stop it, or give this learner another --store",
              per="store" if folder == store else "spool folder").release()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.ranks > cores:
        log.warning("%d ranks on %d cores: ranks share cores, and each step waits for the slowest", args.ranks, cores)


def control_token(args: argparse.Namespace) -> str | None:
    """--token, else $SPECD_TOKEN; without either the control plane's live, rollback and pin are
    open to whoever reaches the port, which is said aloud unless only this machine can."""
    token = args.token or os.environ.get("SPECD_TOKEN") or None
    if token is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no --token: anyone who reaches %s:%s can change the live drafter version "
                    "(POST /v1/live, /v1/rollback, /v1/pin)", args.host, args.port)
    return token


def run_serve(args: argparse.Namespace) -> int:
    from specd.serving.serve import ServeOptions, build_server

    if args.no_learner and args.learner_mode != "auto":
        raise ConfigurationError(f"--learner-mode {args.learner_mode} says where a learner runs, and --no-learner "
                                 f"that none does: give one of them")
    if args.broker and args.token:  # a sidecar server has no control routes: its learner's serve them
        raise ConfigurationError("--token guards the embedded control plane; with --broker the control plane is "
                                 "the learner's (specd learner --token)")
    check_address(args.host, args.port)
    cap_malloc_arenas()  # before its threads and its learner process start (core/allocator.py says why)
    options = ServeOptions(target=args.target, store=args.store, k=args.k, max_batch=args.batch,
                           max_context=args.max_context, max_queued=args.max_queued or None,
                           api_key=args.api_key or None, shutdown_grace_s=args.shutdown_grace,
                           prefill_chunk=args.prefill_chunk or None,
                           learner=not args.no_learner, learner_mode=args.learner_mode, duty_cycle=args.duty_cycle,
                           server_id=args.server_id,
                           model_name=args.model_name, mqtt=_mqtt_settings(args), learner_url=args.learner_url,
                           token=None if args.broker else control_token(args),
                           publish_records=not args.no_records, canary=not args.no_canary,
                           drafter=drafter_spec(args, traffic_table=not args.no_traffic_table))
    listen(build_server(options), args.host, args.port)
    return 0


def listen(app: Any, host: str, port: int) -> None:
    """Serve `app` until stopped; an address that cannot be bound (in use, not this machine's, a
    privileged port) is a clear error, not a traceback. Startup hooks have run by then, and
    aiohttp runs the cleanup ones (learner, broker clients) before the error reaches the CLI."""
    from aiohttp import web

    try:
        # handlers have had their grace (the app's own shutdown hook) before aiohttp waits for them
        web.run_app(app, host=host, port=port, shutdown_timeout=5.0, print=lambda line: print(line, flush=True))
    except socket.gaierror as error:  # a host name that does not resolve
        raise cannot_listen(host, port, error) from None
    except OSError as error:
        if error.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise cannot_listen(host, port, error) from None
