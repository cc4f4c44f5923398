"""Records left behind by learners that will not run on a store again are taken over, never stranded.

A store that had ranks and now has a plain learner (or fewer ranks, or ranks after a plain
learner) holds their spools and, at the broker, their persistent sessions, which keep queuing
records. The learner that starts takes both over; a folder a leftover process still holds is
refused with its pid; a group's launcher says what would make every rank fail before torchrun
starts them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import aiomqtt
import pytest

from specd.core.errors import StoreError
from specd.core.records import TrajectoryRecord
from specd.learner.claim import claim
from specd.learner.ranks import status_path
from specd.learner.sidecar import Sidecar, SidecarOptions
from specd.learner.spool import RecordSpool, SpoolConfig
from specd.learner.takeover import SESSION_FILE, left_behind, mark_session
from specd.testing import tiny_loaded_target
from specd.testing.processes import Broker
from specd.transport.mqtt import MqttSettings
from specd.transport.retirement import retire_session


def record(i: int) -> dict:
    return TrajectoryRecord(uuid.UUID(int=i).hex, "server-x", [1 + (i + j) % 200 for j in range(6)],
                            [1 + (i * 3 + j) % 200 for j in range(10)], [], 0.0, 1.0, 0.0, 0.0, "chat").to_dict()


def rank_spool(store: Path, rank: int, numbers: range) -> Path:
    """What rank `rank` of a group left: its spool with these records, its session marker, its status."""
    folder = store / f"rank-{rank}"
    spool = RecordSpool(folder, SpoolConfig(), lambda: 1000)
    list(spool.load())
    for i in numbers:
        assert spool.add(record(i))
    spool.close()
    mark_session(folder, f"specd-learner-rank{rank}", "specd-learner")
    status_path(store, rank).parent.mkdir(parents=True, exist_ok=True)
    status_path(store, rank).write_text(json.dumps({"rank": rank, "time": 0}))
    return folder


def test_which_folders_a_learner_takes_over(tmp_path: Path) -> None:
    store = tmp_path / "store"
    for rank in (0, 1, 2):
        rank_spool(store, rank, range(rank * 10, rank * 10 + 1))
    assert left_behind(store, None) == [store / "rank-0", store / "rank-1", store / "rank-2"]
    assert left_behind(store, 2) == [store / "rank-2"]  # a group of two: rank 2 will not run again
    mark_session(store, "specd-learner", None)           # a plain learner ran here too
    assert left_behind(store, 3) == [store]


def test_a_plain_learner_takes_over_the_records_of_the_ranks_before_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    rank_spool(store, 0, range(0, 5))
    rank_spool(store, 1, range(5, 9))
    sidecar = Sidecar(SidecarOptions(store=str(store)), tiny_loaded_target())
    try:
        assert sidecar.spool.records_in == 9 and sidecar.bus.backlog == 9
        assert not (store / "rank-0" / "spool.sqlite3").exists() and not (store / "rank-1" / "spool.sqlite3").exists()
        assert not status_path(store, 0).exists()   # no stale rank in /v1/status
        # their broker sessions are still to end: the folders (marker, lock) stay until then
        assert sidecar.left_behind is not None
        assert [(folder.name, client) for folder, _, client, _ in sidecar.left_behind.taken] == \
            [("rank-0", "specd-learner-rank0"), ("rank-1", "specd-learner-rank1")]
        assert (store / "rank-0" / SESSION_FILE).exists()
    finally:
        sidecar.spool.close()
        sidecar.release()


def test_a_folder_a_leftover_rank_still_holds_is_refused_with_its_pid(tmp_path: Path) -> None:
    store = tmp_path / "store"
    rank_spool(store, 2, range(3))
    leftover = claim(store / "rank-2", "test")
    try:
        with pytest.raises(StoreError, match=f"pid {os.getpid()}"):
            Sidecar(SidecarOptions(store=str(store)), tiny_loaded_target())
    finally:
        leftover.release()


def test_a_group_is_refused_before_torchrun_while_a_plain_learner_holds_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    plain = claim(store, "test")
    try:
        done = subprocess.run([sys.executable, "-m", "specd.cli.main", "learner", "--ranks", "2", "--store",
                               str(store), "--broker", "mqtt://127.0.0.1:1", "--port", "0"],
                              capture_output=True, text=True, timeout=120)
    finally:
        plain.release()
    assert done.returncode != 0
    assert f"another learner (pid {os.getpid()}) is running on {store}" in done.stderr
    assert "torchrun" not in done.stderr.lower() and "Traceback" not in done.stderr


@pytest.mark.mqtt
@pytest.mark.parametrize("share_group", [None, "specd-learner"], ids=["plain session", "rank session"])
def test_a_retired_session_hands_over_what_the_broker_queued_for_it_and_gets_no_more(
        tmp_path: Path, share_group: str | None) -> None:
    broker = Broker(tmp_path / "broker").start()
    settings = MqttSettings.from_url(broker.url, deployment="takeover")
    client_id = "specd-learner-rank2" if share_group else "specd-learner"
    records = settings.topic("records") + "/+"
    topic = records if share_group is None else f"$share/{share_group}/{records}"

    async def scenario() -> tuple[list[str], list[str]]:
        async with settings.client(identifier=client_id, clean_session=False, persistent_v5=share_group is not None) \
                as member:
            await member.subscribe(topic, qos=1)
        async with aiomqtt.Client("127.0.0.1", broker.port) as sender:  # the member is gone: queued for it
            for i in range(5):
                await sender.publish(settings.topic("records", "s"), json.dumps(record(i)), qos=1)
        taken: list[str] = []

        async def handle(_: str, payload: bytes) -> None:
            taken.append(json.loads(payload)["record_id"])

        assert await retire_session(settings, client_id, share_group, handle, quiet_s=1.0) == 5
        async with aiomqtt.Client("127.0.0.1", broker.port) as sender:
            await sender.publish(settings.topic("records", "s"), json.dumps(record(9)), qos=1)
        late: list[str] = []
        async with settings.client(identifier=client_id, clean_session=False, persistent_v5=share_group is not None) \
                as again:
            try:
                async with asyncio.timeout(1.5):
                    async for message in again.messages:
                        late.append(json.loads(bytes(message.payload))["record_id"])
            except TimeoutError:
                pass
        return taken, late

    try:
        taken, late = asyncio.run(scenario())
    finally:
        broker.stop()
    assert sorted(taken) == sorted(record(i)["record_id"] for i in range(5))
    assert late == []  # the session ended: nothing more was queued for it
