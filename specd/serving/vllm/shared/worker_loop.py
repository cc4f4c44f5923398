"""The worker side of the online loop, shared by both vLLM routes (`custom_class` and `eagle3`).

Contract: `follow_versions(settings, ...)` opens where drafter versions come from (a local store,
or retained MQTT announcements plus HTTP fetches from the learner) and the MQTT publisher that
sends records and reports; `PinnedSource` lets an operator force a version over them.
Without `SPECD_CACHE_DIR`, fetched versions go to a temporary folder removed when the worker
exits; either way the swapper prunes it to the recent, serving and pinned versions.
`StepFaults` counts (and logs sparingly) a fault in specd's own work inside a vLLM step, which the
routes catch: an exception there would end vLLM's engine and every request in flight, while a step
can always go on without specd's drafts (they are verified either way).
`RequestBook` turns vLLM's steps into trajectory records: `observe` (the previous step's outcome,
from the sampled tokens per row), `remember` (the drafts just made) and `close_finished` (requests
that stopped this step or left vLLM become records for the telemetry threads). It reads vLLM's
buffers and the runner's request map only; nothing here imports vLLM.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, VersionSource
from specd.serving.vllm.shared.launch import PluginSettings, temporary_folder
from specd.serving.vllm.shared.telemetry import Telemetry
from specd.serving.vllm.shared.tracking import StepTracker, stop_index
from specd.transport.mqtt import MqttPublisher

log = logging.getLogger(__name__)

FAULTS_LOGGED = 3   # faults logged with their traceback; after that every 1000th


class StepFaults:
    """Faults in specd's part of vLLM's steps, each answered by the step going on without it."""

    def __init__(self) -> None:
        self.count = 0
        self.last: str | None = None

    def note(self, error: Exception, book: RequestBook) -> None:
        """Count and log `error`; the step's drafts are forgotten, as if none had been remembered."""
        self.count += 1
        self.last = f"{type(error).__name__}: {error}"[:300]
        with book.telemetry.lock:
            book.tracker.previous_rows = []
        if self.count <= FAULTS_LOGGED or self.count % 1000 == 0:
            log.error("specd's part of a vLLM step failed (%d so far); the step goes on without it", self.count,
                      exc_info=error)

    def status(self) -> dict[str, Any]:
        return {"step_faults": self.count, "last_step_fault": self.last}


class PinnedSource:
    """A version source an operator can override: a forced version wins over announcements."""

    def __init__(self, inner: VersionSource, forced: int | None = None) -> None:
        self.inner = inner
        self.forced = forced

    def live_version(self) -> int | None:
        return self.forced if self.forced is not None else self.inner.live_version()

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        return self.inner.fetch(version)

    def prune(self, keep_versions: set[int]) -> None:
        forced = set() if self.forced is None else {self.forced}
        self.inner.prune(keep_versions | forced)


def force_version(source: PinnedSource | None, version: int | None) -> None:
    """An operator's pin (None: follow announcements again). Only the choice is made here, on the
    caller's thread (vLLM's collective_rpc runs on the decoding thread): the swapper's own thread
    fetches and checks the version at its next poll."""
    if source is None:
        raise RuntimeError("specd is not loaded in this worker yet")
    source.forced = version


def find_model_runner() -> Any:
    """vLLM's model runner, found up the call stack: it holds the row -> request id map we need."""
    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and hasattr(candidate, "input_batch") and hasattr(candidate, "requests"):
            return candidate
        frame = frame.f_back  # type: ignore[assignment]
    return None


def follow_versions(settings: PluginSettings) -> tuple[PinnedSource, MqttPublisher | None]:
    """Where versions come from (forced to `settings.version` if set) and the publisher, started."""
    inner: VersionSource
    if settings.store is not None:
        inner = LocalStore(WeightStore(settings.store))
    else:
        cache = Path(settings.cache) if settings.cache else temporary_folder("specd-vllm-")
        inner = RemoteSource(cache / "fetched", settings.learner_url)
    publisher = None
    if settings.mqtt is not None:
        announce = inner.announce if isinstance(inner, RemoteSource) else None
        publisher = MqttPublisher(settings.mqtt, settings.server_id, on_announcement=announce).start()
        # records still queued when vLLM's worker ends get their moment to leave (as `specd serve`
        # gives them): multiprocessing's finaliser, since vLLM's worker processes exit through it
        multiprocessing.util.Finalize(None, publisher.stop, exitpriority=10)
    return PinnedSource(inner, settings.version), publisher


class RequestBook:
    """Per-request trajectories from vLLM's steps, and the records of finished requests."""

    def __init__(self, settings: PluginSettings, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.tracker = StepTracker(settings.server_id, settings.domain)
        self.telemetry = Telemetry(self.tracker, settings.report_seconds)

    def observe(self, request_ids: list[str], sampled: Sequence[Sequence[int]], lengths: np.ndarray,
                prompt_lengths: np.ndarray, token_ids_cpu: np.ndarray, version: int) -> list[int]:
        with self.telemetry.lock:
            return self.tracker.observe(request_ids, sampled, lengths, prompt_lengths, token_ids_cpu, version)

    def remember(self, request_ids: list[str], drafts: list[list[int]], lengths: np.ndarray, version: int,
                 sources: list[str] | None = None) -> None:
        with self.telemetry.lock:
            self.tracker.remember(request_ids, drafts, lengths, version, sources)

    def close_finished(self, requests: dict[str, Any], request_ids: list[str],
                       sampled: Sequence[Sequence[int]]) -> list[str]:
        """Hand finished requests to the record thread (stopped this step, or gone from vLLM's
        `requests`); returns their ids."""
        finished = []
        for row, request_id in enumerate(request_ids):
            state = requests.get(request_id)
            params = getattr(state, "sampling_params", None)
            trajectory = self.tracker.live.get(request_id)
            if params is None or trajectory is None:
                continue
            if trajectory.sampling is None:  # a request's params never change: read once, not every step
                trajectory.sampling = {"temperature": float(params.temperature), "top_p": float(params.top_p)}
            if not sampled[row]:
                continue
            stop_ids = set(params.stop_token_ids or ())
            if getattr(params, "eos_token_id", None) is not None:
                stop_ids.add(int(params.eos_token_id))
            output = trajectory.tokens[len(trajectory.prompt_ids):]
            keep = stop_index(output, params.max_tokens, stop_ids, self.max_model_len - len(trajectory.prompt_ids),
                              trajectory.stop_checked)
            trajectory.stop_checked = len(output)
            if keep is not None:
                self._finish(request_id, keep)
                finished.append(request_id)
        gone = [request_id for request_id in self.tracker.live if request_id not in requests]
        for request_id in gone:  # aborted, stopped by a stop string, or otherwise ended by vLLM
            self._finish(request_id, None)
        return finished + gone

    def _finish(self, request_id: str, keep: int | None) -> None:
        with self.telemetry.lock:
            trajectory = self.tracker.live.get(request_id)
            sampling = trajectory.sampling if trajectory is not None else None
            record = self.tracker.finish(request_id, keep, sampling)
        # a request never seen with its params (gone within its first step): how it sampled is not
        # known, and a record labelled greedy would teach the learner the wrong targets, so none is sent
        if record is not None and sampling is not None:
            self.telemetry.finish(record)
