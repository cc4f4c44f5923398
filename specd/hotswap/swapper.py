"""Follow the store's live version into a running drafter, off the decoding thread.

Contract: `Swapper` runs beside the engine (its own thread, or `check_once` from a test). When
the source's live version (a local store, or announcements plus HTTP fetches from a learner)
differs from the drafter's, it reads the weights, checks them (`specd.hotswap.integrity`: sha256
against the manifest, safetensors metadata, the target's fingerprint, tensor names and shapes,
finite values, the drafter's own `check_compatible`) and hands the ready model to the drafter's
`offer` (any `specd.drafter.swap.Swappable`); the drafter switches to it at the start of its
next proposal, i.e. between two decoding steps. Disk reads and checks never happen on the
decoding thread. Two kinds of failure:
- transient: the weights could not be fetched (`TransportError`, `OSError`: an unreachable
  learner, a timeout, an HTTP error, a download cut short). The version is tried again after a
  jittered exponential backoff (at most `retry_base` seconds, doubling up to `retry_cap`); each
  failure is logged at warning and counted in `fetch_failures`, and `retrying` maps the version
  to its failed attempts. A different live version (newer, or an operator's pin) supersedes them;
- permanent: weights that were fetched and fail a check (any other `SpecdError`). The reason is
  logged and kept in `refused`, and the version is never fetched again.
Either way the drafter keeps the version it has. When the live version goes back to the one the
drafter serves before a prepared version took over (a rollback right after a publish, on an idle
server), the prepared offer is withdrawn. After each fetch that completed, a source that
keeps files (`RemoteSource`) is pruned, keeping the serving and wanted versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specd.core.errors import SpecdError, TransportError, VersionNotFound
from specd.core.threads import BackgroundHealth, backoff_delay, lower_thread_priority, supervised_thread
from specd.drafter.checkpoint import DrafterModel
from specd.drafter.swap import Swappable
from specd.hotswap.integrity import load_verified
from specd.hotswap.store import WeightStore
from specd.model.fingerprint import TargetFingerprint

log = logging.getLogger(__name__)


SWAPPER_TASK = "swapper"


@dataclass
class SwapEvent:
    version: int
    seconds_to_prepare: float
    at: float = field(default_factory=time.time)


class VersionSource(Protocol):
    """Where the live version is announced and its weights and manifest are found."""

    def live_version(self) -> int | None: ...

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        """A local path to the version's weights and its manifest."""

    def prune(self, keep_versions: set[int]) -> None:
        """Forget fetched files no longer needed, never those of `keep_versions`."""


class LocalStore:
    """A weight store on this machine's disk (the embedded default, or a shared volume)."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    def live_version(self) -> int | None:
        return self.store.live_version()

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        return self.store.weights_path(version), self.store.manifest(version)

    def prune(self, keep_versions: set[int]) -> None:
        """Nothing to do: the files are the store's, and its own collection bounds them."""


# the weights could not be fetched: worth another try (every other SpecdError is a refusal). A
# version not in the store (yet) too: a pin may name it before the learner publishes it
TRANSIENT = (TransportError, OSError, VersionNotFound)


