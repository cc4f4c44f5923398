"""Served acceptance from reports, and the canary that compares versions on the same records.

The canary tests run a tiny target drafting for itself (a copy of its weights as the drafter): it
accepts every draft on greedy traffic and far fewer on hot sampled traffic, so "chat" (greedy) and
"code" (temperature 1.5) are an easy and a hard domain, and a shift between them is a pure traffic
shift.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import fixed_k, tiny_target

from specd.control.acceptance import AcceptanceLog
from specd.core.records import TrajectoryRecord
from specd.drafter.checkpoint import load_drafter
from specd.drafter.token_drafter import TokenDrafter
from specd.engine.engine import Engine
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import WeightStore
from specd.learner.objectives import TokenObjective
from specd.learner.shadow import ShadowCanary
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer

FINGERPRINT = TargetFingerprint(96, "none")
K = 3


def report(server: str, at: float, **versions: tuple[int, int]) -> dict:
    counts = {v.lstrip("v"): {"drafts": d, "accepted": a, "passes": d // 4, "emitted": d // 4 + a}
              for v, (d, a) in versions.items()}
    return {"server_id": server, "time": at, "versions": counts}


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


# ---- the canary: paired replay on the same records ----------------------------------------------
def served_records(target: Transformer, model: Transformer, version: int, domain: str, temperature: float,
                   count: int, seed: int) -> list[TrajectoryRecord]:
    """Records of `count` requests served by `model` as `version`, in one domain."""
    engine = Engine(target, TokenDrafter(model, version, sampled_drafts="argmax"), fixed_k(num_draft_tokens=K))
    prompts = torch.randint(0, 96, (count, 4), generator=torch.Generator().manual_seed(seed)).tolist()
    seqs = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=24, seed=seed * 100 + i))
            for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    return [record_from_sequence(s, "s", 0.0, domain) for s in seqs]


def store_with(tmp_path: Path, *models: Transformer) -> WeightStore:
    """Each model published and made live in turn: the last is live, the one before its predecessor."""
    store = WeightStore(tmp_path)
    for model in models:
        store.set_live(store.publish(model, FINGERPRINT, store.live_version(), {}))
    return store


def canary_on(store: WeightStore, min_records: int = 8) -> ShadowCanary:
    objective = TokenObjective(window=64, miss_weight=1.0, prompt_weight=0.1, negative_coef=0.0)
    return ShadowCanary(store, lambda v: load_drafter(store.weights_path(v), FINGERPRINT).float(),
                        lambda model, records: objective.simulate(model, records, K).accept_length or 0.0,
                        margin=0.05, min_records=min_records, z=2.33, every=1)


def drafter_model(target: Transformer) -> Transformer:
    return copy.deepcopy(target).float()


def drowned(model: Transformer) -> Transformer:
    worse = copy.deepcopy(model)
    with torch.no_grad():
        for param in worse.parameters():
            param.add_(torch.randn_like(param) * (3 * float(param.std()) + 1e-3))
    return worse


def served_acceptance(records: list[TrajectoryRecord]) -> float:
    drafts = sum(len(s.drafts) for r in records for s in r.steps)
    return sum(s.num_accepted for r in records for s in r.steps) / drafts


def test_a_pure_traffic_shift_never_rolls_an_unchanged_drafter_back(tmp_path: Path) -> None:
    """False rollbacks under a shift from easy to hard traffic, version 2 a copy of version 1:
    the paired canary makes none in 5 trials; the served-acceptance rule it replaced (roll back when
    the live version's acceptance is over 0.10 below its predecessor's) made one in every trial."""
    target = tiny_target()
    canary_rollbacks = served_rule_rollbacks = 0
    for trial in range(5):
        model = drafter_model(target)
        store = store_with(tmp_path / str(trial), model, model)   # version 2: the same weights
        before = served_records(target, model, 1, "chat", 0.0, 16, seed=trial)
        after = served_records(target, model, 2, "code", 1.5, 16, seed=50 + trial)
        served_rule_rollbacks += served_acceptance(after) < served_acceptance(before) - 0.10
        canary = canary_on(store)
        for record in before + after:
            canary.observe(record)
        canary_rollbacks += canary.check() is not None
        assert store.live_version() == 2
        assert list(canary.differences["code"]) == [0.0] * 16  # only what version 2 served, each pair exactly level
    assert canary_rollbacks == 0
    assert served_rule_rollbacks == 5


def test_a_worse_version_is_rolled_back_with_paired_evidence(tmp_path: Path) -> None:
    target = tiny_target()
    good = drafter_model(target)
    store = store_with(tmp_path, good, drowned(good))
    canary = canary_on(store)
    worse = load_drafter(store.weights_path(2), FINGERPRINT).float()
    for record in served_records(target, worse, 2, "chat", 0.0, 6, seed=1):
        canary.observe(record)
    assert canary.check() is None  # 6 pairs: under the 8 it needs
    for record in served_records(target, worse, 2, "chat", 0.0, 6, seed=2):
        canary.observe(record)
    evidence = canary.check()
    assert evidence is not None and evidence["restored"] == 1 and evidence["records"] == 12
    assert evidence["mean_difference"] < -0.05 and evidence["upper_bound"] < 0
    assert store.live_version() == 1
    manifest = store.manifest(2)
    assert manifest["status"] == "rolled-back" and manifest["rollback_evidence"]["method"] == "paired replay"


def test_a_pinned_live_version_is_the_floor_even_when_worse(tmp_path: Path) -> None:
    target = tiny_target()
    good = drafter_model(target)
    store = store_with(tmp_path, good, drowned(good))
    store.pin(2)
    canary = canary_on(store)
    for record in served_records(target, load_drafter(store.weights_path(2), FINGERPRINT).float(), 2, "chat",
                                 0.0, 12, seed=1):
        canary.observe(record)
    assert canary.check() is None and store.live_version() == 2


def test_a_version_pinned_while_the_canary_scores_it_is_not_rolled_back(tmp_path: Path) -> None:
    target = tiny_target()
    good = drafter_model(target)
    store = store_with(tmp_path, good, drowned(good))
    canary = canary_on(store)
    for record in served_records(target, load_drafter(store.weights_path(2), FINGERPRINT).float(), 2, "chat",
                                 0.0, 12, seed=1):
        canary.observe(record)
    scoring = canary.accept_length

    def pinned_meanwhile(model, records):  # the operator pins version 2 while the canary replays
        store.pin(2)
        return scoring(model, records)

    canary.accept_length = pinned_meanwhile  # type: ignore[method-assign]
    assert canary.check() is None and store.live_version() == 2


def test_the_learner_runs_the_canary_on_the_records_it_takes(tmp_path: Path) -> None:
    from specd.learner.config import LearnerConfig
    from specd.learner.learner import Learner
    from specd.transport.bus import InProcessBus

    target = tiny_target()
    good = drafter_model(target)
    bus, store = InProcessBus(), WeightStore(tmp_path)
    config = LearnerConfig(duty_cycle=1.0, k=K, canary_every=1, canary_min_records=4, publish_every_steps=10**6,
                           publish_every_seconds=10**6)
    learner = Learner(config, bus, store, good, FINGERPRINT)   # day 0: version 1, live
    store.set_live(store.publish(drowned(good), FINGERPRINT, 1, {}))
    for record in served_records(target, load_drafter(store.weights_path(2), FINGERPRINT).float(), 2, "chat",
                                 0.0, 6, seed=3):
        bus.publish(record.to_dict())
    learner.tick()
    assert store.live_version() == 1 and learner.health()["canary_rollbacks"] == 1


def test_records_too_short_to_replay_are_not_scored_by_the_canary(tmp_path: Path) -> None:
    """A one-token answer replays to nothing under either version: pairing 0 with 0 only pulled the
    mean difference toward zero."""
    canary = canary_on(WeightStore(tmp_path))
    canary.observe(TrajectoryRecord("short", "server", [1, 2, 3], [4], [], 0.0, 1.0, 0.0, 0.0, "terse"))
    canary.observe(TrajectoryRecord("long", "server", [1, 2, 3], [4, 5, 6], [], 0.0, 1.0, 0.0, 0.0, "terse"))
    assert [record.record_id for record in canary.waiting] == ["long"]
