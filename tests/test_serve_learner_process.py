"""`specd serve`'s embedded learner runs in a process of its own, on cores of its own, by default.

The tiny byte-level target serves through the real app; the learner child is spawned as in
production. What a server's operator reads (status, the gate's verdict on a candidate) comes
from the child through the same routes as with a learner thread.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from specd.drafter.factory import DrafterSpec, initial_model
from specd.hotswap.store import WeightStore
from specd.serving.serve import ServeOptions, build_server
from specd.testing import ByteTokenizer, tiny_loaded_target

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a learner process needs a core of its own")
TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def options(tmp_path: Path, **overrides) -> ServeOptions:
    return ServeOptions(store=str(tmp_path / "store"), model_name="tiny", drafter=DrafterSpec(head_vocab=200),
                        token=TOKEN, report_seconds=0.1, **overrides)


async def status_when(client: TestClient, ready, timeout: float = 90.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        status = await (await client.get("/v1/status")).json()
        if ready(status) or asyncio.get_running_loop().time() > deadline:
            return status
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_the_learner_trains_in_a_child_process_while_the_server_keeps_its_own_cores(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    app = build_server(options(tmp_path), loaded)  # learner_mode "auto": a process on 2+ cores
    async with TestClient(TestServer(app)) as client:
        serving = os.sched_getaffinity(0)
        for i in range(12):
            body = {"model": "tiny", "prompt": f"hello {i} " * 3, "max_tokens": 24, "temperature": 0}
            assert (await client.post("/v1/completions", json=body)).status == 200
        for _ in range(3):  # too short to train on: the child refuses them, and the server counts each
            body = {"model": "tiny", "prompt": "h", "max_tokens": 1, "temperature": 0}
            assert (await client.post("/v1/completions", json=body)).status == 200
        status = await status_when(client, lambda s: s.get("learner_steps", 0) > 0 and s.get("records_in", 0) > 0
                                   and s.get("records_refused", 0) >= 3)
        child = status["learner"]["process"]
    assert status["learner"]["running"], status
    assert status["learner_steps"] > 0 and status["records_in"] > 0, status
    assert status["records_refused"] == 3 and status["records_refused_by_reason"] == {"too-short": 3}, status
    assert child["pid"] != os.getpid()
    assert serving < before and not serving & set(child["cores"]), (serving, child)
    assert os.sched_getaffinity(0) == before  # the server gave its cores back when it stopped
    with pytest.raises(ProcessLookupError):  # and the child stopped with it
        os.kill(child["pid"], 0)


@pytest.mark.asyncio
async def test_an_operators_candidate_is_judged_by_the_childs_gate(tmp_path: Path) -> None:
    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    app = build_server(options(tmp_path, learner_mode="process"), loaded)
    store = WeightStore(tmp_path / "store")
    day0 = store.live_version()
    assert day0 is not None  # the server published the drafter it starts with, for the child to resume
    candidate = store.publish(initial_model(loaded.model, DrafterSpec(head_vocab=200), fingerprint=loaded.fingerprint),
                              loaded.fingerprint, day0, {"planted": True})
    async with TestClient(TestServer(app)) as client:
        await status_when(client, lambda s: s["learner"]["running"] and s["learner"]["process"]["pid"])
        unauthorised = await client.post("/v1/live", json={"version": candidate})
        error = (await unauthorised.json())["error"]
        assert unauthorised.status == 401
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_token")
        # no traffic yet, so the gate holds nothing out: the child says so, and nothing goes live
        response = await client.post("/v1/live", json={"version": candidate}, headers=AUTH)
        answer = await response.json()
        assert response.status == 503, answer
        assert "held-out" in answer["error"]["message"] and response.headers["Retry-After"]
    assert store.live_version() == day0


@pytest.mark.asyncio
async def test_learner_mode_thread_keeps_the_learner_in_the_server(tmp_path: Path) -> None:
    loaded = replace(tiny_loaded_target(), tokenizer=ByteTokenizer())
    before = os.sched_getaffinity(0)
    app = build_server(options(tmp_path, learner_mode="thread"), loaded)
    async with TestClient(TestServer(app)) as client:
        status = await (await client.get("/v1/status")).json()
        assert os.sched_getaffinity(0) == before
    assert status["learner"]["running"] and "process" not in status["learner"]


def test_a_candidate_sent_to_a_learner_process_that_is_not_running_fails_with_a_reason(tmp_path: Path) -> None:
    from specd.core.errors import SpecdError
    from specd.learner.config import LearnerConfig
    from specd.learner.process import LearnerProcess

    loaded = tiny_loaded_target()
    process = LearnerProcess(LearnerConfig(), tmp_path / "store", loaded.model, loaded.fingerprint,
                             loaded.model.embed.weight.dtype, [0])  # never started
    with pytest.raises(SpecdError, match="not running"):
        process.submit(1).result(timeout=1)
    assert process.stats.steps == 0 and process.staleness == {}  # nothing reported yet reads as nothing done


def test_a_server_with_a_learner_process_makes_only_the_layouts_its_own_cores_use(tmp_path: Path) -> None:
    """Built at the machine's thread count and then pinned to fewer cores, the server held a copy of
    every target layer it never used and made the ones it did in its first request."""
    import torch

    from specd.learner.process import split_cores
    from specd.model import packed_linear

    if not packed_linear.packing_enabled():
        pytest.skip("this torch has no oneDNN: no layouts are made")
    loaded, cores, threads = tiny_loaded_target(), split_cores(), torch.get_num_threads()
    assert cores is not None
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # as `specd serve` starts (tests run on one)
        build_server(options(tmp_path, learner_mode="process"), loaded)  # the app never starts: no child
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        torch.set_num_threads(len(cores[0]))
        wanted = {"panels" if packed_linear.kernel_rows(1) is not None else "transposed", "packed"}
    finally:
        torch.set_num_threads(threads)
    layers = [layer for layer in loaded.model.modules() if isinstance(layer, packed_linear.PackedLinear)]
    assert layers and all(set(layer._layouts or {}) == wanted for layer in layers), wanted


PARENT = """
import sys, time
from pathlib import Path
import torch
from specd.drafter.factory import DrafterSpec, initial_model
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.process import LearnerProcess
from specd.testing import tiny_loaded_target

if __name__ == "__main__":
    loaded, store = tiny_loaded_target(), Path(sys.argv[1])
    day0 = initial_model(loaded.model, DrafterSpec(head_vocab=200), fingerprint=loaded.fingerprint)
    weights = WeightStore(store)
    weights.set_live(weights.publish(day0, loaded.fingerprint, None, {}))
    process = LearnerProcess(LearnerConfig(), store, loaded.model, loaded.fingerprint, torch.float32, [0]).start()
    while not process.report()["alive"]:
        time.sleep(0.1)
    print(process.pid, flush=True)
    time.sleep(600)
"""


def test_a_learner_process_whose_parent_was_killed_outright_ends_too(tmp_path: Path) -> None:
    """SIGKILL (or a SIGTERM the parent did not handle) skips the parent's cleanup: `daemon` then
    stops nothing, and the learner, a gigabyte on a core of its own, stayed behind."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "store")], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the learner process outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, reaped by init any moment, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