class Swapper:
    def __init__(self, source: VersionSource, drafter: Swappable,
                 fingerprint: TargetFingerprint, poll_seconds: float = 0.2,
                 target_embedding: torch.Tensor | None = None, retry_base: float = 0.5,
                 retry_cap: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.target_embedding = target_embedding  # fills in versions that share the target's embedding
        self.poll_seconds = poll_seconds
        self.retry_base, self.retry_cap, self.clock = retry_base, retry_cap, clock
        self.prepared: list[SwapEvent] = []
        self.refused: dict[int, str] = {}
        self.retrying: dict[int, int] = {}  # version -> failed fetches in a row (one version at a time)
        self.fetch_failures = 0             # every transient failure since start
        self.retry_at = 0.0                 # `clock` time before which the retried version is not fetched
        self._wanted: int | None = None
        self._live_error: str | None = None  # the last failure to read the live version, while it lasts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def prepared_version(self) -> int | None:
        """The last version handed to the drafter (it serves from the drafter's next proposal)."""
        return self._wanted

    @staticmethod
    def idle_report() -> dict[str, Any]:
        """`report`'s fields before a swapper exists (a worker not started yet)."""
        return Swapper.report_of(None, {}, {}, 0)

    def report(self) -> dict[str, Any]:
        """What a server's status shows of its swaps: the version handed over, the versions refused and
        why, a version whose fetch keeps failing (a pin to one not yet published) and its tries."""
        return self.report_of(self.prepared_version, self.refused, self.retrying, self.fetch_failures)

    @staticmethod
    def report_of(prepared: int | None, refused: dict[int, str], retrying: dict[int, int],
                  failures: int) -> dict[str, Any]:
        return {"prepared_version": prepared, "refused_versions": dict(refused),
                "retrying_versions": dict(retrying), "fetch_failures": failures}

    def check_once(self) -> bool:
        """Prepare the live version if it is new; True when a model was handed to the drafter."""
        try:
            live = self.source.live_version()
        except (OSError, ValueError) as error:
            if str(error) != self._live_error:  # said once, not at every poll (five a second)
                log.warning("cannot read the store's live version (the version served stays): %s", error)
            self._live_error = str(error)
            return False
        if self._live_error is not None:
            log.info("the store's live version is readable again")
            self._live_error = None
        if live is not None and live == self.drafter.version and self._wanted not in (None, live):
            self._withdraw(live)
        if live is None or live in (self.drafter.version, self._wanted) or live in self.refused:
            self.retrying.clear()  # whatever was retried is not wanted any more
            return False
        if live not in self.retrying:
            self.retrying.clear()  # a newer live version (or a pin) supersedes retries of another
        elif self.clock() < self.retry_at:
            return False
        begin = time.perf_counter()
        try:
            model = self._load_checked(live)
            if self._superseded(live):
                return False
            # offered before it counts as prepared: whoever sees `prepared_version` can rely on the
            # drafter's next step serving it (preparing for a server may take a while, e.g. packing)
            self.drafter.offer(model, live)
        except TRANSIENT as error:
            self._retry_later(live, error)
            return False
        except SpecdError as error:  # fetched, but not what the manifest promised or not for this server
            self._refuse(live, error)
            return False
        self.retrying.clear()
        self._wanted = live
        self.prepared.append(SwapEvent(live, time.perf_counter() - begin))
        log.info("drafter version %s ready; it takes over at the next step", live)
        self._prune()
        return True

    def _withdraw(self, live: int) -> None:
        """The live version went back to the one serving (a rollback or unpin before the prepared
        version's first step): the prepared one must not be installed at the next step."""
        withdrawn = self.drafter.withdraw()
        if withdrawn is not None:
            log.info("drafter version %s withdrawn before it served: version %s is live again", withdrawn, live)
            self._wanted = live
        else:  # a step took it meanwhile: it serves now, and the next poll brings `live` back like any change
            self._wanted = None

    def _superseded(self, loaded: int) -> bool:
        """Whether the live version moved on while `loaded` was fetched and checked (an operator's
        rollback or pin during a long load): then it is not offered, and the next poll takes the
        version live now. A failure to read it here offers `loaded`, which was live a moment ago."""
        try:
            live = self.source.live_version()
        except (OSError, ValueError):
            return False
        if live is None or live == loaded:
            return False
        log.info("drafter version %s was loaded, but version %s went live meanwhile: not offered", loaded, live)
        return True

    def _retry_later(self, version: int, error: Exception) -> None:
        attempts = self.retrying.get(version, 0) + 1
        self.retrying[version] = attempts
        self.fetch_failures += 1
        delay = backoff_delay(attempts - 1, self.retry_base, self.retry_cap)  # the first wait: up to retry_base
        self.retry_at = self.clock() + delay
        log.warning("cannot fetch drafter version %s (attempt %d), trying again in %.1f s: %s",
                    version, attempts, delay, error)

    def _refuse(self, version: int, error: Exception) -> None:
        self.retrying.clear()
        self.refused[version] = str(error)
        log.error("refused drafter version %s, keeping %s: %s", version, self.drafter.version, error)
        self._prune()

    def _prune(self) -> None:
        """Bound the fetched files, keeping the version that serves and the one handed over to serve next."""
        keep = {self.drafter.version} | ({self._wanted} if self._wanted is not None else set())
        try:
            self.source.prune(keep)
        except OSError as error:  # a cache we cannot tidy must not stop swaps
            log.warning("cannot prune fetched drafter versions: %s", error)

    def _load_checked(self, version: int) -> DrafterModel:
        path, manifest = self.source.fetch(version)
        return load_verified(version, path, manifest, self.fingerprint, self.drafter, self.target_embedding)

    # ---- background thread ----------------------------------------------------------------
    def start(self, health: BackgroundHealth | None = None) -> Swapper:
        """Follow the live version on a thread; an unexpected failure is logged, counted in `health`
        (task `swapper`) and the thread restarts, so swaps never silently stop."""
        self._thread = supervised_thread(SWAPPER_TASK, self._run, health or BackgroundHealth(), self._stop)
        self._thread.start()
        return self

    def _run(self) -> None:
        lower_thread_priority()  # loading and checking weights must not slow decoding down
        while not self._stop.wait(self.poll_seconds):
            self.check_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
