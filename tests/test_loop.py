"""The closed loop on tiny models: records, learner, gate, store, hot-swap, rollback, and a learner
thread that survives its own failures. Races on the live version are in test_races.py."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY, fixed_k, learnable_target, tiny_target

from specd.cli.main import main
from specd.core.errors import ConfigurationError, RecordRefused, StoreError
from specd.core.records import validate_record
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence
from specd.hotswap.store import LiveVersionChanged, WeightStore
from specd.hotswap.swapper import LocalStore, Swapper
from specd.learner import learner as learner_module
from specd.learner.config import LearnerConfig
from specd.learner.learner import Learner
from specd.learner.signal import simulated_accept_length
from specd.model.fingerprint import TargetFingerprint
from specd.transport.bus import InProcessBus

FINGERPRINT = TargetFingerprint(TINY.vocab_size, "none")
SHAPE = DrafterShape(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=64)


def make_records(target, prompts, server="t", max_tokens=24, temperature=0.0):
    engine = Engine(target, None, EngineConfig(max_batch=8))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0))
    return [record_from_sequence(s, server, 0.0).to_dict() for s in seqs]


def random_prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(TINY.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(count)]


def test_acceptance_rises_after_training_on_traffic(tmp_path: Path) -> None:
    target = learnable_target()
    initial = new_drafter_model(target, SHAPE, copy_from_target=False, seed=0).float()
    bus = InProcessBus()
    store = WeightStore(tmp_path)
    config = LearnerConfig(learning_rate=3e-3, batch_size=16, window=32, duty_cycle=1.0, publish_every_steps=10**9,
                           publish_every_seconds=10**9, holdout_every=10**9, prompt_weight=0.0)
    learner = Learner(config, bus, store, initial, FINGERPRINT)
    for record in make_records(target, random_prompts(64, 0)):
        bus.publish(record)
    for _ in range(150):
        learner.step()
    held_out = [validate_record(r, TINY.vocab_size) for r in make_records(target, random_prompts(16, 99))]
    before = simulated_accept_length(initial, held_out, k=4)
    after = simulated_accept_length(learner.model, held_out, k=4)
    assert after > before + 1.0, (before, after)


def test_greedy_output_identical_across_forced_swaps(tmp_path: Path) -> None:
    target = tiny_target()
    prompts = random_prompts(6, 1)
    plain = Engine(target, None, EngineConfig(max_batch=3))
    expected = [s.output_ids for s in plain.generate(prompts, SamplingParams(max_tokens=40))]
    models = [new_drafter_model(target, SHAPE, copy_from_target=True, seed=s) for s in range(4)] + [target]
    drafter = TokenDrafter(models[0], "0")
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    step = offers = 0
    while engine.has_work:
        if step % 3 == 2:  # a new version every three steps, mid-request
            drafter.offer(models[(step // 3) % len(models)], step)
            offers += 1
        engine.step()
        step += 1
    assert offers >= 5 and drafter.num_swaps == offers  # each offer is taken by the next step's proposal
    assert [s.output_ids for s in seqs] == expected


def test_greedy_output_identical_while_another_thread_keeps_swapping_weights() -> None:
    target = tiny_target()
    prompts = random_prompts(6, 4)
    expected = [s.output_ids for s in Engine(target, None, EngineConfig(max_batch=3)).generate(
        prompts, SamplingParams(max_tokens=40))]
    # two shapes (a new cache on every change of shape) and the target itself (drafts that are all right)
    models = [new_drafter_model(target, SHAPE, seed=1), target,
              new_drafter_model(target, replace(SHAPE, head_vocab_size=48), seed=2)]
    drafter = TokenDrafter(models[0], "0", catchup_tokens_per_step=32)
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    offered, done = threading.Event(), threading.Event()
    offers = 0

    def keep_swapping() -> None:  # races the decoding loop: offers land before, during and after steps
        nonlocal offers
        while not done.is_set():
            offers += 1
            drafter.offer(models[offers % len(models)], offers)
            offered.set()
            done.wait(0.0005)  # pacing only (lets the engine thread hold the interpreter); nothing waits on it

    racer = threading.Thread(target=keep_swapping, name="swap-racer")
    racer.start()
    try:
        assert offered.wait(30), "the swapping thread never offered"
        while engine.has_work:
            engine.step()
    finally:
        done.set()
        racer.join(30)
    assert [s.output_ids for s in seqs] == expected
    assert 1 <= drafter.num_swaps <= offers  # at least the offer made before decoding began was taken


def publish_live(store: WeightStore, model) -> int:
    version = store.publish(model, FINGERPRINT, store.live_version(), {})
    store.set_live(version)
    return version


CORRUPTIONS = {
    "corrupted": lambda path: path.write_bytes(path.read_bytes()[:100] + b"\xff" * 64 + path.read_bytes()[164:]),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2]),
}


@pytest.mark.parametrize("problem", ["corrupted", "truncated", "sha-mismatch", "wrong-shape", "wrong-vocab", "nan"])
def test_bad_weights_are_refused_and_serving_keeps_old_version(tmp_path: Path, problem: str) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    good = new_drafter_model(target, SHAPE, seed=0)
    v1 = publish_live(store, good)
    drafter = TokenDrafter(good, v1)
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    bad = new_drafter_model(target, SHAPE, seed=1)
    fingerprint = FINGERPRINT
    if problem == "wrong-vocab":
        fingerprint = TargetFingerprint(TINY.vocab_size + 1, "none")
    if problem == "nan":
        with torch.no_grad():
            bad.blocks[0].mlp.down.weight[0, 0] = float("nan")
    version = store.publish(bad, fingerprint, v1, {})
    path = store.weights_path(version)
    if problem in CORRUPTIONS:
        CORRUPTIONS[problem](path)
        store.update(version, sha256=__import__("specd.hotswap.store", fromlist=["x"]).sha256_file(path))
    if problem == "wrong-shape":
        from safetensors.torch import load_file, save_file

        from specd.drafter.checkpoint import read_metadata

        tensors, metadata = load_file(str(path)), read_metadata(path)
        tensors["norm.weight"] = torch.ones(7, dtype=tensors["norm.weight"].dtype)
        save_file(tensors, str(path), metadata=metadata)
        store.update(version, sha256=__import__("specd.hotswap.store", fromlist=["x"]).sha256_file(path))
    store.set_live(version)
    if problem == "sha-mismatch":  # changed after it went live (the store refuses it before: tested below)
        store.update(version, sha256="0" * 64)
    assert swapper.check_once() is False
    assert version in swapper.refused
    engine = Engine(target, drafter, fixed_k(num_draft_tokens=3))
    seq = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=10))[0]
    assert drafter.version == v1 and seq.num_output_tokens == 10


def test_swapper_delivers_new_live_version_between_steps(tmp_path: Path) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    first = new_drafter_model(target, SHAPE, seed=0)
    drafter = TokenDrafter(first, publish_live(store, first))
    swapper = Swapper(LocalStore(store), drafter, FINGERPRINT)
    v2 = publish_live(store, new_drafter_model(target, SHAPE, seed=5))
    assert swapper.check_once()
    assert drafter.version != v2  # not yet: the switch waits for the next step
    Engine(target, drafter, fixed_k(num_draft_tokens=2)).generate([[4, 5]], SamplingParams(max_tokens=4))
    assert drafter.version == v2


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_gate_refuses_a_worse_candidate(tmp_path: Path, temperature: float) -> None:
    target = learnable_target()
    bus, store = InProcessBus(), WeightStore(tmp_path)
    good = new_drafter_model(target, SHAPE, copy_from_target=False, seed=0).float()
    config = LearnerConfig(learning_rate=3e-3, batch_size=16, window=32, duty_cycle=1.0, publish_every_steps=10**9,
                           publish_every_seconds=10**9, holdout_every=4, gate_margin=0.05)
    learner = Learner(config, bus, store, good, FINGERPRINT)
    for record in make_records(target, random_prompts(48, 2), temperature=temperature):
        bus.publish(record)
    learner.intake()
    # every fourth record is held out, sampled or not (OpenAI clients sample by default)
    assert len(learner.holdout) == 12 and {r.temperature for r in learner.holdout} == {temperature}
    for _ in range(120):
        learner.step()
    published = learner.maybe_publish(force=True)
    assert published is not None  # trained: better than the day-0 version, on this evidence
    evaluation = store.manifest(published)["evaluation"]
    assert evaluation["held_out_records"] == 12 and evaluation["sampled_records"] == (12 if temperature else 0)
    assert evaluation["candidate"] > evaluation["live"] + 1.0
    with torch.no_grad():  # sabotage the training copy: it now predicts noise
        for p in learner.model.blocks.parameters():
            p.add_(torch.randn_like(p) * 5)
        learner.model.lm_head.weight.mul_(-1)
    learner.stats.steps += 1
    live_before = store.live_version()
    assert learner.maybe_publish(force=True) is None
    rejected = store.manifest(store.versions()[-1])
    assert rejected["status"] == "rejected" and "worse than live" in rejected["reason"]
    assert store.live_version() == live_before


LIVE_ACCEPT_LENGTH, MARGIN = 2.0, 0.25  # binary fractions: the edge of the margin is exactly 1.75


def learner_with_held_out_records(tmp_path: Path) -> Learner:
    """A learner with version 1 live, four held-out greedy records (the gate's minimum) and a training
    copy that differs from 1."""
    target = learnable_target()
    config = LearnerConfig(duty_cycle=1.0, publish_every_steps=1, holdout_every=1, gate_margin=MARGIN)
    bus = InProcessBus()
    learner = Learner(config, bus, WeightStore(tmp_path), new_drafter_model(target, SHAPE, copy_from_target=False)
                      .float(), FINGERPRINT)
    for record in make_records(target, random_prompts(config.gate_min_held_out, 5)):
        bus.publish(record)
    learner.intake()  # every record is held out for the gate
    with torch.no_grad():
        learner.model.norm.weight.add_(1.0)
    learner.stats.steps += 1  # something new to publish
    return learner


def stub_accept_lengths(monkeypatch: pytest.MonkeyPatch, learner: Learner, candidate: float,
                        during: Callable[[], None] = lambda: None) -> None:
    """The gate's simulated accept lengths: `candidate` for the training copy, 2.0 for the live version."""
    def accept_length(model, records) -> float:
        assert records == list(learner.holdout)
        during()
        is_candidate = torch.equal(model.norm.weight, learner.model.norm.weight.detach())
        return candidate if is_candidate else LIVE_ACCEPT_LENGTH

    monkeypatch.setattr(learner, "simulated_accept_length", accept_length)


@pytest.mark.parametrize(("candidate", "passes"), [(1.75 + 2**-10, True), (1.75, True), (1.75 - 2**-10, False)],
                         ids=["inside", "on-the-margin", "outside"])
def test_gate_passes_a_candidate_within_the_margin_and_rejects_one_beyond_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, candidate: float, passes: bool) -> None:
    learner = learner_with_held_out_records(tmp_path)
    store = learner.store
    stub_accept_lengths(monkeypatch, learner, candidate)
    published = learner.maybe_publish(force=True)
    manifest = store.manifest(2)
    assert manifest["evaluation"]["candidate"] == candidate and manifest["evaluation"]["live"] == LIVE_ACCEPT_LENGTH
    assert manifest["evaluation"]["held_out_records"] == 4 and manifest["evaluation"]["passed"] is passes
    if passes:
        assert published == 2 and store.live_version() == 2 and manifest["status"] == "live"
    else:
        assert published is None and store.live_version() == 1 and manifest["status"] == "rejected"
        assert manifest["reason"] == f"accept length {candidate:.3f} is worse than live 2.000 beyond the margin"


