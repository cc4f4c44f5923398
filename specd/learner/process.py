"""The learner in a process of its own, on cores of its own: the sidecar of a deployment in miniature.

Contract: `LearnerProcess(...).start()` spawns a child that pins itself to `cores`
(`os.sched_setaffinity`), runs torch on that many threads, resumes the live version of the weight
store at `store_dir` (the caller publishes day 0 before starting it) and runs a `Learner` thread on
the records it takes from a queue. Versions go out through the store, which the serving side's
swapper watches, exactly as with `specd serve` and a remote learner. `sink` is the serving side of
the queue: `publish` never blocks (when the child falls behind, the oldest queued record is shed
and counted). `report()` is the child's latest statistics (steps, tokens trained, versions
published and rejected, its CPU seconds and wall seconds), sent every `report_every_s` and once
more when it stops; `stop()` asks the child to finish, waits, and returns the final report. A
child that dies (killed, crashed) takes nothing with it: serving goes on with the live version,
its records are shed, and the report says it is not alive and how it ended.
For a server's control plane and metrics it reads as the thread does (`specd.learner.learner.
LearnerHandle`): `stats` and `staleness` are the latest report's (at most `report_every_s` old),
and `submit(version)` sends an operator's candidate to the child's gate and resolves the
returned future with its verdict (or an error naming why, when the child is gone).
`split_cores()` gives the learner its share of this process's cores and serving the rest.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from specd.core.errors import SpecdError
from specd.drafter.checkpoint import load_drafter
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig, LearnerStats
from specd.learner.learner import Learner
from specd.learner.memory import memory_breakdown
from specd.model.fingerprint import TargetFingerprint
from specd.model.packed_linear import prepare_layouts
from specd.model.transformer import Transformer
from specd.transport.bus import BusCounters

log = logging.getLogger(__name__)


def split_cores(learner_share: float = 0.5) -> tuple[list[int], list[int]] | None:
    """(serving cores, learner cores) of this process's affinity, or None on a single core (the
    learner then shares it, as a thread with a duty cycle)."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        return None
    learner = max(1, round(len(available) * learner_share))
    learner = min(learner, len(available) - 1)
    return available[:-learner], available[-learner:]


def pin_serving(cores: list[int]) -> None:
    """This process (the server) on `cores`, torch on as many threads."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


class QueueSink:
    """The serving side: hand a record to the learner process without ever blocking."""

    def __init__(self, records: Any) -> None:
        self._records = records
        self.counters = BusCounters()

    def publish(self, record: dict[str, Any]) -> None:
        self.counters.published += 1
        try:
            self._records.put_nowait(record)
            return
        except queue.Full:
            pass
        try:  # the oldest record is the stalest training signal: it goes first
            self._records.get_nowait()
            self.counters.shed += 1
            self._records.put_nowait(record)
        except (queue.Empty, queue.Full):
            self.counters.shed += 1


class QueueBus:
    """The learner's side: take what has arrived (`specd.transport.bus.Bus`)."""

    def __init__(self, records: Any) -> None:
        self._records = records
        self.counters = BusCounters()

    def publish(self, record: dict[str, Any]) -> None:
        self._records.put_nowait(record)

    def take(self, max_records: int, timeout: float) -> list[dict[str, Any]]:
        taken: list[dict[str, Any]] = []
        try:
            taken.append(self._records.get(timeout=timeout) if timeout > 0 else self._records.get_nowait())
            while len(taken) < max_records:
                taken.append(self._records.get_nowait())
        except queue.Empty:
            pass
        self.counters.delivered += len(taken)
        return taken


@dataclass(frozen=True)
class ChildSpec:
    config: LearnerConfig
    store_dir: str
    fingerprint: TargetFingerprint
    serving_dtype: str          # torch dtype name of the versions it publishes
    cores: tuple[int, ...]
    report_every_s: float
    keep_last: int               # versions the store keeps (the demo keeps them all for its curve)
    log_level: int = logging.WARNING  # the parent's: a spawned child starts with logging unconfigured


def stats_report(stats: LearnerStats) -> dict[str, Any]:
    """`stats` as plain data for the parent (`stats_from_report` reads it back)."""
    # asdict rebuilds a Counter from (key, count) pairs, counting the pairs: refused goes over as a dict
    return {**asdict(stats), "refused": dict(stats.refused), "losses": list(stats.losses)}


def stats_from_report(raw: dict[str, Any]) -> LearnerStats:
    fields = dict(raw)
    fields["refused"] = Counter(fields.get("refused", {}))
    fields.pop("losses", None)
    return LearnerStats(**fields)


