"""How specd's proposer is configured inside vLLM, and the vLLM command line that runs it.

Contract: vLLM builds its proposer from its own config only, so specd's settings travel as
environment variables (`SPECD_*`, listed in `PluginSettings`), which vLLM's worker processes
inherit. `PluginSettings.from_env` reads and checks them (a bad value raises `ConfigurationError`
naming the variable); `to_env` writes them back. Two routes (`SPECD_ROUTE`): "eagle3" (vLLM's own
EAGLE-3 proposer serving the feature drafter from an exported folder, specd's plugin around it)
and "custom" (specd's `custom_class` proposer with the token-level hybrid drafter).
`vllm_command` returns the exact environment and argv of `python -m
vllm.entrypoints.openai.api_server` for either, with specd's worker extension (for `POST
/collective_rpc`) and per-request spec-decode metrics switched on.
Temporary folders (the EAGLE-3 export here, the worker's weight cache in `worker_loop`) come from
`temporary_folder`: each names its owner process, and a later one of the same kind removes those
whose owner is gone. The worker's cache is also removed when the worker exits. The export is
not: vLLM reads it after `specd vllm` has exec'd into vLLM's server (the process id, so the
owner, stays the same), and `--print` hands it to a command run later; it goes once its owner
(vLLM's server, or the printing process) has ended and the next export is made.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing.util
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specd.core.errors import ConfigurationError, SpecdError
from specd.transport.mqtt import MqttSettings

log = logging.getLogger(__name__)

PROPOSER_CLASS = "specd.serving.vllm.custom.proposer.SpecdProposer"
ROUTES = ("eagle3", "custom")
DRAFTER_GEMMS = ("auto", "bfloat16", "float16", "native")
WORKER_EXTENSION = "specd.serving.vllm.shared.extension.SpecdWorkerExtension"


@dataclass(frozen=True)
class PluginSettings:
    broker: str | None = None          # SPECD_BROKER: mqtt:// URL; records and reports go there, versions come from it
    deployment: str = "default"        # SPECD_DEPLOYMENT: the MQTT topic namespace, as for `specd serve`
    learner_url: str | None = None     # SPECD_LEARNER_URL: where to fetch weights before an announcement names one
    store: str | None = None           # SPECD_STORE: a local weight store to follow instead (no broker needed)
    version: int | None = None         # SPECD_VERSION: serve this version and never swap (a static drafter)
    server_id: str = "vllm-0"          # SPECD_SERVER_ID
    domain: str | None = None          # SPECD_DOMAIN: traffic domain named in records and reports
    drafter_kind: str = "hybrid"       # SPECD_DRAFTER: hybrid (context matches first) or learned
    drafter_layers: int = 1            # SPECD_DRAFTER_LAYERS: shape of the drafter used before any version arrives
    drafter_head_vocab: int = 8192     # SPECD_DRAFTER_HEAD_VOCAB
    traffic_table: bool = True         # SPECD_TRAFFIC_TABLE: 0 turns off continuations learned across requests
    report_seconds: float = 2.0        # SPECD_REPORT_SECONDS
    cache: str | None = None           # SPECD_CACHE_DIR: where fetched versions are kept (default: a temp folder)
    route: str = "eagle3"              # SPECD_ROUTE: eagle3 (vLLM's EAGLE-3 proposer) or custom (custom_class)
    # SPECD_EAGLE_K: adaptive (eagle3 route: EAGLE-3 drafts as many as its rows are worth verifying, none where
    # context serves every row) or full (always k)
    eagle_k: str = "adaptive"
    # SPECD_EAGLE_MAX: the most drafts EAGLE-3 makes a step (0: vLLM's k). With vLLM's k above it, only
    # context and table continuations use the longer reach (`--context-k`): EAGLE-3's later drafts seldom pay
    eagle_max: int = 0
    # SPECD_EAGLE_MIN_CHANCE: with SPECD_CONFIDENCE=1, EAGLE-3 also stops drafting once no row's next draft has at
    # least this chance of being accepted (0: the draft budget's bars alone decide); trades accepted tokens for time
    eagle_min_chance: float = 0.0
    # SPECD_CONFIDENCE: 1 trims and weighs EAGLE-3's rows by its own calibrated confidence in each draft and
    # stops its drafting between passes (`eagle3.confidence`); 0, the default, by its positions' measured
    # acceptance. Interleaved A/Bs on CPU, batch 1 / 8: -1.5% / +1.6% in float32, +10% / -3% in vLLM's defaults
    confidence: bool = False
    # SPECD_DRAFTER_GEMM: the dtype EAGLE-3's drafter layers compute in, in eager mode on CPU: auto (bfloat16 in a
    # float32 server where the CPU has native bfloat16; half the bytes a drafting pass reads), bfloat16 or native
    drafter_gemm: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if env is None else env

        def number(name: str, kind: type, default: float | int) -> float | int:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                value = kind(raw)
            except ValueError:
                raise ConfigurationError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            if value < 0:
                raise ConfigurationError(f"{name}={raw!r} must not be negative")
            return value

        route = env.get("SPECD_ROUTE", "eagle3")
        if route not in ROUTES:
            raise ConfigurationError(f"SPECD_ROUTE={route!r}: choose one of {', '.join(ROUTES)}")
        kind = env.get("SPECD_DRAFTER", "hybrid")
        if kind not in ("hybrid", "learned"):
            raise ConfigurationError(f"SPECD_DRAFTER={kind!r}: choose hybrid or learned")
        eagle_k = env.get("SPECD_EAGLE_K", "adaptive")
        if eagle_k not in ("adaptive", "full"):
            raise ConfigurationError(f"SPECD_EAGLE_K={eagle_k!r}: choose adaptive or full")
        broker = env.get("SPECD_BROKER") or None
        if broker is not None:
            MqttSettings.from_url(broker)  # refuse a malformed URL now, not in a background thread
        version = env.get("SPECD_VERSION") or None
        table = env.get("SPECD_TRAFFIC_TABLE", "1").strip().lower()
        confidence = env.get("SPECD_CONFIDENCE", "0").strip().lower()
        for name, flag in (("SPECD_TRAFFIC_TABLE", table), ("SPECD_CONFIDENCE", confidence)):
            if flag not in ("0", "1", "false", "true", "off", "on"):
                raise ConfigurationError(f"{name}={flag!r}: use 1 or 0")
        drafter_gemm = env.get("SPECD_DRAFTER_GEMM", "auto").strip().lower() or "auto"
        if drafter_gemm not in DRAFTER_GEMMS:
            raise ConfigurationError(f"SPECD_DRAFTER_GEMM={drafter_gemm!r}: choose one of {', '.join(DRAFTER_GEMMS)}")
        min_chance = float(number("SPECD_EAGLE_MIN_CHANCE", float, 0.0))
        if min_chance > 1:
            raise ConfigurationError(f"SPECD_EAGLE_MIN_CHANCE={min_chance}: a chance lies between 0 and 1")
        return cls(broker=broker, deployment=env.get("SPECD_DEPLOYMENT", "default"),
                   learner_url=env.get("SPECD_LEARNER_URL") or None, store=env.get("SPECD_STORE") or None,
                   version=int(number("SPECD_VERSION", int, 0)) if version is not None else None,
                   server_id=env.get("SPECD_SERVER_ID", "vllm-0"), domain=env.get("SPECD_DOMAIN") or None,
                   drafter_kind=kind, drafter_layers=int(number("SPECD_DRAFTER_LAYERS", int, 1)) or 1,
                   drafter_head_vocab=int(number("SPECD_DRAFTER_HEAD_VOCAB", int, 8192)) or 8192,
                   traffic_table=table in ("1", "true", "on"),
                   report_seconds=float(number("SPECD_REPORT_SECONDS", float, 2.0)) or 2.0,
                   cache=env.get("SPECD_CACHE_DIR") or None, route=route, eagle_k=eagle_k,
                   eagle_max=int(number("SPECD_EAGLE_MAX", int, 0)), eagle_min_chance=min_chance,
                   confidence=confidence in ("1", "true", "on"), drafter_gemm=drafter_gemm)

    def to_env(self) -> dict[str, str]:
        values = {"SPECD_BROKER": self.broker, "SPECD_DEPLOYMENT": self.deployment,
                  "SPECD_LEARNER_URL": self.learner_url, "SPECD_STORE": self.store,
                  "SPECD_VERSION": self.version, "SPECD_SERVER_ID": self.server_id, "SPECD_DOMAIN": self.domain,
                  "SPECD_DRAFTER": self.drafter_kind, "SPECD_DRAFTER_LAYERS": self.drafter_layers,
                  "SPECD_DRAFTER_HEAD_VOCAB": self.drafter_head_vocab, "SPECD_REPORT_SECONDS": self.report_seconds,
                  "SPECD_TRAFFIC_TABLE": "1" if self.traffic_table else "0",
                  "SPECD_CACHE_DIR": self.cache, "SPECD_ROUTE": self.route, "SPECD_EAGLE_K": self.eagle_k,
                  "SPECD_EAGLE_MAX": self.eagle_max or None, "SPECD_EAGLE_MIN_CHANCE": self.eagle_min_chance or None,
                  "SPECD_CONFIDENCE": "1" if self.confidence else "0", "SPECD_DRAFTER_GEMM": self.drafter_gemm}
        return {name: str(value) for name, value in values.items() if value is not None}

    @property
    def mqtt(self) -> MqttSettings | None:
        return MqttSettings.from_url(self.broker, self.deployment) if self.broker else None


Schedule = list[tuple[int, int, int]]  # vLLM's (first batch size, last batch size, drafts) entries


def parse_schedule(text: str, k: int) -> Schedule:
    """"1-2:4,3-8:2" -> [(1, 2, 4), (3, 8, 2)]: vLLM's `num_speculative_tokens_per_batch_size`."""
    schedule = []
    for entry in text.split(","):
        try:
            sizes, count = entry.strip().split(":")
            bounds = [int(n) for n in sizes.split("-")]
            if len(bounds) not in (1, 2):
                raise ValueError(sizes)
            schedule.append((bounds[0], bounds[-1], int(count)))
        except ValueError:
            raise ConfigurationError(f"drafts per batch size {entry!r}: write FIRST-LAST:DRAFTS, "
                                     f"e.g. 1-2:4,3-8:2") from None
    for first, last, drafts in schedule:
        if not 1 <= first <= last or not 0 <= drafts <= k:
            raise ConfigurationError(f"drafts per batch size ({first}-{last}:{drafts}): batch sizes from 1 "
                                     f"upwards, drafts from 0 to k = {k}")
    ordered = sorted(schedule)
    for (_, last, _), (first, _, _) in itertools.pairwise(ordered):
        if first <= last:
            raise ConfigurationError(f"drafts per batch size {text!r}: batch size {first} is in two ranges")
    return schedule


