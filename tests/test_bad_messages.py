"""What arrives over MQTT is untrusted: a message the learner cannot use is refused and counted by
reason, never raised (an unacknowledged message would come back at every reconnect and block the
records behind it), floods are logged sparingly, the acceptance log stays bounded whatever reports
name, and a server ignores announcements that name no version or no http(s) learner."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest

from specd.control import acceptance as acceptance_module
from specd.control.acceptance import AcceptanceLog
from specd.core.errors import RecordRefused
from specd.core.records import MAX_REPORT_ENTRIES, validate_record, validate_report
from specd.learner.intake import LOGGED_PER_REASON, note_refusal

VOCAB = 64


def good_record(**changes) -> dict:
    record = {"schema_version": 1, "record_id": "r1", "server_id": "s", "prompt_ids": [1, 2], "output_ids": [3, 4],
              "steps": [], "temperature": 0.0, "top_p": 1.0, "created": 1.0, "finished": 2.0}
    return {**record, **changes}


def test_a_good_record_passes_validation() -> None:
    from specd.core.records import SCHEMA_VERSION

    assert validate_record(good_record(schema_version=SCHEMA_VERSION), VOCAB).temperature == 0.0


@pytest.mark.parametrize("changes", [
    {"temperature": 10**400}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -5},
    {"temperature": "hot"}, {"top_p": 7}, {"top_p": 0}, {"created": 10**400}, {"finished": -math.inf},
    {"record_id": {"a": 1}}, {"record_id": True}, {"server_id": "x" * 100_000}, {"domain": ["chat"]}])
def test_numbers_and_names_a_record_could_not_mean_are_refused(changes: dict) -> None:
    from specd.core.records import SCHEMA_VERSION

    with pytest.raises(RecordRefused):
        validate_record(good_record(schema_version=SCHEMA_VERSION, **changes), VOCAB)


@pytest.mark.parametrize("report", [
    {"server_id": "a", "versions": {}, "time": 10**400},
    {"server_id": "a", "versions": {str(v): {"drafts": 1, "accepted": 1} for v in range(MAX_REPORT_ENTRIES + 1)}},
    {"server_id": "x" * 1000, "versions": {}}])
def test_reports_that_name_too_much_or_impossible_times_are_refused(report: dict) -> None:
    with pytest.raises(RecordRefused):
        validate_report(report)


def test_the_acceptance_log_stays_bounded_whatever_reports_name(monkeypatch) -> None:
    monkeypatch.setattr(acceptance_module, "MAX_TRACKED", 50)
    monkeypatch.setattr(acceptance_module, "MAX_VERSIONS", 20)
    log = AcceptanceLog()
    for server in range(30):
        log.add({"server_id": f"s{server}", "time": 1.0,
                 "versions": {str(server * 10 + v): {"drafts": 2, "accepted": 1} for v in range(10)}})
    assert len(log._last) <= 50 and len(log.totals) <= 20
    assert max(log.totals) == 299  # the newest versions are the ones kept


def test_a_flood_of_refusals_is_counted_in_full_and_logged_sparingly(caplog) -> None:
    from collections import Counter

    counts: Counter = Counter()
    with caplog.at_level(logging.WARNING, logger="specd.learner.intake"):
        for _ in range(2500):
            note_refusal(counts, "malformed", "a record")
    assert counts["malformed"] == 2500
    assert len(caplog.records) == LOGGED_PER_REASON + 2  # the first ten, then the 1000th and the 2000th


@pytest.mark.parametrize("payload", [b"[" * 200_000, b"\xff\xfe", b"[1]",
                                     json.dumps({"server_id": "a", "versions": {}, "time": 10**400}).encode()])
def test_the_sidecar_refuses_poison_messages_without_raising(tmp_path: Path, payload: bytes) -> None:
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store")), tiny_loaded_target())
    topic = "specd/default/reports/a" if payload.startswith(b"{") else "specd/default/records/a"
    asyncio.run(sidecar.handle(topic, payload))  # must not raise: the message is refused and acknowledged
    status = sidecar.status()
    assert status["records_refused"] == 1 and sum(status["records_refused_by_reason"].values()) == 1


def test_the_learner_refuses_an_unforeseen_fault_as_one_record_not_the_batch(monkeypatch) -> None:
    from specd.core.records import SCHEMA_VERSION
    from specd.learner import intake as intake_module
    from specd.learner.config import LearnerStats
    from specd.learner.intake import Intake
    from specd.transport.bus import InProcessBus

    def validate(raw, *args):  # a fault validation did not foresee, on one record only
        if raw["record_id"] == "odd":
            raise OverflowError("int too large to convert to float")
        return validate_record(raw, *args)

    monkeypatch.setattr(intake_module, "validate_record", validate)

    class Objective:
        feature_size = None
        min_tokens = 1

    class Gate:
        def hold_out(self, record, count) -> bool:
            return False

    bus = InProcessBus()
    odd = good_record(schema_version=SCHEMA_VERSION, record_id="odd")
    for record in (good_record(schema_version=SCHEMA_VERSION), odd, good_record(schema_version=SCHEMA_VERSION,
                                                                                  record_id="r2")):
        bus.publish(record)
    stats = LearnerStats()
    intake = Intake(VOCAB, Objective(), Gate(), 10, stats)  # type: ignore[arg-type]
    assert intake.take(bus) == 2 and sum(stats.refused.values()) == 1


@pytest.mark.parametrize("payload", [{"version": True}, {"version": -3}, {"version": "2"},
                                     {"version": 2, "url": "file:///etc"}, {"version": 2, "url": "not-a-url"},
                                     {"version": 2, "url": 7}])
def test_a_server_ignores_announcements_it_could_not_follow(tmp_path: Path, payload: dict) -> None:
    from specd.hotswap.remote import RemoteSource

    source = RemoteSource(tmp_path, "http://127.0.0.1:8100")
    with pytest.raises(ValueError):
        source.announce(payload)
    assert source.live_version() is None and source.learner_url == "http://127.0.0.1:8100"


def test_the_learner_announces_the_live_version_again_even_unchanged(tmp_path: Path, monkeypatch) -> None:
    from specd.learner import sidecar as sidecar_module
    from specd.learner.sidecar import Sidecar, SidecarOptions
    from specd.testing import tiny_loaded_target

    sidecar = Sidecar(SidecarOptions(store=str(tmp_path / "store")), tiny_loaded_target())
    live = sidecar.store.live_version()
    assert live is not None
    sent: list[int] = []

    async def announce(settings, payload) -> None:
        sent.append(payload["version"])

    monkeypatch.setattr(sidecar_module, "announce", announce)
    monkeypatch.setattr(sidecar_module, "REANNOUNCE_S", 0.2)
    sidecar._announced_at = -1.0

    async def run_for(seconds: float) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(sidecar.announcer(stop))
        await asyncio.sleep(seconds)
        stop.set()
        sidecar._changed.set()
        await task

    asyncio.run(run_for(1.3))
    assert len(sent) >= 2 and set(sent) == {live}  # a garbled retained message is overwritten in time
