"""Follow the store's live version into a running drafter, off the decoding thread.

Contract: `Swapper` runs beside the engine (its own thread, or `check_once` from a test). When
the source's live version (a local store, or announcements plus HTTP fetches from a learner)
differs from the drafter's, it reads the weights, checks them (sha256
against the manifest, safetensors metadata, the target's fingerprint, tensor names and shapes,
finite values) and hands the ready model to `TokenDrafter.offer`; the drafter switches to it at
the start of its next proposal, i.e. between two decoding steps. Disk reads and checks never
happen on the decoding thread. Weights that fail a check are refused: the reason is logged and
kept in `refused`, and the drafter keeps the version it has.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from specd.drafter.checkpoint import DrafterModel, load_drafter
from specd.drafter.factory import ServingDrafter
from specd.errors import CheckpointError, SpecdError
from specd.hotswap.store import WeightStore, sha256_file
from specd.model.fingerprint import TargetFingerprint
from specd.threads import lower_thread_priority

log = logging.getLogger(__name__)


@dataclass
class SwapEvent:
    version: str
    seconds_to_prepare: float
    at: float = field(default_factory=time.time)


class VersionSource(Protocol):
    """Where the live version is announced and its weights and manifest are found."""

    def live_version(self) -> int | None: ...

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        """A local path to the version's weights and its manifest."""


class LocalStore:
    """A weight store on this machine's disk (the embedded default, or a shared volume)."""

    def __init__(self, store: WeightStore) -> None:
        self.store = store

    def live_version(self) -> int | None:
        return self.store.live_version()

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        return self.store.weights_path(version), self.store.manifest(version)


class Swapper:
    def __init__(self, source: WeightStore | VersionSource, drafter: ServingDrafter,
                 fingerprint: TargetFingerprint, poll_seconds: float = 0.2,
                 target_embedding: torch.Tensor | None = None) -> None:
        self.source: VersionSource = LocalStore(source) if isinstance(source, WeightStore) else source
        self.drafter = drafter
        self.fingerprint = fingerprint
        self.target_embedding = target_embedding  # fills in versions that share the target's embedding
        self.poll_seconds = poll_seconds
        self.prepared: list[SwapEvent] = []
        self.refused: dict[int, str] = {}
        self._wanted: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def prepared_version(self) -> str | None:
        """The last version handed to the drafter (it serves from the drafter's next proposal)."""
        return self._wanted

    def check_once(self) -> bool:
        """Prepare the live version if it is new; True when a model was handed to the drafter."""
        try:
            live = self.source.live_version()
        except (OSError, ValueError) as error:
            log.warning("cannot read the store's live version: %s", error)
            return False
        if live is None or str(live) in (self.drafter.version, self._wanted) or live in self.refused:
            return False
        begin = time.perf_counter()
        try:
            model = self._load_checked(live)
        except (SpecdError, OSError) as error:  # bad weights, a refusing store, an unreachable learner
            self.refused[live] = str(error)
            log.error("refused drafter version %s, keeping %s: %s", live, self.drafter.version, error)
            return False
        self._wanted = str(live)
        self.drafter.offer(model, str(live))
        self.prepared.append(SwapEvent(str(live), time.perf_counter() - begin))
        log.info("drafter version %s ready; it takes over at the next step", live)
        return True

    def _load_checked(self, version: int) -> DrafterModel:
        path, manifest = self.source.fetch(version)
        digest = sha256_file(path)
        if digest != manifest.get("sha256"):
            raise CheckpointError(f"version {version}: sha256 {digest[:12]}… does not match the manifest's "
                                  f"{str(manifest.get('sha256'))[:12]}…")
        serving = self.drafter.model
        weight = next(serving.parameters())
        model = load_drafter(path, self.fingerprint, weight.dtype, weight.device,
                             target_embedding=self.target_embedding)
        if type(model) is not type(serving):
            raise CheckpointError(f"version {version} is a {type(model).__name__}; this server runs a "
                                  f"{type(serving).__name__}")
        check = getattr(self.drafter, "check_compatible", None)  # a drafter that cannot change shape says so
        if check is not None:
            check(model)
        return model

    # ---- background thread ----------------------------------------------------------------
    def start(self) -> Swapper:
        self._thread = threading.Thread(target=self._run, name="specd-swapper", daemon=True)
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