# vLLM options of the eagle3 route (frozen EAGLE-3 in benchmarks/vllm_compare.py runs with the same):
# - unpadded drafting runs after vLLM's bookkeeping on CPU-side tokens, which the companion reads;
# - the greedy draft is the argmax of the draft vocabulary's logits mapped to a target id, not the
#   argmax of a full-vocabulary row filled with -inf around them (the same token, without building
#   and scanning 49152 logits per drafting pass).
EAGLE3_OPTIONS = {"disable_padded_drafter_batch": True, "use_local_argmax_reduction": True}


def speculative_config(k: int, route: str = "custom", drafter_dir: str | None = None,
                       per_batch_size: Schedule | None = None) -> dict[str, object]:
    """vLLM's --speculative-config for a route; "eagle3" needs the exported drafter folder.
    `per_batch_size` is vLLM's own schedule of draft counts by batch size, passed through."""
    if k < 1:
        raise ConfigurationError(f"k (draft tokens per step) must be at least 1, got {k}")
    schedule: dict[str, object] = {"num_speculative_tokens_per_batch_size": per_batch_size} if per_batch_size else {}
    if route == "custom":
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k, **schedule}
    if route != "eagle3" or drafter_dir is None:
        raise ConfigurationError(f"route {route!r}: choose custom, or eagle3 with an exported drafter folder")
    return {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k, **EAGLE3_OPTIONS, **schedule}


