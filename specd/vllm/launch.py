"""How specd's proposer is configured inside vLLM, and the vLLM command line that runs it.

Contract: vLLM builds the proposer from its own config only, so specd's settings travel as
environment variables (`SPECD_*`, listed in `PluginSettings`), which vLLM's worker processes
inherit. `PluginSettings.from_env` reads and checks them (a bad value raises `ConfigurationError`
naming the variable); `to_env` writes them back. `vllm_command` returns the exact environment
and argv of `python -m vllm.entrypoints.openai.api_server` with specd's proposer, its worker
extension (for `POST /collective_rpc`) and per-request spec-decode metrics switched on.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from specd.errors import ConfigurationError
from specd.mqtt import MqttSettings

PROPOSER_CLASS = "specd.vllm.proposer.SpecdProposer"
WORKER_EXTENSION = "specd.vllm.extension.SpecdWorkerExtension"


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

        kind = env.get("SPECD_DRAFTER", "hybrid")
        if kind not in ("hybrid", "learned"):
            raise ConfigurationError(f"SPECD_DRAFTER={kind!r}: choose hybrid or learned")
        broker = env.get("SPECD_BROKER") or None
        if broker is not None:
            MqttSettings.from_url(broker)  # refuse a malformed URL now, not in a background thread
        version = env.get("SPECD_VERSION") or None
        table = env.get("SPECD_TRAFFIC_TABLE", "1").strip().lower()
        if table not in ("0", "1", "false", "true", "off", "on"):
            raise ConfigurationError(f"SPECD_TRAFFIC_TABLE={table!r}: use 1 or 0")
        return cls(broker=broker, deployment=env.get("SPECD_DEPLOYMENT", "default"),
                   learner_url=env.get("SPECD_LEARNER_URL") or None, store=env.get("SPECD_STORE") or None,
                   version=int(number("SPECD_VERSION", int, 0)) if version is not None else None,
                   server_id=env.get("SPECD_SERVER_ID", "vllm-0"), domain=env.get("SPECD_DOMAIN") or None,
                   drafter_kind=kind, drafter_layers=int(number("SPECD_DRAFTER_LAYERS", int, 1)) or 1,
                   drafter_head_vocab=int(number("SPECD_DRAFTER_HEAD_VOCAB", int, 8192)) or 8192,
                   traffic_table=table in ("1", "true", "on"),
                   report_seconds=float(number("SPECD_REPORT_SECONDS", float, 2.0)) or 2.0,
                   cache=env.get("SPECD_CACHE_DIR") or None)

    def to_env(self) -> dict[str, str]:
        values = {"SPECD_BROKER": self.broker, "SPECD_DEPLOYMENT": self.deployment,
                  "SPECD_LEARNER_URL": self.learner_url, "SPECD_STORE": self.store,
                  "SPECD_VERSION": self.version, "SPECD_SERVER_ID": self.server_id, "SPECD_DOMAIN": self.domain,
                  "SPECD_DRAFTER": self.drafter_kind, "SPECD_DRAFTER_LAYERS": self.drafter_layers,
                  "SPECD_DRAFTER_HEAD_VOCAB": self.drafter_head_vocab, "SPECD_REPORT_SECONDS": self.report_seconds,
                  "SPECD_TRAFFIC_TABLE": "1" if self.traffic_table else "0",
                  "SPECD_CACHE_DIR": self.cache}
        return {name: str(value) for name, value in values.items() if value is not None}

    @property
    def mqtt(self) -> MqttSettings | None:
        return MqttSettings.from_url(self.broker, self.deployment) if self.broker else None


def speculative_config(k: int) -> dict[str, object]:
    if k < 1:
        raise ConfigurationError(f"k (draft tokens per step) must be at least 1, got {k}")
    return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k}


def vllm_command(target: str, settings: PluginSettings, k: int = 4, host: str = "127.0.0.1", port: int = 8000,
                 max_num_seqs: int = 8, max_model_len: int = 4096, extra: list[str] | None = None,
                 python: str | None = None) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) for vLLM's OpenAI server with specd's drafter beside it."""
    env = {**settings.to_env(), "VLLM_SERVER_DEV_MODE": "1"}  # DEV_MODE opens POST /collective_rpc
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
            "--host", host, "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len),
            "--speculative-config", json.dumps(speculative_config(k), separators=(",", ":")),
            "--worker-extension-cls", WORKER_EXTENSION,
            "--per-request-spec-decode-metrics", "detailed", *(extra or [])]
    return env, argv


def shell_line(env: Mapping[str, str], argv: list[str]) -> str:
    """The command as one copy-pasteable shell line."""
    return " ".join([*(f"{name}={shlex.quote(value)}" for name, value in env.items()), *map(shlex.quote, argv)])