def test_versions_each_within_the_margin_of_the_last_cannot_walk_the_drafter_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = learner_with_held_out_records(tmp_path)
    store = learner.store
    # each model's accept length by how far its norm moved from version 1's (one unit a candidate)
    first = float(learner.model.norm.weight[0].detach()) - 1.0
    scores = {0: LIVE_ACCEPT_LENGTH, 1: LIVE_ACCEPT_LENGTH - 0.125, 2: LIVE_ACCEPT_LENGTH - 0.25 - 2**-10,
              3: LIVE_ACCEPT_LENGTH + 0.125, 4: LIVE_ACCEPT_LENGTH}
    monkeypatch.setattr(learner, "simulated_accept_length",
                        lambda model, records: scores[round(float(model.norm.weight[0].detach()) - first)])

    def next_candidate() -> int | None:
        published = learner.maybe_publish(force=True)
        with torch.no_grad():
            learner.model.norm.weight.add_(1.0)
        learner.stats.steps += 1
        return published

    assert next_candidate() == 2  # 0.125 below live: inside the margin, live, but not the bar
    assert store.manifest(2)["evaluation"]["improved"] is False
    # 0.125 below live (version 2) again, yet beyond the margin below the bar (version 1): refused
    assert next_candidate() is None and store.live_version() == 2
    assert store.manifest(3)["reason"] == f"accept length {scores[2]:.3f} is worse than the bar 2.000 beyond the margin"
    assert next_candidate() == 4 and store.manifest(4)["evaluation"]["improved"] is True  # above the bar: the new bar
    assert next_candidate() == 5  # 0.125 below the new bar, inside the margin
    assert store.manifest(5)["evaluation"]["bar"] == scores[3]
    store.rollback(2)  # an operator's choice is the bar from then on
    assert learner.promoter.held() and learner.promoter.bar_version == learner.live_version == 2