def vllm_command(target: str, settings: PluginSettings, k: int = 4, host: str = "127.0.0.1", port: int = 8000,
                 max_num_seqs: int = 8, max_model_len: int = 4096, extra: list[str] | None = None,
                 python: str | None = None, drafter_dir: str | None = None,
                 per_batch_size: Schedule | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) for vLLM's OpenAI server with specd's drafter beside it (the eagle3 route
    serves the exported folder `drafter_dir`)."""
    env = {**settings.to_env(), "VLLM_SERVER_DEV_MODE": "1"}  # DEV_MODE opens POST /collective_rpc
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--host", host, "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len),
            "--speculative-config", json.dumps(speculative_config(k, settings.route, drafter_dir, per_batch_size),
                                               separators=(",", ":")),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--per-request-spec-decode-metrics", "detailed", *(extra or [])]
    return env, argv


def prepare_eagle3_drafter(target_dir: str | Path, settings: PluginSettings, folder: str | Path | None = None,
                           drafter: str | Path | None = None) -> Path:
    """Export the version vLLM's EAGLE-3 proposer starts from (see `_start_version`) into `folder`
    (default: a new temporary folder owned by this process, which outlives it: see the module's
    docstring); the worker side then follows the live version from there."""
    from specd.drafter.base import BUILT_IN_VERSION
    from specd.drafter.checkpoint import load_drafter
    from specd.drafter.feature_model import FeatureDrafterModel
    from specd.drafter.vllm_format import export_eagle3
    from specd.model.fingerprint import TargetFingerprint
    from specd.model.loading import read_target_head

    folder = Path(folder) if folder is not None else temporary_folder("specd-eagle3-", remove_at_exit=False)
    config, embed, _ = read_target_head(target_dir)
    fingerprint = TargetFingerprint.of(config, target_dir)
    try:
        path, version = (Path(drafter), BUILT_IN_VERSION) if drafter is not None else _start_version(settings, folder)
        try:
            model = load_drafter(path, fingerprint, target_embedding=embed)
        except SpecdError as error:
            raise ConfigurationError(f"cannot start vLLM's EAGLE-3 drafter from {path}: {error}") from None
        if not isinstance(model, FeatureDrafterModel):
            raise ConfigurationError(f"{path} is a token-level drafter; the eagle3 route serves feature drafters "
                                     "(use --route custom for token-level versions)")
        try:
            return export_eagle3(model, folder, target_dir, fingerprint, version)
        except ValueError as error:
            raise ConfigurationError(str(error)) from None
    finally:
        shutil.rmtree(folder / "fetched", ignore_errors=True)  # a fetched start version: the export holds a copy


def check_exported_drafter(target_dir: str | Path, drafter_dir: str | Path) -> None:
    """ConfigurationError unless `drafter_dir` is an eagle3 export of a feature drafter for this target
    (what the worker loads at start: found wrong there, it would end vLLM's engine with a traceback)."""
    from specd.drafter.checkpoint import load_drafter
    from specd.drafter.feature_model import FeatureDrafterModel
    from specd.drafter.vllm_format import SPECD_CHECKPOINT
    from specd.model.fingerprint import TargetFingerprint
    from specd.model.loading import read_target_head

    path = Path(drafter_dir) / SPECD_CHECKPOINT
    if not path.is_file():
        raise ConfigurationError(f"--drafter-dir {drafter_dir}: no {SPECD_CHECKPOINT} (not a folder specd exported; "
                                 "leave --drafter-dir out to export one)")
    try:
        config, embed, _ = read_target_head(target_dir)
        model = load_drafter(path, TargetFingerprint.of(config, target_dir), target_embedding=embed)
    except SpecdError as error:
        raise ConfigurationError(f"--drafter-dir {drafter_dir}: {error}") from None
    if not isinstance(model, FeatureDrafterModel):
        raise ConfigurationError(f"--drafter-dir {drafter_dir}: a token-level drafter; the eagle3 route serves "
                                 "feature drafters")


def _start_version(settings: PluginSettings, folder: Path) -> tuple[Path, int]:
    """The file and version to start from: `settings.version` (else the live one) from the store, or
    from the learner over HTTP; the shipped pretrained drafter (`BUILT_IN_VERSION`) when there is none yet or the
    learner cannot be reached (a warning says so)."""
    from specd.drafter.base import BUILT_IN_VERSION
    from specd.drafter.pretrained import SHIPPED_DRAFTER
    from specd.hotswap.integrity import check_file
    from specd.hotswap.remote import RemoteSource
    from specd.hotswap.store import WeightStore

    if settings.store is not None and Path(settings.store).exists() and not Path(settings.store).is_dir():
        raise ConfigurationError(f"the store {settings.store} is a file, not a weight store folder")
    if settings.store is not None and not Path(settings.store).is_dir():
        if settings.version is not None:
            raise ConfigurationError(f"version {settings.version}: the store {settings.store} does not exist")
        log.warning("the store %s does not exist (yet): vLLM starts from the shipped drafter and follows the "
                    "store's versions once it has some", settings.store)
    elif settings.store is not None:
        store = WeightStore(settings.store)
        version = settings.version if settings.version is not None else store.live_version()
        if version is not None:
            try:
                check_file(version, store.weights_path(version), store.manifest(version), ConfigurationError)
            except OSError as error:
                raise ConfigurationError(f"version {version} of {settings.store} cannot be read: "
                                         f"{error.strerror or error}") from None
            return store.weights_path(version), version
    elif settings.learner_url is not None:
        source = RemoteSource(folder / "fetched", settings.learner_url)
        try:
            version = settings.version if settings.version is not None else source.learner_live()
            if version is not None:
                path, manifest = source.fetch(version)
                check_file(version, path, manifest, ConfigurationError)
                return path, version
        except (OSError, SpecdError) as error:
            if settings.version is not None:  # asked for by number: the shipped drafter is not what was asked
                raise ConfigurationError(f"version {settings.version} cannot be fetched from the learner at "
                                         f"{settings.learner_url}: {error}") from None
            log.warning("cannot read the learner's live version (%s); vLLM starts from the shipped drafter and "
                        "follows the learner's versions once they are announced", error)
    else:  # the usual start with --broker alone: the learner's announcement names its URL later
        log.info("no store or learner URL to start from: vLLM starts from the shipped drafter and follows "
                 "the versions the learner announces")
    return SHIPPED_DRAFTER, BUILT_IN_VERSION


OWNER_FILE = ".specd-owner"  # the process id that removes the folder when it exits


def temporary_folder(prefix: str, remove_at_exit: bool = True) -> Path:
    """A new folder in the system's temporary directory that names this process as its owner:
    removed when this process exits (unless `remove_at_exit` is False), and in any case by a later
    call with the same `prefix` once the owner is gone (killed, or exec'd into vLLM and ended since)."""
    for orphan in Path(tempfile.gettempdir()).glob(prefix + "*"):
        owner = _owner(orphan)
        if owner is not None and not _alive(owner):
            shutil.rmtree(orphan, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    (folder / OWNER_FILE).write_text(str(os.getpid()))
    if remove_at_exit:
        # multiprocessing's finaliser, not atexit: it also runs when a forked multiprocessing child
        # (as vLLM's engine core may be) ends through os._exit, and only in the process that made it
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(folder),), kwargs={"ignore_errors": True},
                                      exitpriority=0)
    return folder


def _owner(folder: Path) -> int | None:
    try:
        return int((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):  # not a folder of ours, or one still being made
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def shell_line(env: Mapping[str, str], argv: list[str]) -> str:
    """The command as one copy-pasteable shell line."""
    return " ".join([*(f"{name}={shlex.quote(value)}" for name, value in env.items()), *map(shlex.quote, argv)])
