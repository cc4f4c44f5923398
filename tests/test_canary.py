"""The canary: live acceptance from reports, and automatic rollback of a regression."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_target

from specd.control.canary import AcceptanceLog, CanaryConfig, apply_canary
from specd.drafter.token_drafter import DrafterShape, new_drafter_model
from specd.hotswap.store import WeightStore
from specd.model.fingerprint import TargetFingerprint

SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def report(server: str, at: float, **versions: tuple[int, int]) -> dict:
    counts = {v.lstrip("v"): {"drafts": d, "accepted": a, "passes": d // 4, "emitted": d // 4 + a}
              for v, (d, a) in versions.items()}
    return {"server_id": server, "time": at, "versions": counts}


@pytest.fixture
def store(tmp_path: Path) -> WeightStore:
    store = WeightStore(tmp_path)
    target = tiny_target()
    for seed in range(2):
        version = store.publish(new_drafter_model(target, SHAPE, seed=seed), TargetFingerprint(96, "none"),
                                store.live_version(), {})
        store.set_live(version)
    return store


def test_reports_become_deltas_per_server_and_survive_a_counter_reset() -> None:
    log = AcceptanceLog()
    log.add(report("a", 1, v1=(100, 50)))
    log.add(report("a", 2, v1=(300, 120)))
    log.add(report("b", 2, v1=(40, 10)))
    log.add(report("a", 3, v1=(20, 5)))  # server a restarted: its counters began again
    assert log.totals[1].drafts == 100 + 200 + 40 + 20
    assert log.acceptance(1) == ((50 + 70 + 10 + 5) / 360, 360)
    with pytest.raises(ValueError):
        log.add({"server_id": "a", "versions": {"1": {"drafts": "many"}}})


def test_canary_rolls_back_a_regression_with_evidence(store: WeightStore) -> None:
    log = AcceptanceLog()
    log.add(report("a", 1, v1=(1000, 600)))
    log.add(report("a", 2, v1=(1000, 600), v2=(200, 20)))
    assert apply_canary(store, log, CanaryConfig(margin=0.1, min_drafts=400)) is None  # too few drafts yet
    log.add(report("a", 3, v1=(1000, 600), v2=(800, 100)))
    evidence = apply_canary(store, log, CanaryConfig(margin=0.1, min_drafts=400))
    assert evidence is not None and evidence["restored"] == 1
    assert store.live_version() == 1
    manifest = store.manifest(2)
    assert manifest["status"] == "rolled-back" and manifest["rollback_evidence"]["by"] == "canary"
    assert manifest["rollback_evidence"]["acceptance"] == pytest.approx(100 / 800)


def test_canary_leaves_a_good_version_and_a_pinned_floor_alone(store: WeightStore) -> None:
    log = AcceptanceLog()
    log.add(report("a", 1, v1=(1000, 600), v2=(1000, 580)))
    assert apply_canary(store, log, CanaryConfig(margin=0.1, min_drafts=400)) is None  # within the margin
    log.add(report("a", 2, v1=(1000, 600), v2=(2000, 600)))
    store.pin(2)
    assert apply_canary(store, log, CanaryConfig(margin=0.1, min_drafts=400)) is None  # pinned: the floor
    assert store.live_version() == 2