def test_a_learner_restarted_soon_after_a_rollback_holds_for_what_is_left_of_the_hold(tmp_path: Path) -> None:
    from dataclasses import replace

    from specd.learner.promotion import GATE_PASSED, Promoter

    learner = learner_with_held_out_records(tmp_path)
    store, promoter = learner.store, learner.promoter
    second = store.publish(learner.model, FINGERPRINT, 1, {})
    store.set_live(second, GATE_PASSED)

    def restarted(hold: float) -> Promoter:   # a new learner process on the same store
        config = replace(learner.config, hold_after_rollback_s=hold)
        return Promoter(config, store, FINGERPRINT, torch.float32, None, learner.stats, promoter.take_weights)

    assert not restarted(60).held()          # its own version live: nothing to hold
    store.rollback(1)                        # an operator's rollback, then the learner restarts
    assert restarted(60).held()              # the restarted learner still holds (it published over it)
    assert not restarted(0.0).held()         # a hold that has run out holds nothing


def test_a_rollback_while_a_candidate_is_evaluated_stands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    learner = learner_with_held_out_records(tmp_path)
    store = learner.store
    stub_accept_lengths(monkeypatch, learner, LIVE_ACCEPT_LENGTH)
    assert learner.maybe_publish(force=True) == 2
    learner.stats.steps += 1

    def operator_rolls_back() -> None:  # while the learner evaluates its next candidate (3), which passes
        if store.live_version() != 1:
            store.rollback(1)

    stub_accept_lengths(monkeypatch, learner, LIVE_ACCEPT_LENGTH, during=operator_rolls_back)
    assert learner.maybe_publish(force=True) is None
    assert store.live_version() == learner.live_version == 1
    assert store.manifest(3)["status"] == "rejected"
    assert store.manifest(3)["reason"] == "the live version changed during the evaluation"
    learner.stats.steps += 1  # a publication is due, but the learner holds after someone else's change
    assert learner.maybe_publish() is None and store.versions() == [1, 2, 3]


