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


def test_source_counts_are_kept_apart_from_the_versions_and_survive_a_counter_reset() -> None:
    log = AcceptanceLog()
    learned, context = {"drafts": 100, "accepted": 50}, {"drafts": 80, "accepted": 70, "passes": 20, "emitted": 90}
    log.add(report("a", 1, v1=(100, 50)) | {"sources": {"learned": learned, "context": context}})
    log.add(report("a", 2, v1=(100, 50)) | {"sources": {"context": {"drafts": 10, "accepted": 9}}})  # a restart
    assert log.acceptance(1) == (0.5, 100)  # the version is judged on the learned drafter's own drafts
    assert log.source_totals_as_dict() == {"learned": {"drafts": 100, "accepted": 50, "passes": 0, "emitted": 0},
                                           "context": {"drafts": 90, "accepted": 79, "passes": 20, "emitted": 90}}
    assert [p["source"] for p in log.source_series] == ["learned", "context", "context"]
    with pytest.raises(ValueError):
        log.add(report("a", 3) | {"sources": {"x" * 40: {}}})


def test_specd_versions_shows_served_acceptance_per_version_and_source(monkeypatch, capsys) -> None:
    from specd.cli import store_commands
    from specd.cli.main import main

    log = AcceptanceLog()
    log.add(report("a", 1, v2=(200, 150)) | {"sources": {"learned": {"drafts": 200, "accepted": 150},
                                                         "table": {"drafts": 40, "accepted": 10}}})
    manifest = {"version": 2, "status": "live", "created": 0.0, "evaluation": {"candidate": 1.9, "live": 1.8}}
    answers = {"/v1/versions": {"live": 2, "versions": [manifest]},
               "/v1/acceptance": {"totals": log.totals_as_dict(), "source_totals": log.source_totals_as_dict()}}
    monkeypatch.setattr(store_commands, "_http", lambda args, path, body=None: answers[path])
    assert main(["versions", "--url", "http://learner.invalid"]) == 0
    out = capsys.readouterr().out
    assert "150/200 = 0.75" in out and "table 10/40 = 0.25" in out and "learned 150/200 = 0.75" in out
