"""`specd learner --ranks 2` end to end: torchrun, two gloo ranks, a real Mosquitto, shared subscriptions.

Records carry token ids only (as vLLM's servers send them), so each rank recomputes the features
of its own records with its copy of the tiny target. Every record must reach exactly one rank
(each rank's spool says which it took), both ranks must hold identical weights after the same
step, only rank 0 publishes, and a rank killed mid-run must cost no acknowledged record: torchrun
restarts the group, which resumes from the last published version. A plain learner is refused on
the group's store, and ranks whose launcher is killed outright stop rather than hold the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from specd.core.records import TrajectoryRecord
from specd.learner.ranks import read_statuses
from specd.testing.processes import Broker, SpecdProcess, free_port, get_json, tiny_checkpoint, wait_for

pytestmark = [pytest.mark.mqtt, pytest.mark.slow]

DEPLOYMENT = "ranks"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ranks")


@pytest.fixture(scope="module")
def broker(folder):
    broker = Broker(folder / "broker").start()
    yield broker
    broker.stop()


@pytest.fixture(scope="module")
def learner(folder, broker):
    """One group for the module: the kill test runs last, on the group the first test saw."""
    learner = start_ranks(folder, broker)
    yield learner
    learner.stop()


def record(i: int) -> dict:
    """A record as a vLLM server sends it: token ids only, no features."""
    prompt = [1 + (i * 7 + j) % 400 for j in range(12)]
    output = [1 + (i * 11 + j * 3) % 400 for j in range(20)]
    return TrajectoryRecord(uuid.UUID(int=i).hex, "server-x", prompt, output, [], 0.0, 1.0, 0.0, 0.0,
                            "chat").to_dict()


def publish_records(broker: Broker, numbers: range) -> None:
    """QoS 1: each publish returns once the broker has acknowledged the record."""
    import aiomqtt

    async def send() -> None:
        async with aiomqtt.Client("127.0.0.1", broker.port) as client:
            for i in numbers:
                await client.publish(f"specd/{DEPLOYMENT}/records/server-x", json.dumps(record(i)), qos=1)

    asyncio.run(send())


def spooled_ids(store: Path) -> dict[int, set[str]]:
    """The record ids each rank took, from its spool (every record it ever acknowledged)."""
    taken = {}
    for rank in (0, 1):
        path = store / f"rank-{rank}" / "spool.sqlite3"
        with sqlite3.connect(path) as db:
            taken[rank] = {row[0] for row in db.execute("SELECT record_id FROM seen")}
    return taken


def start_ranks(tmp_path: Path, broker: Broker) -> SpecdProcess:
    args = ["learner", "--ranks", "2", "--store", str(tmp_path / "store"), "--broker", broker.url,
            "--deployment", DEPLOYMENT, "--target", str(tiny_checkpoint(tmp_path / "tiny")),
            "--publish-every", "2", "--holdout-every", "4", "--rank-status-every", "5"]
    return SpecdProcess(args, free_port(), tmp_path / "learner.log").start(timeout=300)


def same_weights_after_the_same_step(store: Path) -> bool:
    statuses = read_statuses(store)
    if len(statuses) != 2:
        return False
    first, second = statuses
    return bool(first.get("digest_at_sync") and first["digest_at_sync"] == second.get("digest_at_sync")
                and first["digest"] == second["digest"])


def test_two_ranks_share_the_records_and_hold_the_same_weights(folder, learner, broker) -> None:
    store = folder / "store"
    publish_records(broker, range(40))
    wait_for(lambda: sum(len(ids) for ids in spooled_ids(store).values()) >= 40, 120, what="records spooled")
    taken = spooled_ids(store)
    assert taken[0].isdisjoint(taken[1]) and taken[0] | taken[1] == {record(i)["record_id"] for i in range(40)}
    assert taken[0] and taken[1]  # the shared subscription dealt to both
    wait_for(lambda: same_weights_after_the_same_step(store), 180, what="both ranks at one step")
    status = get_json(learner.url + "/v1/status")
    assert [r["rank"] for r in status["ranks"]] == [0, 1]


def test_a_killed_rank_loses_no_acknowledged_record_and_the_group_resumes(folder, learner, broker) -> None:
    store = folder / "store"
    live = wait_for(lambda: (v := get_json(learner.url + "/v1/versions")["live"]) and v >= 2 and v, 180,
                    what="a published version")
    victim = next(s for s in read_statuses(store) if s["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    publish_records(broker, range(40, 80))  # acknowledged by the broker while the group restarts
    wait_for(lambda: len(read_statuses(store)) == 2 and all(s["restart"] >= 1 for s in read_statuses(store)),
             240, what="the group restarted")
    wait_for(lambda: sum(len(ids) for ids in spooled_ids(store).values()) >= 80, 180, what="records spooled")
    taken = spooled_ids(store)
    assert taken[0] | taken[1] == {record(i)["record_id"] for i in range(80)}
    assert taken[0].isdisjoint(taken[1])
    resumed = {s["rank"]: s["started_from"] for s in read_statuses(store)}
    assert resumed[0] >= live and resumed[0] == resumed[1]
    versions = get_json(learner.url + "/v1/versions")["versions"]
    numbers = [v["version"] for v in versions]
    assert len(numbers) == len(set(numbers))
    assert all(v["rank"] == 0 for v in versions)  # every manifest names its publisher: rank 0


def test_a_plain_learner_is_refused_on_the_groups_store(folder, learner, broker) -> None:
    plain = subprocess.run([sys.executable, "-m", "specd.cli.main", "learner", "--store", str(folder / "store"),
                            "--broker", broker.url, "--deployment", DEPLOYMENT, "--client-id", "intruder",
                            "--target", str(tiny_checkpoint(folder / "tiny")), "--port", str(free_port())],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0
    assert "another learner (pid" in plain.stderr and "one learner per store" in plain.stderr


def test_ranks_stop_when_their_launcher_is_killed_outright(folder, learner, broker) -> None:
    """Last: it kills the module's group. kill -9 reaches no child; the ranks notice and stop."""
    ranks = [s["pid"] for s in read_statuses(folder / "store")]
    assert len(ranks) == 2
    learner.kill()

    def gone(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        return state == "Z"

    wait_for(lambda: all(gone(pid) for pid in ranks), 60, what="the ranks to stop")