def test_the_token_objective_weighs_and_pushes_down_the_learned_drafters_misses_only() -> None:
    from specd.core.records import StepRecord, TrajectoryRecord
    from specd.learner.signal import build_batch

    steps = [StepRecord(3, [9, 9], 1, 1, "learned"), StepRecord(5, [8, 8], 0, 1, "context2")]
    record = TrajectoryRecord("r", "s", [1, 2, 3], [4, 5, 6, 7, 10], steps, 0.0, 1.0, 0.0, 0.0)
    class WholeRecord(random.Random):
        def randint(self, a: int, b: int) -> int:
            return b  # the window ends at the record's last token

    batch = build_batch([record], window=64, miss_weight=3.0, prompt_weight=1.0, rng=WholeRecord())
    # label j is token j + 1
    assert batch.labels.tolist() == [[2, 3, 4, 5, 6, 7, 10]]
    assert batch.weights.tolist() == [[1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0]]   # token 4 (5): the learned miss
    assert batch.negatives.tolist() == [[-1, -1, -1, 9, -1, -1, -1]]          # context's miss at 5: neither


def test_malformed_records_are_refused_and_counted(tmp_path: Path) -> None:
    target = tiny_target()
    bus = InProcessBus()
    learner = Learner(LearnerConfig(duty_cycle=1.0), bus, WeightStore(tmp_path),
                      new_drafter_model(target, SHAPE).float(), FINGERPRINT)
    good = make_records(target, [[1, 2, 3]])[0]
    bad = [None, "text", {**good, "schema_version": 99}, {**good, "output_ids": [TINY.vocab_size]},
           {**good, "prompt_ids": "1 2 3"}, {**good, "steps": [{"position": -5, "drafts": [], "num_accepted": 0}]},
           {k: v for k, v in good.items() if k != "record_id"}]
    for record in [*bad, good]:
        bus.publish(record)
    learner.intake()
    assert learner.stats.records_in == 1
    assert sum(learner.stats.refused.values()) == len(bad)
    for raw in bad:
        with pytest.raises(RecordRefused):
            validate_record(raw, TINY.vocab_size)


