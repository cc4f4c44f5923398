"""Records that carry the target's features: exact round trips, and refusal of malformed features.

A record's features (float16, base64 in JSON) survive JSON and the real MQTT transport bit for
bit. Features of the wrong width, covering more positions than the record runs, with bad base64,
another dtype or non-finite values are refused by `validate_record`; through the learner's intake
they are counted by reason and never reach the training buffer or the held-out set.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from specd.core.errors import RecordRefused
from specd.core.records import FeatureBlock, StepRecord, TrajectoryRecord, validate_record
from specd.drafter.feature_model import new_feature_drafter
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.model.fingerprint import TargetFingerprint
from specd.testing import learnable_target
from specd.transport.bus import InProcessBus

VOCAB = 96
WIDTH = 32  # a feature drafter on learnable_target (one layer) reads layer 0: 1 x 32


def awkward_features(positions: int, width: int = WIDTH, seed: int = 0) -> np.ndarray:
    """fp16 values that a lossy path would change: subnormals, -0.0, the extremes, random bits."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, size=(positions, width), dtype=np.uint16)
    array = bits.view(np.float16).copy()
    array[~np.isfinite(array)] = 1.0
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, 1e-4, np.float16(1 / 3)], dtype=np.float16)
    array[0, :len(special)] = special
    return array


def record_with_features(positions: int | None = None, width: int = WIDTH, record_id: str = "r1") -> TrajectoryRecord:
    prompt, output = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8]
    total = len(prompt) + len(output)
    features = FeatureBlock.of(awkward_features(total - 1 if positions is None else positions, width))
    return TrajectoryRecord(record_id, "server-a", prompt, output, [StepRecord(5, [9, 2, 7], 2, 4)],
                            0.0, 1.0, 1700000000.25, 1700000001.5, "chat", features=features)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_features_round_trip_json_bit_exactly() -> None:
    record = record_with_features()
    assert record.features is not None
    raw = json.loads(json.dumps(record.to_dict()))
    assert raw["features"]["dtype"] == "float16" and raw["features"]["shape"] == [11, WIDTH]
    back = validate_record(raw, VOCAB, WIDTH)
    assert back == record
    assert back.features is not None and same_bits(back.features.array(), record.features.array())
    # fewer positions than the record's tokens - 1 (a server may send a prefix) are fine too
    prefix = record_with_features(positions=3)
    assert validate_record(json.loads(json.dumps(prefix.to_dict())), VOCAB, WIDTH) == prefix
    # and an id-only record stays id-only
    ids_only = TrajectoryRecord("r2", "s", [1, 2], [3], [], 0.0, 1.0, 0.0, 0.0)
    assert "features" not in ids_only.to_dict()
    assert validate_record(json.loads(json.dumps(ids_only.to_dict())), VOCAB, WIDTH).features is None


@pytest.mark.mqtt
def test_features_round_trip_the_mqtt_transport_bit_exactly(tmp_path: Path) -> None:
    from specd.testing.processes import Broker
    from specd.transport.mqtt import MqttPublisher, MqttSettings, subscribe_forever

    broker = Broker(tmp_path / "broker").start()
    received: list[tuple[str, bytes]] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    settings = MqttSettings.from_url(broker.url, deployment="feature-records")

    async def handle(topic: str, payload: bytes) -> None:
        received.append((topic, payload))

    task = loop.create_task(subscribe_forever(settings, "feature-test-learner", handle, stop))

    def subscriber() -> None:
        asyncio.set_event_loop(loop)
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)

    def arrived(kind: str) -> list[bytes]:
        return [payload for topic, payload in received if f"/{kind}/" in topic]

    thread = threading.Thread(target=subscriber, name="test-subscriber", daemon=True)
    thread.start()
    publisher = MqttPublisher(settings, "server-a").start()
    try:
        # the subscription is in place once a probe report comes through; then send the record
        deadline = time.monotonic() + 20
        while not arrived("reports") and time.monotonic() < deadline:
            publisher.report({"probe": True})
            time.sleep(0.2)
        assert arrived("reports"), "the subscriber never received a probe"
        record = record_with_features()
        publisher.publish(record.to_dict())
        deadline = time.monotonic() + 20
        while not arrived("records") and time.monotonic() < deadline:
            time.sleep(0.05)
        payloads = arrived("records")
        assert len(payloads) == 1, "the record did not arrive"
        back = validate_record(json.loads(payloads[0]), VOCAB, WIDTH)
        assert back == record
        assert back.features is not None and record.features is not None
        assert same_bits(back.features.array(), record.features.array())
        # the broker may forward the record before its acknowledgement reaches the publisher
        deadline = time.monotonic() + 10
        while publisher.counters.delivered < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert publisher.counters.delivered == 1
    finally:
        publisher.stop()
        loop.call_soon_threadsafe(task.cancel)
        thread.join(10)
        loop.close()
        broker.stop()


