"""A version source for servers on other machines: MQTT announcements plus HTTP fetches.

Contract: `announce(payload)` is called (from the MQTT thread) with the retained live-version
message `{"version": n, "url": learner_url}`; `fetch(n)` (from the swapper thread, never the
decoding thread) downloads the manifest and weights from the learner's HTTP API into a local
cache folder, writing to a temporary file renamed into place, and returns the path. The swapper
then checks the sha256 and everything else before the weights can reach the engine.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specd.errors import ConfigurationError, TransportError


class RemoteSource:
    def __init__(self, cache: str | Path, learner_url: str | None = None, timeout: float = 30.0) -> None:
        self.cache = Path(cache)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.learner_url = learner_url
        self.timeout = timeout
        self._live: int | None = None
        self._lock = threading.Lock()

    def announce(self, payload: dict[str, Any]) -> None:
        version = payload.get("version")
        if not isinstance(version, int):
            raise ValueError(f"announcement without an integer version: {payload}")
        with self._lock:
            self._live = version
            self.learner_url = str(payload.get("url") or self.learner_url or "") or None

    def live_version(self) -> int | None:
        with self._lock:
            return self._live

    def _get(self, path: str) -> bytes:
        if not self.learner_url:
            raise ConfigurationError("no learner URL to fetch drafter weights from")
        url = self.learner_url.rstrip("/") + path
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                return bytes(response.read())
        except (urllib.error.URLError, TimeoutError) as error:
            raise TransportError(f"cannot fetch {url}: {error}") from None

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        try:
            manifest = json.loads(self._get(f"/v1/versions/{version}"))
        except ValueError:
            raise TransportError(f"version {version}: the learner's manifest is not JSON") from None
        target = self.cache / f"{version:06d}.safetensors"
        if not target.is_file():
            fd, tmp = tempfile.mkstemp(dir=self.cache, prefix=target.name + ".")
            with os.fdopen(fd, "wb") as handle:
                handle.write(self._get(f"/v1/versions/{version}/weights"))
            os.replace(tmp, target)
        return target, manifest