def test_bus_sheds_oldest_records_when_full() -> None:
    bus = InProcessBus(capacity=3)
    for i in range(5):
        bus.publish({"n": i})
    assert bus.counters.shed == 2
    assert [r["n"] for r in bus.take(10, 0)] == [2, 3, 4]


def test_store_live_rollback_pin_and_gc(tmp_path: Path) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path, keep_last=2, keep_live_within_s=0)  # no protection by time here
    versions = [publish_live(store, new_drafter_model(target, SHAPE, seed=s)) for s in range(6)]
    store.pin(versions[0])
    assert store.live_version() == versions[-1]
    assert store.rollback() == versions[-2]
    assert store.manifest(versions[-1])["status"] == "rolled-back"
    assert store.live_version() == versions[-2]
    # pinned 1, live 5, the newest two (5, 6), the last two live before 5 (3, 4): only 2 goes
    assert store.gc() == [versions[1]]
    assert store.versions() == [v for v in versions if v != versions[1]]
    with pytest.raises(StoreError):
        store.rollback(to=999)


def test_conditional_promotion_refuses_when_the_live_version_moved(tmp_path: Path) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    first, second = (publish_live(store, new_drafter_model(target, SHAPE, seed=s)) for s in range(2))
    third = store.publish(new_drafter_model(target, SHAPE, seed=2), FINGERPRINT, second, {})
    store.rollback(first)  # someone else's change after the promotion of `third` was decided against `second`
    with pytest.raises(LiveVersionChanged):
        store.set_live(third, "gate passed", if_live=second)
    assert store.live_version() == first and store.manifest(third)["status"] == "candidate"
    store.set_live(third, "gate passed", if_live=first)
    assert store.live_version() == third


