"""Races on the live version and the store, each forced into its bad order with events and hooks.

Every test here interleaves threads on purpose: a hook pauses one thread at the point where the
race would bite and lets the other act there. A bounded wait in a hook is for the other thread to
step in; where the code is right that never happens (a lock keeps it out) and the wait runs out.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, learnable_target, tiny_target

from specd.core.errors import VersionNotFound
from specd.core.records import LEARNED_SOURCE, StepRecord, TrajectoryRecord
from specd.drafter.checkpoint import load_drafter
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap import store as store_module
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.shadow import ShadowCanary
from specd.model.fingerprint import TargetFingerprint
from specd.transport.bus import InProcessBus

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)
STEP_IN_S = 0.05  # how long a paused thread leaves the other to step in (only a wrong lock lets it)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p.float(), q.float()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def publish_live(store: WeightStore, seed: int) -> int:
    version = store.publish(new_drafter_model(tiny_target(), SHAPE, seed=seed), FINGERPRINT, store.live_version(), {})
    store.set_live(version)
    return version


def learner_with_v2_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Learner:
    """A learner whose own candidate 2 went live through the gate, with held-out records for more."""
    target = learnable_target()
    bus = InProcessBus()
    config = LearnerConfig(duty_cycle=1.0, holdout_every=1, hold_after_rollback_s=3600)
    learner = Learner(config, bus, WeightStore(tmp_path), new_drafter_model(target, SHAPE).float(), FINGERPRINT)
    engine = Engine(target, None, EngineConfig(max_batch=4))
    for seq in engine.generate([[1, 2, 3], [4, 5], [6, 7, 8], [9, 10]], SamplingParams(max_tokens=12)):
        bus.publish(record_from_sequence(seq, "t", 0.0).to_dict())
    learner.intake()
    monkeypatch.setattr(learner, "simulated_accept_length", lambda model, records: 2.0)  # every candidate passes
    with torch.no_grad():
        learner.model.norm.weight.add_(1.0)
    learner.stats.steps += 1
    assert learner.maybe_publish(force=True) == 2 and learner.store.live_version() == 2
    return learner


def test_a_rollback_made_while_the_learner_evaluates_stands_and_the_learner_follows_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = learner_with_v2_live(tmp_path, monkeypatch)
    store = learner.store
    with torch.no_grad():  # the next candidate (3) differs from 1 and 2
        learner.model.norm.weight.add_(1.0)
    learner.stats.steps += 1
    evaluating, rolled_back = threading.Event(), threading.Event()
    real_evaluate = learner.evaluate

    def evaluate_after_the_rollback(candidate) -> dict[str, Any]:
        evaluating.set()
        assert rolled_back.wait(30)
        return real_evaluate(candidate)

    monkeypatch.setattr(learner, "evaluate", evaluate_after_the_rollback)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(published=learner.maybe_publish(force=True)))
    thread.start()
    try:
        assert evaluating.wait(30)
        store.rollback(1)  # the operator, while candidate 3 is evaluated against 2 (and passes)
    finally:
        rolled_back.set()
        thread.join(30)
    assert outcome == {"published": None}
    assert store.live_version() == learner.live_version == 1
    assert store.manifest(3)["status"] == "rejected"
    assert store.manifest(3)["reason"] == "the live version changed during the evaluation"
    assert same_weights(learner.model, load_drafter(store.weights_path(1), FINGERPRINT))  # trains on from 1


def test_the_day0_version_does_not_replace_a_version_made_live_while_it_was_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = WeightStore(tmp_path)
    theirs = new_drafter_model(tiny_target(), SHAPE, seed=7).float()
    real_publish = store.publish

    def someone_goes_live_meanwhile(*args, **kwargs) -> int:
        ours = real_publish(*args, **kwargs)
        store.set_live(real_publish(theirs, FINGERPRINT, None, {}), "another learner")
        return ours

    monkeypatch.setattr(store, "publish", someone_goes_live_meanwhile)
    learner = Learner(LearnerConfig(), InProcessBus(), store, new_drafter_model(tiny_target(), SHAPE).float(),
                      FINGERPRINT)
    assert store.live_version() == learner.live_version == 2
    assert store.manifest(1)["status"] == "candidate"  # the learner's day-0 version never went live
    assert same_weights(learner.model, theirs)


def test_the_canary_rolls_back_only_the_version_it_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = WeightStore(tmp_path)
    v1, v2, v3 = (publish_live(store, seed) for seed in range(3))
    store.rollback(v2)  # history [1], v2 live: the canary compares v2 with v1
    replayed = {v1: 3.0, v2: 1.0}  # what each version's replay gives: v2 regressed
    canary = ShadowCanary(store, lambda version: version, lambda version, records: replayed[version],
                          margin=0.05, min_records=4, z=2.33, every=1)
    for i in range(4):
        canary.observe(TrajectoryRecord(str(i), "s", [1, 2], [3, 4], [StepRecord(2, [3], 1, v2, LEARNED_SOURCE)],
                                        0.0, 1.0, 0.0, 0.0))
    real_verdict = canary.verdict

    def operator_acts_after_the_verdict(*args, **kwargs):
        evidence = real_verdict(*args, **kwargs)
        assert evidence is not None  # v2 regressed
        store.set_live(v3, "operator")
        return evidence

    monkeypatch.setattr(canary, "verdict", operator_acts_after_the_verdict)
    assert canary.check() is None
    assert store.live_version() == v3 and store.manifest(v3)["status"] == "live"


def test_concurrent_updates_of_one_manifest_lose_no_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    WeightStore(tmp_path).publish(new_drafter_model(tiny_target(), SHAPE), FINGERPRINT, None, {})
    stores = {"a": WeightStore(tmp_path), "b": WeightStore(tmp_path)}  # two handles: as two processes would
    reads = {"a": 0, "b": 0}
    changed = threading.Condition()
    real_manifest, real_write = WeightStore.manifest, store_module._write_json_atomic

    def counted_manifest(self, version: int) -> dict[str, Any]:
        manifest = real_manifest(self, version)
        with changed:
            reads[threading.current_thread().name] += 1
            changed.notify_all()
        return manifest

    def write_after_the_other_reads(path: Path, data: Any) -> None:
        me = threading.current_thread().name
        other = "b" if me == "a" else "a"
        if me in reads:  # between this thread's read and its write: let the other read the old manifest
            with changed:
                seen = reads[other]
                changed.wait_for(lambda: reads[other] > seen, timeout=STEP_IN_S)
        real_write(path, data)

    monkeypatch.setattr(WeightStore, "manifest", counted_manifest)
    monkeypatch.setattr(store_module, "_write_json_atomic", write_after_the_other_reads)
    rounds = 10

    def update_many(name: str) -> None:
        for i in range(rounds):
            stores[name].update(1, **{f"{name}{i}": i})

    threads = [threading.Thread(target=update_many, args=(name,), name=name) for name in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    manifest = real_manifest(stores["a"], 1)
    assert {f"{name}{i}" for name in stores for i in range(rounds)} <= manifest.keys()


def test_two_publishers_at_once_never_choose_the_same_version_number(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stores = {"a": WeightStore(tmp_path), "b": WeightStore(tmp_path)}  # as a learner and a script by hand would
    writing = threading.Event()
    real_save = store_module.save_drafter

    def save_while_the_other_chooses(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name == "a":  # its number chosen: let the other choose one now
            writing.set()
            time.sleep(STEP_IN_S)
        real_save(*args, **kwargs)

    monkeypatch.setattr(store_module, "save_drafter", save_while_the_other_chooses)
    versions: dict[str, int] = {}

    def publish(name: str) -> None:
        if name == "b":
            assert writing.wait(10)
        versions[name] = stores[name].publish(new_drafter_model(tiny_target(), SHAPE), FINGERPRINT, None, {})

    threads = [threading.Thread(target=publish, args=(name,), name=name) for name in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(versions.values()) == [1, 2]
    assert {stores["a"].manifest(v)["version"] for v in (1, 2)} == {1, 2}


def test_gc_during_a_rollback_keeps_the_version_the_rollback_chose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = WeightStore(tmp_path, keep_last=1, keep_live_within_s=0)  # only the lock protects version 2 here
    versions = [publish_live(store, seed) for seed in range(5)]
    chosen, collected = threading.Event(), threading.Event()
    real_update = store.update

    def pause_once_chosen(version: int, **fields: Any) -> dict[str, Any]:
        if fields.get("status") == "rolled-back":  # the rollback has chosen its version, not yet made it live
            chosen.set()
            collected.wait(STEP_IN_S)  # gc gets its chance to run now (it cannot: the live lock is held)
        return real_update(version, **fields)

    monkeypatch.setattr(store, "update", pause_once_chosen)

    def collect() -> None:
        assert chosen.wait(30)
        removed.extend(store.gc())
        collected.set()

    removed: list[int] = []
    collector = threading.Thread(target=collect)
    collector.start()
    try:
        restored = store.rollback(versions[1])
    finally:
        chosen.set()
        collector.join(30)
    assert restored == versions[1] == store.live_version()
    assert versions[1] not in removed and versions[1] in store.versions()
    load_drafter(store.weights_path(versions[1]), FINGERPRINT)  # whole: it loads


def test_gc_never_removes_live_pinned_or_recently_live_versions(tmp_path: Path) -> None:
    store = WeightStore(tmp_path, keep_last=1, keep_live_within_s=3600)
    versions = [publish_live(store, seed) for seed in range(6)]  # history [1..5], 6 live
    store.rollback(versions[1])  # 2 live again, 6 rolled back a moment ago; history [1]
    store.pin(versions[2])
    for seed in range(6, 8):  # two candidates that never went live: 8 is the newest
        store.publish(new_drafter_model(tiny_target(), SHAPE, seed=seed), FINGERPRINT, versions[1], {})
    long_ago = time.time() - 7200
    for version in (versions[0], versions[3]):  # live two hours ago, not since
        store.update(version, live_since=long_ago - 60, live_until=long_ago)
    removed = store.gc()
    # 1: the last live version before 2 (history); 2: live; 3: pinned; 4: long ago, collected;
    # 5 (live_until set by 6's promotion) and 6 (rolled back): live within the hour; 7: never live; 8: newest
    assert removed == [versions[3], 7]
    assert store.versions() == [1, 2, 3, 5, 6, 8]
    for version in store.versions():
        load_drafter(store.weights_path(version), FINGERPRINT)


def test_gc_keeps_versions_that_served_after_a_rollback_cut_them_from_the_history(tmp_path: Path) -> None:
    store = WeightStore(tmp_path, keep_live_within_s=60)  # keep_last 5
    served = [publish_live(store, seed) for seed in range(4)]  # 1, 2, 3, 4 live in turn
    rejected = [store.publish(new_drafter_model(tiny_target(), SHAPE, seed=seed), FINGERPRINT, served[-1], {})
                for seed in range(4, 10)]  # 5..10: the gate's refusals, the newest versions
    for version in rejected:
        store.update(version, status="rejected")
    store.rollback(served[1])  # 2 live again: the history is [1]; 3 (retired) and 4 (rolled back) left it
    hour_ago = time.time() - 3600
    for version in served:
        manifest = store.manifest(version)
        store.update(version, **{key: hour_ago for key in ("live_since", "live_until") if key in manifest})
    assert store.gc() == [rejected[0]]  # not 3 or 4: they served more recently than any but 2 and 1
    assert store.rollback(served[2]) == served[2]


def test_rollback_never_chooses_a_version_whose_files_are_gone(tmp_path: Path) -> None:
    store = WeightStore(tmp_path)
    versions = [publish_live(store, seed) for seed in range(4)]  # history [1, 2, 3], 4 live
    store.weights_path(versions[2]).unlink()  # 3 lost its weights (by hand, or a crash mid-delete)
    with pytest.raises(VersionNotFound):
        store.rollback(versions[2])
    assert store.live_version() == versions[3]
    assert store.rollback() == versions[1]  # the previous live version with its files
    assert store.live_version() == versions[1]