def learner_report(learner: Learner, began_cpu: float, began: float, alive: bool) -> dict[str, Any]:
    stats = learner.stats
    return {"alive": alive, "steps": stats.steps, "tokens_trained": stats.tokens_trained,
            "records_in": stats.records_in, "refused": dict(stats.refused),
            "published": list(stats.published), "rejected": len(stats.rejected),
            "training_seconds": round(stats.training_seconds, 2), "gate_waits": stats.gate_waits,
            "loop_failures": stats.loop_failures, "held_out_records": len(learner.holdout),
            "cpu_seconds": round(time.process_time() - began_cpu, 2),
            "wall_seconds": round(time.monotonic() - began, 2), "torch_threads": torch.get_num_threads(),
            "recomputed_features": getattr(learner.objective, "recompute_stats", None),
            "stats": stats_report(stats), "staleness": learner.staleness,
            "memory": memory_breakdown(learner)}


def _answer_submissions(learner: Learner, submissions: Any, verdicts: Any) -> None:
    """Hand each operator submission to the learner's own thread; its verdict goes back by id."""
    while True:
        try:
            request_id, version = submissions.get_nowait()
        except queue.Empty:
            return

        def reply(future: Future[dict[str, Any]], request_id: int = request_id) -> None:
            error = future.exception()
            verdicts.put((request_id, None if error else future.result(),
                          None if error is None else f"{type(error).__name__}: {error}"))

        learner.submit(version).add_done_callback(reply)


def run_child(spec: ChildSpec, target: Transformer, records: Any, reports: Any, stop: Any,
              submissions: Any, verdicts: Any) -> None:
    """The child's whole life: pin, resume the live version, learn until told to stop."""
    began, began_cpu = time.monotonic(), time.process_time()
    # Ctrl+C reaches the whole process group: the parent stops this child through `stop` (and, a
    # daemon, it ends with the parent), so the child's own KeyboardInterrupt would only print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # its lines say which process wrote them: they share the server's terminal (and its progress bars)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s learner process: %(message)s")
    os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(len(spec.cores))
    store = WeightStore(spec.store_dir, keep_last=spec.keep_last)
    live = store.live_version()
    if live is None:
        raise RuntimeError(f"{spec.store_dir} has no live version: publish day 0 before starting the learner")
    embedding = target.embed.weight
    initial = load_drafter(store.weights_path(live), spec.fingerprint, target_embedding=embedding)
    bus = QueueBus(records)
    learner = Learner(spec.config, bus, store, initial, spec.fingerprint,
                      getattr(torch, spec.serving_dtype), embedding, target=target).start()
    where = {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0))}

    def report(alive: bool) -> dict[str, Any]:  # records_taken: off the queue, refused ones too
        return {**learner_report(learner, began_cpu, began, alive), "records_taken": bus.counters.delivered, **where}

    reports.put(report(True))
    last_report = time.monotonic()
    parent = multiprocessing.parent_process()
    # a parent killed outright (SIGKILL, or SIGTERM to a program that does not stop us) leaves this
    # process behind: `daemon` acts only at a parent's orderly exit, so it must notice by itself
    # (by the parent's sentinel pipe, which its death closes; getppid is not reliable in every sandbox)
    while not stop.value and (parent is None or parent.is_alive()):
        time.sleep(0.05)
        _answer_submissions(learner, submissions, verdicts)
        if time.monotonic() - last_report >= spec.report_every_s:
            reports.put(report(True))
            last_report = time.monotonic()
    learner.stop()
    reports.put(report(False))