def corrupt(field: str, value: Any) -> dict[str, Any]:
    raw = record_with_features(record_id=f"bad-{field}").to_dict()
    raw["features"] = {**raw["features"], field: value}
    return raw


def non_finite(value: float) -> dict[str, Any]:
    array = awkward_features(11)
    array[4, 7] = value
    raw = record_with_features(record_id="non-finite").to_dict()
    raw["features"] = FeatureBlock.of(array).to_dict()
    return raw


def good_data(positions: int, width: int) -> str:
    return base64.b64encode(awkward_features(positions, width).tobytes()).decode()


BAD_FEATURES = {
    "wrong width": (record_with_features(width=WIDTH + 32).to_dict(), "wide"),
    "as many positions as tokens": (corrupt("shape", [12, WIDTH]), "positions"),
    "more positions than tokens": (record_with_features(positions=20).to_dict(), "positions"),
    "bad base64": (corrupt("data", "not base64 at all!"), "base64"),
    "truncated data": (corrupt("data", good_data(10, WIDTH)), "base64"),
    "data not a string": (corrupt("data", [1, 2, 3]), "base64"),
    "float32 dtype": (corrupt("dtype", "float32"), "dtype"),
    "no dtype": (corrupt("dtype", None), "dtype"),
    "shape of three": (corrupt("shape", [11, WIDTH, 1]), "shape"),
    "zero positions": (corrupt("shape", [0, WIDTH]), "shape"),
    "not an object": (record_with_features().to_dict() | {"features": "AAAA"}, "dtype"),
    "a NaN": (non_finite(float("nan")), "non-finite"),
    "an infinity": (non_finite(float("inf")), "non-finite"),
}


@pytest.mark.parametrize("case", list(BAD_FEATURES))
def test_validate_record_refuses_malformed_features(case: str) -> None:
    raw, needle = BAD_FEATURES[case]
    with pytest.raises(RecordRefused, match=needle):
        validate_record(json.loads(json.dumps(raw)), VOCAB, WIDTH)


def test_validate_record_checks_the_width_only_when_told_it() -> None:
    raw = record_with_features(width=WIDTH + 32).to_dict()
    assert validate_record(raw, VOCAB).features is not None  # any width when the reader has no drafter width
    with pytest.raises(RecordRefused, match="wide"):
        validate_record(raw, VOCAB, WIDTH)


def with_step_version(version: Any) -> dict[str, Any]:
    raw = json.loads(json.dumps(record_with_features().to_dict()))
    raw["steps"][0]["version"] = version
    return raw


@pytest.mark.parametrize("sent, read", [(4, 4), ("4", 4), (None, None), ("none", None)])
def test_step_versions_read_as_numbers_from_old_and_new_servers(sent: Any, read: int | None) -> None:
    # servers before versions were typed wrote them as strings, and "none" for plain decoding
    assert validate_record(with_step_version(sent), VOCAB).steps[0].version == read


@pytest.mark.parametrize("version", ["v4", "-1", -1, True, 2.5, [4]])
def test_step_versions_that_are_not_version_numbers_are_refused(version: Any) -> None:
    with pytest.raises(RecordRefused, match="version number") as refused:
        validate_record(with_step_version(version), VOCAB)
    assert refused.value.reason == "steps"


def test_learner_intake_counts_refused_features_and_keeps_them_out_of_training(tmp_path: Path) -> None:
    target = learnable_target(VOCAB).float()
    drafter = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                  torch.arange(VOCAB))
    assert drafter.config.feature_size == WIDTH
    bus = InProcessBus()
    config = LearnerConfig(holdout_every=2, duty_cycle=1.0, publish_every_steps=10**9, publish_every_seconds=1e9)
    learner = Learner(config, bus, WeightStore(tmp_path), drafter, TargetFingerprint.of(target.config),
                      torch.float32, target.embed.weight, target=target)
    good = [record_with_features(record_id="good-1"), record_with_features(record_id="good-2")]
    bus.publish(good[0].to_dict())
    for raw, _ in BAD_FEATURES.values():
        bus.publish(json.loads(json.dumps(raw)))
    bus.publish(good[1].to_dict())
    assert learner.intake() == 2
    assert learner.stats.records_in == 2
    assert learner.stats.refused == {"features": len(BAD_FEATURES)}
    kept = list(learner.buffer) + list(learner.holdout)
    assert len(learner.buffer) == 1 and len(learner.holdout) == 1  # the second good record is held out
    assert sorted(r.record_id for r in kept) == ["good-1", "good-2"]
    expected = awkward_features(11)
    assert all(r.features is not None and same_bits(r.features.array(), expected) for r in kept)