def test_store_cli_lists_rolls_back_and_pins(tmp_path: Path, capsys) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    versions = [publish_live(store, new_drafter_model(target, SHAPE, seed=s)) for s in range(3)]
    assert main(["rollback", str(versions[0]), "--store", str(tmp_path)]) == 0
    assert main(["pin", str(versions[0]), "--store", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["versions", "--store", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["live"] == versions[0] and listing["versions"][0]["pinned"]
    assert main(["rollback", "--store", str(tmp_path / "missing")]) == 2


def test_catch_up_after_a_swap_is_spread_over_steps_and_stays_lossless() -> None:
    target = tiny_target()
    prompts = [list(range(1 + i, 41 + i)) for i in range(3)]  # 40-token prompts
    plain = Engine(target, None, EngineConfig(max_batch=3))
    expected = [s.output_ids for s in plain.generate(prompts, SamplingParams(max_tokens=60))]
    drafter = TokenDrafter(target, "self", catchup_tokens_per_step=16)  # the target drafting for itself
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4))
    seqs = [engine.add_request(p, SamplingParams(max_tokens=60)) for p in prompts]
    engine.step()
    while len(engine.running) < len(prompts):  # chunked prefill: every row decodes before the swap
        engine.step()
    drafter.offer(target, "self-again")  # a swap: every row must rebuild 40+ cached tokens
    to_rebuild = sum(s.num_tokens - 2 for s in seqs)  # the last two tokens are fed with the proposal itself
    proposed_per_step = []
    while engine.has_work:
        engine.step()
        proposed_per_step.append(engine.step_stats[-1].num_drafts_proposed)
    catching_up = proposed_per_step[:proposed_per_step.index(3 * 4)]  # the steps before every row drafts again
    assert catching_up[0] == 0  # 16 tokens a step rebuild less than one row: no row drafts right after the swap
    # rows become ready one at a time, in slot order, no sooner than 16 tokens a step allows
    assert catching_up == sorted(catching_up) and {n % 4 for n in catching_up} == {0}
    assert len(catching_up) >= math.ceil(to_rebuild / 16)
    assert [s.output_ids for s in seqs] == expected


def test_learner_holds_publishing_after_an_operator_rollback(tmp_path: Path) -> None:
    target = learnable_target()
    bus, store = InProcessBus(), WeightStore(tmp_path)
    # half the records held out (enough for the gate); a wide margin: the first candidate surely passes
    config = LearnerConfig(duty_cycle=1.0, publish_every_steps=1, holdout_every=2, gate_margin=10.0,
                           hold_after_rollback_s=3600)
    learner = Learner(config, bus, store, new_drafter_model(target, SHAPE, copy_from_target=False).float(),
                      FINGERPRINT)
    for record in make_records(target, random_prompts(8, 3)):
        bus.publish(record)
    learner.step()
    assert store.live_version() == 2
    store.rollback()  # the operator
    for _ in range(3):
        learner.step()
    assert store.live_version() == 1 and store.versions() == [1, 2]


def test_versions_reference_a_frozen_target_embedding_instead_of_copying_it(tmp_path: Path) -> None:
    from specd.core.errors import CheckpointError
    from specd.drafter.checkpoint import load_drafter

    target = tiny_target()
    store = WeightStore(tmp_path)
    drafter = new_drafter_model(target, DrafterShape(1, 32, 4, 2, 64, head_vocab_size=64), copy_from_target=True)
    shared = store.publish(drafter, FINGERPRINT, None, {}, target_embedding=target.embed.weight)
    copied = store.publish(drafter, FINGERPRINT, None, {})
    assert store.weights_path(shared).stat().st_size < store.weights_path(copied).stat().st_size
    loaded = load_drafter(store.weights_path(shared), FINGERPRINT, target_embedding=target.embed.weight)
    torch.testing.assert_close(loaded.embed.weight, target.embed.weight.float())
    with pytest.raises(CheckpointError, match="shares the target's embedding"):
        load_drafter(store.weights_path(shared), FINGERPRINT)


def test_gate_waits_for_enough_held_out_records_then_promotes_a_good_candidate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = learnable_target()
    bus, store = InProcessBus(), WeightStore(tmp_path)
    config = LearnerConfig(duty_cycle=1.0, publish_every_steps=1, holdout_every=2, gate_min_held_out=4)
    learner = Learner(config, bus, store, new_drafter_model(target, SHAPE, copy_from_target=False).float(),
                      FINGERPRINT)
    day0 = [p.detach().clone() for p in learner.model.parameters()]

    def accept_length(model, records) -> float:  # the trained candidate beats day 0 by a full token
        assert len(records) >= config.gate_min_held_out  # the gate never judges on less evidence
        is_day0 = all(torch.equal(p.float(), q) for p, q in zip(model.parameters(), day0, strict=True))
        return 1.0 if is_day0 else 2.0

    monkeypatch.setattr(learner, "simulated_accept_length", accept_length)
    records = make_records(target, random_prompts(12, 6), temperature=1.0)
    for record in records[:4]:
        bus.publish(record)
    # a publication is due after the first step, but two held-out records are not evidence; after
    # that none is due until records arrive (the held-out set cannot have grown either)
    for _ in range(3):
        assert learner.step()
    assert store.versions() == [1] and store.live_version() == learner.live_version == 1
    assert learner.stats.gate_waits == 1 and learner.stats.published == learner.stats.rejected == []
    assert learner.health()["gate_waits"] == 1 and learner.health()["held_out_records"] == 2
    for record in records[4:]:
        bus.publish(record)
    assert learner.step()
    assert len(learner.holdout) == 6 and learner.stats.gate_waits == 1
    assert store.live_version() == learner.live_version == 2
    assert store.manifest(2)["evaluation"] == {"passed": True, "reason": "ok", "candidate": 2.0, "live": 1.0,
                                               "bar": 1.0, "improved": True, "held_out_records": 6,
                                               "sampled_records": 6, "domain_weights": {"default": 1.0},
                                               "replay_k": learner.config.k}
    # no traffic: the learner trains on, but offers nothing new (an idle server once got a version
    # every publish_every_seconds)
    for _ in range(5):
        assert learner.step()
    assert store.versions() == [1, 2] and learner.stats.steps == 9


def test_gate_never_passes_for_lack_of_evidence_even_when_forced(tmp_path: Path) -> None:
    target = learnable_target()
    bus, store = InProcessBus(), WeightStore(tmp_path)
    learner = Learner(LearnerConfig(duty_cycle=1.0, holdout_every=10**9), bus, store,
                      new_drafter_model(target, SHAPE).float(), FINGERPRINT)
    for record in make_records(target, random_prompts(4, 7)):
        bus.publish(record)
    assert learner.step()
    assert not learner.holdout and learner.maybe_publish(force=True) is None
    assert store.versions() == [1] and learner.stats.gate_waits == 1
    verdict = learner.evaluate(learner.model)  # asked directly, the gate fails rather than passes
    assert verdict["passed"] is False and verdict["reason"] == "0 held-out records, the gate needs 4"


@pytest.mark.parametrize("fields", [{"gate_min_held_out": 0}, {"holdout_capacity": 3, "gate_min_held_out": 4},
                                    {"holdout_every": 0}])
def test_a_gate_that_could_pass_without_evidence_is_refused_at_configuration(fields: dict) -> None:
    with pytest.raises(ConfigurationError):
        LearnerConfig(**fields)


@pytest.mark.parametrize("fields", [{"learning_rate": 0.0}, {"feature_learning_rate": float("nan")},
                                    {"publish_every_seconds": 0}, {"publish_every_steps": 0}, {"unroll": 0},
                                    {"buffer_capacity": 0}, {"recent_share": 1.5}, {"gate_margin": -0.1},
                                    {"canary_z": float("inf")}])
def test_step_sizes_counts_and_margins_that_cannot_work_are_refused_at_configuration(fields: dict) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(fields))):
        LearnerConfig(**fields)