class LearnerProcess:
    def __init__(self, config: LearnerConfig, store_dir: Path, target: Transformer, fingerprint: TargetFingerprint,
                 serving_dtype: torch.dtype, cores: list[int], capacity: int = 256,
                 report_every_s: float = 1.0, keep_last: int = 5) -> None:
        context = mp.get_context("spawn")  # a fork would copy the server's threads and locks mid-use
        self._records = context.Queue(maxsize=capacity)
        # records for a learner that died are not worth waiting for at exit
        self._records.cancel_join_thread()
        self._reports = context.Queue()
        # a lock-free flag: a child killed inside an Event's wait would leave `set()` waiting for it forever
        self._stop = context.RawValue("b", 0)
        self._submissions = context.Queue()
        self._verdicts = context.Queue()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._pending_lock = threading.Lock()
        self._request_ids = itertools.count(1)
        self._verdict_reader: threading.Thread | None = None
        self.sink = QueueSink(self._records)
        target.share_memory()  # the child reads the server's weights, it does not copy them
        # sharing moved the weights into shared memory, so the layouts an engine already made of them
        # are stale: remade here, not on the server's next pass (0.2 s of the demo's first request)
        prepare_layouts(target)
        spec = ChildSpec(config, str(store_dir), fingerprint, str(serving_dtype).removeprefix("torch."),
                         tuple(cores), report_every_s, keep_last, logging.getLogger().getEffectiveLevel())
        self.cores = list(cores)
        self._process = context.Process(target=run_child, args=(spec, target, self._records, self._reports,
                                                                 self._stop, self._submissions, self._verdicts),
                                        name="specd-learner", daemon=True)
        self._last: dict[str, Any] = {"alive": False, "steps": 0, "tokens_trained": 0, "published": []}

    def start(self) -> LearnerProcess:
        self._process.start()
        self._verdict_reader = threading.Thread(target=self._read_verdicts, name="specd-learner-verdicts",
                                                daemon=True)
        self._verdict_reader.start()
        return self

    # ---- what a server's control plane and metrics read --------------------------------------
    @property
    def stats(self) -> LearnerStats:
        return stats_from_report(self._refresh().get("stats") or {})

    @property
    def staleness(self) -> dict[str, Any]:
        return dict(self._refresh().get("staleness") or {})

    def health(self) -> dict[str, Any]:
        """As `Learner.health`, and where the child runs: its pid, cores, and exit code once it ended."""
        report = self.report()
        stats = report.get("stats") or {}
        return {"running": report["alive"], "process": {"pid": self.pid, "cores": self.cores,
                                                        "exitcode": report["exitcode"]},
                "loop_failures": stats.get("loop_failures", 0), "last_failure": stats.get("last_failure"),
                "gate_waits": stats.get("gate_waits", 0), "held_out_records": report.get("held_out_records", 0)}

    def submit(self, version: int) -> Future[dict[str, Any]]:
        """The operator's candidate through the child's gate (see `Learner.submit`)."""
        future: Future[dict[str, Any]] = Future()
        if not self._process.is_alive():
            future.set_exception(SpecdError("the learner process is not running"))
            return future
        request_id = next(self._request_ids)
        with self._pending_lock:
            self._pending[request_id] = future
        self._submissions.put((request_id, version))
        return future

    def _read_verdicts(self) -> None:
        while self._process.is_alive() or not self._verdicts.empty():
            try:
                request_id, verdict, error = self._verdicts.get(timeout=0.2)
            except queue.Empty:
                continue
            with self._pending_lock:
                future = self._pending.pop(request_id, None)
            if future is not None and not future.done():  # a caller may have given up on it (cancelled)
                if error is None:
                    future.set_result(verdict)
                else:
                    future.set_exception(SpecdError(error))
        with self._pending_lock:  # the child is gone: nobody will answer these
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(SpecdError("the learner process ended before judging this version"))

    def _refresh(self) -> dict[str, Any]:
        while True:
            try:
                self._last = self._reports.get_nowait()
            except queue.Empty:
                break
        # what the child has taken off the queue (refused records too): "delivered", as a bus counts it
        self.sink.counters.delivered = int(self._last.get("records_taken", 0))
        return self._last

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def report(self) -> dict[str, Any]:
        """The child's latest report, with whether it is alive now and its exit code if it ended."""
        self._refresh()
        alive = self._process.is_alive()
        return {**self._last, "alive": alive, "exitcode": None if alive else self._process.exitcode,
                "cores": self.cores, "records_shed": self.sink.counters.shed,
                "records_sent": self.sink.counters.published}

    def wait_ready(self, timeout: float = 120.0) -> bool:
        """Block until the child has resumed the live version and reported (or died)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self._process.is_alive():
            try:
                self._last = self._reports.get(timeout=0.2)
                return True
            except queue.Empty:
                continue
        return False

    def stop(self, timeout: float = 60.0) -> dict[str, Any]:
        self._stop.value = 1
        deadline = time.monotonic() + timeout
        final = None
        while time.monotonic() < deadline and (self._process.is_alive() or final is None):
            try:
                report = self._reports.get(timeout=0.2)
            except queue.Empty:
                if not self._process.is_alive():
                    break
                continue
            self._last = report
            if not report.get("alive", True):
                final = report
        self._process.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            log.warning("the learner process did not stop in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        return self.report()


def config_for_process(config: LearnerConfig) -> LearnerConfig:
    """A learner on cores of its own trains all the time: the duty cycle was for sharing cores."""
    return replace(config, duty_cycle=1.0)
