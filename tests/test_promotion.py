"""Promotion and intake, the learner's jobs that decide what goes live and what is trained on."""

from __future__ import annotations

from pathlib import Path

from specd.core.errors import RefusalReason
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.promotion import RACE_LOST, HeldVersion, promote
from specd.model.fingerprint import TargetFingerprint
from specd.testing import TINY, tiny_target
from specd.transport.bus import InProcessBus

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
PASSED = {"passed": True, "reason": "ok"}


def three_versions(tmp_path: Path) -> WeightStore:
    store = WeightStore(tmp_path)
    for seed in range(3):
        store.publish(new_drafter_model(tiny_target(), SHAPE, seed=seed), FINGERPRINT, store.live_version(), {})
    store.set_live(1)
    return store


def test_a_passed_verdict_goes_live_by_compare_and_set(tmp_path: Path) -> None:
    store = three_versions(tmp_path)
    assert promote(store, 2, PASSED, seen=1, why="gate passed") == PASSED
    assert store.live_version() == 2


def test_a_lost_race_rejects_the_learners_candidate_but_leaves_an_operators_for_a_retry(tmp_path: Path) -> None:
    store = three_versions(tmp_path)
    store.set_live(3)  # someone else moved the live version after the candidates were judged on 1
    learners = promote(store, 2, PASSED, seen=1, why="gate passed")
    assert learners == {"passed": False, "reason": RACE_LOST} and store.manifest(2)["status"] == "rejected"
    store.update(2, status="candidate")
    operators = promote(store, 2, PASSED, seen=1, why="operator", reject_lost_race=False)
    assert operators["passed"] is False and store.manifest(2)["status"] == "candidate" and store.live_version() == 3


def test_a_failed_verdict_is_marked_rejected_with_its_reason(tmp_path: Path) -> None:
    store = three_versions(tmp_path)
    verdict = promote(store, 2, {"passed": False, "reason": "worse"}, seen=1, why="gate passed")
    assert verdict["passed"] is False and store.manifest(2)["reason"] == "worse" and store.live_version() == 1


def test_intake_counts_refusals_by_reason(tmp_path: Path) -> None:
    bus = InProcessBus()
    learner = Learner(LearnerConfig(), bus, WeightStore(tmp_path), new_drafter_model(tiny_target(), SHAPE).float(),
                      FINGERPRINT)
    bus.publish(["not", "an", "object"])  # type: ignore[arg-type]
    bus.publish({"schema_version": -1})
    assert learner.intake() == 0
    assert learner.stats.refused == {RefusalReason.NOT_AN_OBJECT: 1, RefusalReason.SCHEMA: 1}


def test_a_held_version_is_read_once_while_asked_for_and_replaced_when_another_is() -> None:
    reads: list[int] = []

    def load(version: int) -> object:
        reads.append(version)
        return object()

    held = HeldVersion(load)  # type: ignore[arg-type]
    first = held.get(1)
    assert held.get(1) is first and reads == [1]
    assert held.get(2) is not first and reads == [1, 2] and held.model is held.get(2)
    held.drop()
    assert held.model is None
