"""Hot-swap under faults: transient fetch failures retry with backoff, bad weights are refused for good,
the fetched-weights cache stays bounded, and the vLLM proposer's temporary folders go away.

A learner is stood in for by a local HTTP server over a real weight store that can fail on purpose
(hang, answer 503, cut the body short, lie about the sha256); no vLLM server runs here."""

from __future__ import annotations

import http.server
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, fixed_k, tiny_target

from specd.core.errors import TransportError
from specd.core.threads import BackgroundHealth
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine
from specd.engine.request import SamplingParams
from specd.hotswap.remote import RemoteSource
from specd.hotswap.store import WeightStore
from specd.hotswap.swapper import LocalStore, Swapper
from specd.model.fingerprint import TargetFingerprint
from specd.serving.vllm.shared.launch import OWNER_FILE, temporary_folder
from specd.serving.vllm.shared.worker_loop import PinnedSource, force_version
from specd.testing.processes import free_port

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


class FakeLearner(http.server.ThreadingHTTPServer):
    """The learner's version routes over a store; `faults` lists what the next weight requests suffer."""

    daemon_threads = True

    def __init__(self, store: WeightStore) -> None:
        super().__init__(("127.0.0.1", 0), LearnerHandler)
        self.store = store
        self.faults: list[str] = []      # "hang", "503" or "cut", one per weight request, first first
        self.lie_about: set[int] = set()  # versions whose manifest names a wrong sha256
        self.weight_requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class LearnerHandler(http.server.BaseHTTPRequestHandler):
    server: FakeLearner

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")  # v1 versions N [weights]
        version = int(parts[2])
        if len(parts) == 3:
            manifest = self.server.store.manifest(version)
            if version in self.server.lie_about:
                manifest["sha256"] = "0" * 64
            return self._send(json.dumps(manifest).encode())
        self.server.weight_requests += 1
        fault = self.server.faults.pop(0) if self.server.faults else None
        body = self.server.store.weights_path(version).read_bytes()
        if fault == "hang":
            time.sleep(1.0)
        if fault == "503":
            return self._send(b"busy", status=503)
        if fault == "cut":  # promises the whole file, sends half, hangs up
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return None
        return self._send(body)

    def _send(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> WeightStore:
    store = WeightStore(tmp_path / "store")
    target = tiny_target()
    for seed in range(6):
        store.publish(new_drafter_model(target, SHAPE, seed=seed), FINGERPRINT, None, {})
    return store


@pytest.fixture
def learner(store: WeightStore) -> Iterator[FakeLearner]:
    server = FakeLearner(store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def serving() -> TokenDrafter:
    """A drafter serving version 1 (the store's first)."""
    return TokenDrafter(new_drafter_model(tiny_target(), SHAPE, seed=0), 1)


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("fault", ["hang", "503", "cut", "unreachable"])
def test_a_version_that_cannot_be_fetched_is_retried_and_serves_once_the_learner_answers(
        tmp_path: Path, store: WeightStore, learner: FakeLearner, fault: str) -> None:
    cache = tmp_path / "cache"
    remote = RemoteSource(cache, learner.url, timeout=0.3)
    if fault == "unreachable":
        remote.announce({"version": 2, "url": f"http://127.0.0.1:{free_port()}"})
    else:
        remote.announce({"version": 2, "url": learner.url})
        learner.faults = [fault]
    drafter, clock = serving(), Clock()
    swapper = Swapper(remote, drafter, FINGERPRINT, clock=clock)
    assert swapper.check_once() is False
    assert swapper.retrying == {2: 1} and swapper.fetch_failures == 1 and not swapper.refused
    assert files(cache) == []  # nothing half-written is left to pass for a complete file
    remote.announce({"version": 2, "url": learner.url})  # the learner is back (or was there all along)
    clock.now += swapper.retry_cap
    assert swapper.check_once() is True
    assert swapper.retrying == {} and not swapper.refused
    Engine(tiny_target(), drafter, fixed_k(num_draft_tokens=2)).generate([[4, 5]], SamplingParams(max_tokens=3))
    assert drafter.version == 2


def test_weights_that_fail_their_sha256_are_refused_for_good_and_not_fetched_again(
        tmp_path: Path, store: WeightStore, learner: FakeLearner) -> None:
    learner.lie_about = {2}
    remote = RemoteSource(tmp_path / "cache", learner.url)
    remote.announce({"version": 2, "url": learner.url})
    drafter = serving()
    swapper = Swapper(remote, drafter, FINGERPRINT)
    assert swapper.check_once() is False
    assert "sha256" in swapper.refused[2] and swapper.retrying == {} and swapper.fetch_failures == 0
    assert files(tmp_path / "cache") == []  # the wrong bytes are not kept
    for _ in range(3):
        assert swapper.check_once() is False
    assert learner.weight_requests == 1 and drafter.version == 1


def test_a_corrupt_cached_file_is_fetched_again(tmp_path: Path, store: WeightStore, learner: FakeLearner) -> None:
    remote = RemoteSource(tmp_path / "cache", learner.url)
    remote.path(3).write_bytes(store.weights_path(3).read_bytes()[:100])  # a file cut short by a disk fault
    path, _ = remote.fetch(3)
    assert path.read_bytes() == store.weights_path(3).read_bytes() and learner.weight_requests == 1
    remote.fetch(3)  # a good cached file is not fetched again
    assert learner.weight_requests == 1


class FlakySource:
    """A local store whose fetches of `failing` versions time out; counts fetches per version."""

    def __init__(self, store: WeightStore, live: int) -> None:
        self.inner, self.live = LocalStore(store), live
        self.failing: set[int] = set()
        self.fetches: list[int] = []

    def live_version(self) -> int | None:
        return self.live

    def fetch(self, version: int) -> tuple[Path, dict[str, Any]]:
        self.fetches.append(version)
        if version in self.failing:
            raise TransportError(f"version {version}: timed out")
        return self.inner.fetch(version)

    def prune(self, keep_versions: set[int]) -> None:
        pass


def test_backoff_grows_to_its_cap_and_a_newer_version_supersedes_the_retry(
        store: WeightStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda low, high: high)  # the jitter's upper bound, every time
    source, clock = FlakySource(store, live=2), Clock()
    source.failing = {2}
    swapper = Swapper(source, serving(), FINGERPRINT, retry_base=1.0, retry_cap=8.0, clock=clock)
    delays = []
    for _ in range(5):
        assert swapper.check_once() is False
        delays.append(swapper.retry_at - clock.now)
        assert swapper.check_once() is False  # waiting: no fetch before the delay is over
        clock.now = swapper.retry_at
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert source.fetches == [2] * 5 and swapper.retrying == {2: 5} and swapper.fetch_failures == 5
    source.live = 3  # published while version 2 waits for its next try: fetched at once
    clock.now -= 1.0
    assert swapper.check_once() is True
    assert source.fetches[-1] == 3 and swapper.retrying == {} and swapper.prepared_version == 3


def test_a_version_that_stopped_being_live_while_it_loaded_is_not_offered(store: WeightStore) -> None:
    source = FlakySource(store, live=3)  # the drafter serves version 1
    inner_fetch = source.fetch

    def fetch_while_an_operator_rolls_back(version: int) -> tuple[Path, dict[str, Any]]:
        fetched = inner_fetch(version)
        source.live = 2  # a rollback lands while version 3 is loaded and checked
        return fetched

    source.fetch = fetch_while_an_operator_rolls_back  # type: ignore[method-assign]
    drafter = serving()
    swapper = Swapper(source, drafter, FINGERPRINT)
    assert swapper.check_once() is False and swapper.prepared_version is None
    assert drafter.take() is None  # nothing handed to the drafter
    source.fetch = inner_fetch  # type: ignore[method-assign]
    assert swapper.check_once() is True and swapper.prepared_version == 2 and source.fetches == [3, 2]


def test_a_rollback_before_the_prepared_version_served_withdraws_it(store: WeightStore) -> None:
    # an idle server: version 3 is prepared but no step has taken it when the operator rolls back
    store.set_live(1)
    store.set_live(3)
    drafter = serving()
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    assert swapper.check_once() is True and swapper.prepared_version == 3
    store.rollback(1)
    assert swapper.check_once() is False and swapper.prepared_version == 1
    assert drafter.apply_pending() is False and drafter.version == 1 and drafter.num_swaps == 0
    assert swapper.check_once() is False and drafter.take() is None   # nothing offered again


def test_a_prepared_version_a_step_took_just_before_the_rollback_is_swapped_back(store: WeightStore) -> None:
    store.set_live(1)
    store.set_live(3)
    drafter = serving()
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    assert swapper.check_once() is True
    store.rollback(1)
    real_withdraw = drafter.withdraw

    def taken_first() -> int | None:   # the decoding thread's step wins the race for the offer
        assert drafter.apply_pending() and drafter.version == 3
        return real_withdraw()

    drafter.withdraw = taken_first  # type: ignore[method-assign]
    assert swapper.check_once() is True and swapper.prepared_version == 1   # the live version offered again
    assert drafter.apply_pending() and drafter.version == 1


def test_force_version_only_pins_and_the_swapper_thread_fetches(store: WeightStore) -> None:
    flaky = FlakySource(store, live=1)
    pinned = PinnedSource(flaky)  # type: ignore[arg-type]
    swapper = Swapper(pinned, serving(), FINGERPRINT)
    force_version(pinned, 4)  # what collective_rpc runs on vLLM's decoding thread
    assert flaky.fetches == [] and swapper.prepared_version is None
    assert swapper.check_once() is True and flaky.fetches == [4]


def test_a_pin_to_a_version_not_yet_published_waits_for_it_instead_of_refusing_it(store: WeightStore) -> None:
    now = [0.0]
    pinned = PinnedSource(LocalStore(store))
    swapper = Swapper(pinned, serving(), FINGERPRINT, clock=lambda: now[0])
    force_version(pinned, 7)  # the store holds versions 1-6
    assert swapper.check_once() is False and 7 not in swapper.refused and swapper.retrying == {7: 1}
    assert swapper.report() == {"prepared_version": None, "refused_versions": {}, "retrying_versions": {7: 1},
                                "fetch_failures": 1}   # what a vLLM server's specd_status shows of the wait
    store.publish(new_drafter_model(tiny_target(), SHAPE, seed=7), FINGERPRINT, None, {})
    now[0] += 60  # past the backoff
    assert swapper.check_once() is True and swapper.prepared_version == 7


def test_a_version_counts_as_prepared_only_once_it_is_offered_to_the_drafter(store: WeightStore) -> None:
    # a test (or an operator) that waits for `prepared_version` then sends a request must find the
    # version pending for the drafter's next step, however long the drafter takes to prepare it
    store.set_live(3)
    drafter = serving()
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    seen_while_offering: list[int | None] = []
    real_offer = drafter.offer

    def watched_offer(model: Any, version: int) -> None:
        seen_while_offering.append(swapper.prepared_version)
        real_offer(model, version)

    drafter.offer = watched_offer  # type: ignore[method-assign]
    assert swapper.check_once() is True
    assert seen_while_offering == [None] and swapper.prepared_version == 3
    assert drafter.apply_pending() and drafter.version == 3


def test_an_unexpected_failure_restarts_the_swapper_thread_and_is_counted(store: WeightStore) -> None:
    store.set_live(1)
    swapper = Swapper(LocalStore(store), serving(), FINGERPRINT, poll_seconds=0.01)
    real_check, calls = swapper.check_once, []

    def fails_once() -> bool:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in a check")
        return real_check()

    swapper.check_once = fails_once  # type: ignore[method-assign]
    health = BackgroundHealth()
    swapper.start(health)
    try:
        store.set_live(3)
        deadline = time.monotonic() + 20
        while swapper.prepared_version != 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        swapper.stop()
    assert swapper.prepared_version == 3  # swaps go on after the failure
    task = health.snapshot()["swapper"]
    assert task["failures"] == 1 and task["restarts"] == 1 and "a bug in a check" in str(task["last_error"])


def test_the_cache_keeps_the_newest_versions_and_the_serving_one(
        tmp_path: Path, store: WeightStore, learner: FakeLearner) -> None:
    cache = tmp_path / "cache"
    remote = RemoteSource(cache, learner.url, keep=2)
    drafter = serving()  # serves version 1 throughout: no step runs to switch it
    remote.fetch(1)
    swapper = Swapper(remote, drafter, FINGERPRINT)
    for version in range(2, 7):
        remote.announce({"version": version, "url": learner.url})
        assert swapper.check_once() is True
        assert remote.cached_versions() == sorted({1, version - 1, version})
    assert drafter.version == 1 and remote.path(1).is_file()


def test_prune_keeps_pinned_versions_and_removes_stale_partial_downloads(
        tmp_path: Path, store: WeightStore, learner: FakeLearner) -> None:
    remote = RemoteSource(tmp_path / "cache", learner.url, keep=1)
    for version in (1, 2, 3):
        remote.fetch(version)
    stale, fresh = tmp_path / "cache" / ".000004.safetensors.a.part", tmp_path / "cache" / ".000004.safetensors.b.part"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    PinnedSource(remote, forced=1).prune({2})
    assert remote.cached_versions() == [1, 2, 3]
    assert not stale.exists() and fresh.exists()  # a download that may still be running is left alone
    remote.prune(set())
    assert remote.cached_versions() == [3]


def run_python(code: str, tmp: Path) -> str:
    env = {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_the_workers_temporary_folder_is_removed_when_its_process_exits(tmp_path: Path) -> None:
    made = run_python("from specd.serving.vllm.shared.launch import temporary_folder as t; f = t('specd-vllm-'); "
                      "(f / 'fetched').mkdir(); print(f)", tmp_path)
    assert made.startswith(str(tmp_path)) and not Path(made).exists()


def test_an_export_folder_outlives_its_process_until_the_next_export(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    made = Path(run_python("from specd.serving.vllm.shared.launch import temporary_folder as t; "
                           "print(t('specd-eagle3-', remove_at_exit=False))", tmp_path))
    assert made.is_dir()  # vLLM (exec'd in the same process) or a printed command still reads it
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    alive = Path(temporary_folder("specd-eagle3-", remove_at_exit=False))  # owned by this test, alive
    foreign = tmp_path / "specd-eagle3-not-ours"
    foreign.mkdir()  # no owner file: never touched
    newest = temporary_folder("specd-eagle3-", remove_at_exit=False)
    assert not made.exists() and alive.is_dir() and foreign.is_dir() and newest.is_dir()
    assert (newest / OWNER_FILE).read_text() == str(os.getpid())


class StatusOnly(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"live": 7}).encode() if self.path == "/v1/status" else b"{}"
        self.send_response(200 if self.path == "/v1/status" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_sidecar_server_asks_the_learner_for_its_live_version_without_waiting_for_the_broker(tmp_path) -> None:
    """Started while the broker was down, it served the built-in drafter until the broker came back."""
    from specd.serving.serve import ServeOptions, _sidecar_wiring
    from specd.testing import tiny_loaded_target
    from specd.transport.mqtt import MqttSettings

    learner = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StatusOnly)
    threading.Thread(target=learner.serve_forever, daemon=True).start()
    try:
        down_broker = MqttSettings(port=free_port())
        url = f"http://127.0.0.1:{learner.server_address[1]}"
        wiring = _sidecar_wiring(ServeOptions(learner_url=url), down_broker, tiny_loaded_target(), tmp_path)
        assert wiring.source.live_version() == 7
        unreachable = f"http://127.0.0.1:{free_port()}"  # no learner there: the announcement will tell
        wiring = _sidecar_wiring(ServeOptions(learner_url=unreachable), down_broker, tiny_loaded_target(), tmp_path)
        assert wiring.source.live_version() is None
    finally:
        learner.shutdown()
