"""A version source for servers on other machines: MQTT announcements plus HTTP fetches.

Contract: `announce(payload)` is called (from the MQTT thread) with the retained live-version
message `{"version": n, "url": learner_url}`; `fetch(n)` (from the swapper thread, never the
decoding thread) downloads the manifest and weights from the learner's HTTP API into a local
cache folder and returns the path. A file in the cache is complete and matches its manifest's
sha256, or is not there:
- a download streams into a hidden temporary file (`.NNNNNN.safetensors.*.part`), fsynced and
  renamed into place only once whole and matching; a failed or interrupted download removes it;
- a download that could not complete (unreachable, timeout, HTTP error, cut short) raises
  `TransportError`, which the swapper retries;
- a complete download whose sha256 differs from the manifest is deleted and raises
  `CheckpointError`: the learner served those bytes, so the version is refused for good;
- a cached file that no longer matches (a disk fault, a crash before our fsync) is deleted and
  downloaded again once, as if it had never been cached.
`prune(keep_versions)` bounds the cache: it keeps the newest `keep` versions and those named
(the swapper names the serving and wanted ones), and deletes the rest, with any temporary file
a crash left behind. The swapper still checks the sha256 and everything else before the weights
can reach the engine.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from specd.core.errors import BadRequest, TransportError, out_of_space
from specd.core.http_requests import json_object
from specd.hotswap.integrity import check_digest, sha256_file

log = logging.getLogger(__name__)

PART_SUFFIX = ".part"
STALE_PART_SECONDS = 3600.0  # a temporary file this old belongs to no download still running


def is_version_number(value: object) -> bool:
    """A drafter version as JSON carries it: a non-negative integer (a JSON boolean is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class RemoteSource:
    def __init__(self, cache: str | Path, learner_url: str | None = None, timeout: float = 30.0,
                 keep: int = 4) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.cache = Path(cache)
        self.cache.mkdir(parents=True, exist_ok=True)
        self.learner_url = learner_url
        self.timeout = timeout
        self.keep = keep
        self._live: int | None = None
        self._lock = threading.Lock()

    def announce(self, payload: dict[str, Any]) -> None:
        version, url = payload.get("version"), payload.get("url")
        if not is_version_number(version):
            raise ValueError(f"announcement without a drafter version number: {str(payload)[:200]}")
        if url is not None and (not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https")):
            raise ValueError(f"announcement with a learner URL that is not http(s): {str(url)[:200]}")
        with self._lock:
            self._live = version
            self.learner_url = url or self.learner_url

    def live_version(self) -> int | None:
        with self._lock:
            return self._live

    def path(self, version: int) -> Path:
        return self.cache / f"{version:06d}.safetensors"

    def cached_versions(self) -> list[int]:
        return sorted(int(p.name.split(".")[0]) for p in self.cache.glob("[0-9]*.safetensors")
                      if p.name.split(".")[0].isdigit())

    # ---- fetching ---------------------------------------------------------------------------
    def learner_live(self) -> int | None:
        """The live version the learner's /v1/status names (None: none yet); TransportError when
        it cannot be read or names something that is not a version."""
        live = self._read_object("/v1/status").get("live")
        if live is not None and not is_version_number(live):
            raise TransportError(f"the learner's status names no version as live: {str(live)[:100]}")
        return live

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        manifest = self._read_object(f"/v1/versions/{version}")
        expected = str(manifest.get("sha256"))
        target = self.path(version)
        if target.is_file():
            if sha256_file(target) == expected:
                return target, manifest
            log.warning("cached %s does not match its manifest; fetching it again", target.name)
            target.unlink(missing_ok=True)
        check_digest(version, self._download(f"/v1/versions/{version}/weights", target, expected), manifest)
        return target, manifest

    def _url(self, path: str) -> str:
        if not self.learner_url:
            raise TransportError("no learner URL to fetch drafter weights from (none set, none announced)")
        return self.learner_url.rstrip("/") + path

    def _read(self, path: str) -> bytes:
        url = self._url(path)
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                return bytes(response.read())
        except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, a body cut short
            raise TransportError(f"cannot fetch {url}: {error}") from None

    def _read_object(self, path: str) -> dict[str, Any]:
        try:
            return json_object(self._read(path))
        except BadRequest as error:  # not JSON, or not an object
            raise TransportError(f"{path}: the learner's answer is unusable ({error})") from None

    def _download(self, path: str, target: Path, expected: str) -> str:
        """Stream `path` into `target` if its sha256 is `expected` (a mismatch leaves nothing); the digest."""
        url = self._url(path)
        fd, tmp = tempfile.mkstemp(dir=self.cache, prefix=f".{target.name}.", suffix=PART_SUFFIX)
        digest = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as handle:
                try:
                    with urllib.request.urlopen(url, timeout=self.timeout) as response:
                        promised, received = response.headers.get("Content-Length"), 0
                        for chunk in iter(lambda: response.read(1 << 20), b""):
                            digest.update(chunk)
                            handle.write(chunk)
                            received += len(chunk)
                except (OSError, http.client.HTTPException) as error:  # IncompleteRead is not an OSError
                    if out_of_space(error):  # this server's cache is full, not the learner's disk
                        raise TransportError(f"cannot store {url} in this server's cache {self.cache}: "
                                             f"no space left on its device") from None
                    raise TransportError(f"cannot fetch {url}: {error}") from None
                # read(n) ends quietly at a connection closed early: only the length tells a cut body
                if promised is not None and promised.isdigit() and received != int(promised):
                    raise TransportError(f"cannot fetch {url}: {received} of {promised} bytes arrived")
                handle.flush()
                os.fsync(handle.fileno())  # renamed only once on disk: a crash cannot leave a short file
            if digest.hexdigest() == expected:
                os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)  # gone already when renamed into place
        return digest.hexdigest()

    # ---- bounding the cache -----------------------------------------------------------------
    def prune(self, keep_versions: set[int]) -> None:
        """Delete cached versions other than the newest `keep` and `keep_versions`."""
        versions = self.cached_versions()
        kept = set(versions[-self.keep:]) | keep_versions
        deleted = [v for v in versions if v not in kept]
        for version in deleted:
            self.path(version).unlink(missing_ok=True)
        now = time.time()
        for part in self.cache.glob(f".*{PART_SUFFIX}"):  # left by a process that died mid-download
            try:
                if now - part.stat().st_mtime > STALE_PART_SECONDS:
                    part.unlink()
            except FileNotFoundError:
                pass
        if deleted:
            log.info("pruned cached drafter versions %s", deleted)
