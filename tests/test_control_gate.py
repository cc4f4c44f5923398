"""An operator's POST /v1/live of a version the learner never trained goes through the learner's gate.

A learner on the learnable toy target holds greedy records out; versions are planted in its store
as an outside publisher (or a careless operator) would. Previously live versions stay trusted.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from specd.control.acceptance import AcceptanceLog
from specd.control.plane import ControlPlane, add_control_routes
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.model.fingerprint import TargetFingerprint
from specd.testing import TINY, learnable_target
from specd.transport.bus import InProcessBus

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
TOKEN = "secret"


def learner_on(tmp_path: Path, records: int) -> Learner:
    target = learnable_target()
    bus = InProcessBus()
    config = LearnerConfig(duty_cycle=1.0, holdout_every=1, gate_min_held_out=4, gate_margin=0.05)
    learner = Learner(config, bus, WeightStore(tmp_path), new_drafter_model(target, SHAPE).float(), FINGERPRINT)
    engine = Engine(target, None, EngineConfig(max_batch=4))
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(records)]
    for seq in engine.generate(prompts, SamplingParams(max_tokens=16)):
        bus.publish(record_from_sequence(seq, "t", 0.0).to_dict())
    learner.intake()
    return learner


def plant(learner: Learner, accept_length: float) -> int:
    """A version in the learner's store whose replayed accept length is `accept_length` (marked on its norm)."""
    model = new_drafter_model(learnable_target(), SHAPE).float()
    with torch.no_grad():
        model.norm.weight.fill_(accept_length)
    return learner.store.publish(model, FINGERPRINT, learner.store.live_version(), {"planted": True})