def test_a_failing_learner_step_is_counted_and_the_loop_trains_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(learner_module, "FAILURE_BACKOFF_S", 0.01)  # the loop's pause after a failure
    target = tiny_target()
    bus = InProcessBus()
    config = LearnerConfig(duty_cycle=1.0, publish_every_steps=10**9, publish_every_seconds=10**9)
    learner = Learner(config, bus, WeightStore(tmp_path), new_drafter_model(target, SHAPE).float(), FINGERPRINT)
    for record in make_records(target, random_prompts(4, 8)):
        bus.publish(record)
    real_train_step, calls, trained = learner.train_step, 0, threading.Event()

    def fails_twice() -> float:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"boom {calls}")
        loss = real_train_step()
        trained.set()
        return loss

    monkeypatch.setattr(learner, "train_step", fails_twice)
    with caplog.at_level(logging.ERROR, logger=learner_module.__name__):
        learner.start()
        try:
            assert trained.wait(60), "the learner thread stopped training after its failures"
            health = learner.health()
        finally:
            learner.stop()
    assert health["running"] is True and not learner.health()["running"]
    assert health["loop_failures"] == learner.stats.loop_failures == 2
    assert health["last_failure"]["error"] == "RuntimeError: boom 2" and health["last_failure"]["time"] > 0
    assert learner.stats.steps >= 1
    failures = [r for r in caplog.records if r.exc_info is not None]
    assert len(failures) == 2 and str(failures[-1].exc_info[1]) == "boom 2"  # logged with the traceback


def test_store_refuses_to_make_live_weights_that_no_longer_match_their_manifest(tmp_path: Path) -> None:
    target = tiny_target()
    store = WeightStore(tmp_path)
    v1 = publish_live(store, new_drafter_model(target, SHAPE, seed=0))
    v2 = store.publish(new_drafter_model(target, SHAPE, seed=1), FINGERPRINT, v1, {})
    path = store.weights_path(v2)
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(8)  # a disk fault in the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="does not match"):
        store.set_live(v2)
    assert store.live_version() == v1
    v3 = publish_live(store, new_drafter_model(target, SHAPE, seed=2))
    store.weights_path(v1).write_bytes(store.weights_path(v1).read_bytes()[:-4])
    with pytest.raises(StoreError, match="does not match"):
        store.rollback(v1)
    assert store.live_version() == v3 and store.live_state().get("rollbacks", 0) == 0
    publish_live(store, new_drafter_model(target, SHAPE, seed=3))
    assert store.rollback() == v3 and store.live_state()["rollbacks"] == 1  # counted for the dashboard