async def operator_sets_live(learner: Learner, *versions: int) -> list[tuple[int, dict[str, Any], str | None]]:
    """An operator's POST /v1/live of each version in turn, to a control plane with the learner's gate:
    (status, JSON answer, Retry-After) for each."""
    app = web.Application()
    add_control_routes(app, ControlPlane(learner.store, AcceptanceLog(), TOKEN, submit=learner.submit))
    answers = []
    async with TestClient(TestServer(app)) as client:
        for version in versions:
            response = await client.post("/v1/live", json={"version": version},
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            answers.append((response.status, await response.json(), response.headers.get("Retry-After")))
    return answers


def judged_by_norm(learner: Learner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay stands in as each model's norm value (live, day 0, has norm 1.0): the verdict is known."""
    monkeypatch.setattr(learner, "simulated_accept_length",
                        lambda model, records: float(model.norm.weight.detach().float().mean()))


@pytest.mark.asyncio
async def test_a_worse_candidate_is_refused_by_the_gate_and_never_goes_live(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=6)
    judged_by_norm(learner, monkeypatch)
    worse = plant(learner, 0.5)
    [(status, answer, _)] = await operator_sets_live(learner, worse)
    assert status == 409 and "gate refused" in answer["error"]["message"]
    assert answer["evaluation"]["candidate"] == 0.5 and answer["evaluation"]["live"] == 1.0
    assert learner.store.live_version() == 1 and learner.store.manifest(worse)["status"] == "rejected"


@pytest.mark.asyncio
async def test_a_better_candidate_passes_the_gate_and_goes_live(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=6)
    judged_by_norm(learner, monkeypatch)
    better = plant(learner, 1.5)
    # then back to 1: a version that was live before is trusted, it needs no gate
    (status, answer, _), (status_again, _, _) = await operator_sets_live(learner, better, 1)
    assert status == 200 and answer["live"] == better and answer["evaluation"]["passed"]
    assert status_again == 200
    assert learner.store.live_version() == 1


@pytest.mark.asyncio
async def test_without_held_out_evidence_the_gate_answers_503_and_nothing_goes_live(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=2)  # 2 held out, the gate needs 4
    judged_by_norm(learner, monkeypatch)
    better = plant(learner, 1.5)
    [(status, answer, retry_after)] = await operator_sets_live(learner, better)
    assert status == 503 and retry_after == "30"
    assert "needs 4" in answer["error"]["message"]
    assert learner.store.live_version() == 1 and learner.store.manifest(better)["status"] == "candidate"


@pytest.mark.asyncio
async def test_a_corrupt_version_cannot_go_live_by_hand(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=6)
    judged_by_norm(learner, monkeypatch)
    corrupt = plant(learner, 1.5)
    path = learner.store.weights_path(corrupt)
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(8)
    path.write_bytes(bytes(data))
    [(status, answer, _)] = await operator_sets_live(learner, corrupt)
    assert status == 409 and "does not match" in str(answer)
    assert learner.store.live_version() == 1


@pytest.mark.asyncio
async def test_an_operators_verdict_does_not_wait_for_the_training_step_in_progress(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=6)
    judged_by_norm(learner, monkeypatch)
    training, release = threading.Event(), threading.Event()

    def stuck_step() -> bool:  # a learner step that lasts until the verdict is in
        training.set()
        release.wait(timeout=60)
        return True

    monkeypatch.setattr(learner, "step", stuck_step)
    learner.start()
    try:
        assert training.wait(timeout=30)
        better = plant(learner, 1.5)
        [(status, answer, _)] = await operator_sets_live(learner, better)
        assert release.is_set() is False  # answered while the step still ran
        assert status == 200 and answer["live"] == better
    finally:
        release.set()
        learner.stop()


def test_the_live_side_is_replayed_once_per_live_model_and_held_out_set(tmp_path) -> None:
    learner = learner_on(tmp_path, records=6)
    replayed: list[float] = []

    def counted(model, records) -> float:
        replayed.append(float(model.norm.weight.detach().float().mean()))
        return replayed[-1]

    live = learner.promoter.live_model()
    candidates = [plant(learner, 0.5), plant(learner, 0.7)]
    for version in candidates:
        learner.gate.verdict(learner.promoter.load(version), live, counted)
    assert replayed == pytest.approx([0.5, 1.0, 0.7])  # the live side (1.0) once for both
    learner.gate.hold_out(learner.gate.held_out[0], learner.config.holdout_every)  # the held-out set changes
    learner.gate.verdict(learner.promoter.load(candidates[0]), live, counted)
    assert replayed[-2:] == pytest.approx([0.5, 1.0])


@pytest.mark.asyncio
async def test_training_steps_aside_until_an_operators_verdict_is_answered(tmp_path, monkeypatch) -> None:
    learner = learner_on(tmp_path, records=6)
    monkeypatch.setattr(learner, "config", dataclasses.replace(learner.config, min_records=0))
    judging, release = threading.Event(), threading.Event()
    trained: list[bool] = []

    def slow_vet(version: int, gate: Any, accept_length: Any) -> dict[str, Any]:
        judging.set()
        release.wait(timeout=60)
        return {"passed": False, "reason": "judged"}

    monkeypatch.setattr(learner.promoter, "vet", slow_vet)
    monkeypatch.setattr(learner, "train_step", lambda: trained.append(True) or 0.0)
    monkeypatch.setattr(learner, "maybe_publish", lambda force=False: None)
    verdict = learner.submit(1)
    assert judging.wait(timeout=30)
    stepper = threading.Thread(target=learner.step)
    stepper.start()
    stepper.join(timeout=0.5)
    assert stepper.is_alive() and not trained   # waiting for the verdict, not training beside it
    release.set()
    stepper.join(timeout=30)
    assert trained == [True] and verdict.result(timeout=5)["reason"] == "judged"


@pytest.mark.asyncio
async def test_a_gate_timeout_says_the_verdict_goes_on_and_never_calls_it_off(tmp_path) -> None:
    from concurrent.futures import Future

    store = WeightStore(tmp_path)
    model = new_drafter_model(learnable_target(), SHAPE).float()
    store.set_live(store.publish(model, FINGERPRINT, None, {}), "day 0")
    candidate = store.publish(model, FINGERPRINT, 1, {})
    pending: Future = Future()
    app = web.Application()
    add_control_routes(app, ControlPlane(store, AcceptanceLog(), TOKEN, submit=lambda version: pending,
                                         gate_timeout_s=0.2))
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/v1/live", json={"version": candidate},
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status == 504
        assert "still being judged" in (await response.json())["error"]["message"]
    assert not pending.cancelled()   # the learner still answers it (a process learner's reader must not die on it)
    pending.set_result({"passed": True})


def test_a_rollback_never_makes_a_version_live_that_has_not_served(tmp_path) -> None:
    from specd.core.errors import StoreError

    store = WeightStore(tmp_path)
    model = new_drafter_model(learnable_target(), SHAPE).float()
    first = store.publish(model, FINGERPRINT, None, {})
    store.set_live(first, "day 0")
    second = store.publish(model, FINGERPRINT, first, {})
    store.set_live(second, "gate")
    candidate, rejected = store.publish(model, FINGERPRINT, second, {}), store.publish(model, FINGERPRINT, second, {})
    store.update(rejected, status="rejected", reason="worse")
    for version in (candidate, rejected):
        with pytest.raises(StoreError, match="never been live"):
            store.rollback(version)
    assert store.live_version() == second and store.rollback(first) == first
