"""Engine behaviour on tiny float64 models: losslessness, stops, refusals, counts, sampling.

The sampled-mode distribution tests are in test_sampled_lossless.py."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, always_right_counts, counts_by_source, fixed_k, tiny_drafter, tiny_target

from specd.core.errors import RequestRefused
from specd.core.records import AcceptanceCounts
from specd.drafter.base import DraftBatch, Proposal
from specd.drafter.replay import ReplayDrafter
from specd.drafter.token_drafter import TokenDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.greedy_recording import record_greedy
from specd.engine.request import SamplingParams

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13], [20, 30, 40, 50], [7] * 9]
GREEDY = SamplingParams(max_tokens=40)


def target_only(target, prompts=PROMPTS, params=GREEDY, eos=(), max_batch=4):
    engine = Engine(target, None, EngineConfig(max_batch=max_batch, eos_token_ids=eos))
    return [s.output_ids for s in engine.generate(prompts, params)]


def noisy_replay(target, every: int) -> ReplayDrafter:
    """Replays the target's output with every `every`-th token (per prompt offset) corrupted."""
    exact = record_greedy(target, PROMPTS, GREEDY.max_tokens).recordings
    noisy = {}
    for n, (prompt, out) in enumerate(exact.items()):
        noisy[prompt] = [(t + 1) % TINY.vocab_size if (i + n) % every == every - 1 else t for i, t in enumerate(out)]
    return ReplayDrafter(noisy)


class WrongDrafter:
    """Always proposes a token the target never picks first: every first draft is rejected."""

    def __init__(self, expected: dict[int, int]) -> None:
        self.expected = expected

    version = 0

    def bind(self, max_batch, max_seq, device) -> None: ...
    def start(self, slot) -> None: ...
    def move(self, src, dst) -> None: ...
    def commit(self, num_accepted) -> None: ...

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        return Proposal(torch.full((batch.num_rows, k), TINY.vocab_size - 1))


DRAFTERS = {
    "random": lambda t: tiny_drafter(t),
    "replay": lambda t: record_greedy(t, PROMPTS, GREEDY.max_tokens),
    "noisy-replay": lambda t: noisy_replay(t, every=3),
    "self": lambda t: TokenDrafter(t),  # the target drafting for itself: all accepted
}


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("drafter_name", sorted(DRAFTERS))
def test_greedy_output_identical_to_target_only(k: int, drafter_name: str) -> None:
    target = tiny_target()
    expected = target_only(target)
    engine = Engine(target, DRAFTERS[drafter_name](target), fixed_k(max_batch=3, num_draft_tokens=k))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == expected
    if drafter_name in ("replay", "self"):  # always right: every draft accepted, k + 1 tokens a pass
        counts = [(s.num_target_passes, s.num_drafts_proposed, s.num_drafts_accepted) for s in seqs]
        assert counts == [always_right_counts(40, 40, k)] * len(PROMPTS)
        assert all(s.acceptance_rate == 1.0 for s in seqs)


def test_rows_in_one_batch_accept_different_numbers_of_drafts() -> None:
    target = tiny_target()
    engine = Engine(target, noisy_replay(target, every=3), fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = engine.generate(PROMPTS, GREEDY)
    first_step_accepts = {s.steps[0].num_accepted for s in seqs}
    assert len(first_step_accepts) > 1
    assert [s.output_ids for s in seqs] == target_only(target)


def test_all_drafts_accepted_adds_bonus_token() -> None:
    target = tiny_target()
    engine = Engine(target, record_greedy(target, PROMPTS, 40), fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert all(s.steps[0].num_accepted == 4 for s in seqs)
    assert all(s.num_target_passes == 8 for s in seqs)  # 40 tokens at 5 a pass


def test_first_draft_rejected_every_step_still_lossless() -> None:
    target = tiny_target()
    engine = Engine(target, WrongDrafter({}), fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == target_only(target)
    tokens_equal_to_draft = sum(t == TINY.vocab_size - 1 for s in seqs for t in s.output_ids)
    assert sum(s.num_drafts_accepted for s in seqs) == tokens_equal_to_draft


def test_eos_inside_accepted_drafts_stops_exactly_there() -> None:
    target = tiny_target()
    full = target_only(target)
    eos = full[0][5]  # a token the target emits mid-run for the first prompt
    expected = target_only(target, eos=(eos,))
    assert expected[0] == full[0][:full[0].index(eos) + 1]
    engine = Engine(target, record_greedy(target, PROMPTS, 40), fixed_k(
        max_batch=6, num_draft_tokens=8, eos_token_ids=(eos,)))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == expected
    assert seqs[0].finish_reason == "stop"
    # the replayed drafts are all right; drafts proposed past the EOS are the only ones not accepted
    for seq in seqs:
        assert (seq.num_target_passes, seq.num_drafts_proposed, seq.num_drafts_accepted) == always_right_counts(
            seq.num_output_tokens, GREEDY.max_tokens, 8)
    assert seqs[0].acceptance_rate < 1.0


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 13])
def test_max_tokens_respected_mid_step(max_tokens: int) -> None:
    target = tiny_target()
    params = SamplingParams(max_tokens=max_tokens)
    engine = Engine(target, record_greedy(target, PROMPTS, 40), fixed_k(max_batch=6, num_draft_tokens=8))
    seqs = engine.generate(PROMPTS, params)
    assert [s.output_ids for s in seqs] == target_only(target, params=params)
    assert all(s.num_output_tokens == max_tokens and s.finish_reason == "length" for s in seqs)


def test_k_larger_than_tokens_left_counts_only_usable_drafts() -> None:
    target = tiny_target()
    engine = Engine(target, record_greedy(target, PROMPTS, 40), fixed_k(max_batch=6, num_draft_tokens=8))
    seq = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0]
    assert seq.num_drafts_proposed == 2 and seq.num_target_passes == 1


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(RequestRefused, match="empty"):
        Engine(tiny_target()).add_request([], GREEDY)


def test_prompt_over_context_window_is_refused() -> None:
    engine = Engine(tiny_target(), None, EngineConfig(max_context=64))
    with pytest.raises(RequestRefused, match="context window of 64"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=8))


def test_out_of_vocabulary_prompt_is_refused() -> None:
    with pytest.raises(RequestRefused, match="outside the vocabulary"):
        Engine(tiny_target()).add_request([1, TINY.vocab_size], GREEDY)


def test_bad_sampling_settings_are_refused() -> None:
    for bad in ({"temperature": -1.0}, {"temperature": float("inf")}, {"temperature": float("nan")},
                {"top_p": 0.0}, {"top_p": float("nan")}, {"max_tokens": 0}, {"seed": 2**80}, {"seed": -(2**64)}):
        with pytest.raises(RequestRefused):
            SamplingParams(**bad)


def test_seeds_at_the_edges_of_torchs_range_are_served() -> None:
    engine = Engine(tiny_target())
    for seed in (-(2**63), 2**64 - 1):
        assert len(engine.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=3, seed=seed))[0]
                   .output_ids) == 3


def test_a_failing_prefill_fails_its_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=3, num_draft_tokens=3))
    start = engine._start

    def faulty(part):  # a fault traced to one request's admission (as an overflowing seed was)
        if part.seq.prompt_ids == PROMPTS[1]:
            raise RuntimeError("Overflow when unpacking long")
        start(part)

    monkeypatch.setattr(engine, "_start", faulty)
    seqs = engine.generate(PROMPTS[:3], GREEDY)
    assert seqs[1].finish_reason == "error" and "Overflow" in (seqs[1].error or "")
    healthy = Engine(target, None, EngineConfig(max_batch=3)).generate([PROMPTS[0], PROMPTS[2]], GREEDY)
    assert [seqs[0].output_ids, seqs[2].output_ids] == [s.output_ids for s in healthy]


def test_requests_join_and_leave_between_steps() -> None:
    target = tiny_target()
    params = [SamplingParams(max_tokens=n) for n in (5, 30, 12, 3, 25, 18)]
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=2, num_draft_tokens=4))
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    batch_sizes = []
    while engine.has_work:
        engine.step()
        batch_sizes.append(engine.step_stats[-1].num_rows)
    assert max(batch_sizes) == 2
    for seq, prompt, sp in zip(seqs, PROMPTS, params, strict=True):
        assert seq.output_ids == target_only(target, [prompt], sp)[0]


def test_counts_add_up_per_request_and_per_step() -> None:
    target = tiny_target()
    engine = Engine(target, noisy_replay(target, every=4), fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = engine.generate(PROMPTS, GREEDY)
    for seq in seqs:
        assert seq.num_drafts_proposed == sum(len(step.drafts) for step in seq.steps)
        assert seq.num_output_tokens == seq.num_target_passes + seq.num_drafts_accepted
    assert sum(s.num_drafts_accepted for s in engine.step_stats) == sum(s.num_drafts_accepted for s in seqs)
    assert sum(s.num_tokens_emitted for s in engine.step_stats) == sum(s.num_output_tokens for s in seqs)
    per_step, per_request = AcceptanceCounts(), AcceptanceCounts()
    for stats in engine.step_stats:
        per_step.add(stats.counts)
    for seq in seqs:
        per_request.add(seq.counts)
    assert per_step == per_request and per_step.passes == sum(s.num_target_passes for s in seqs)


def test_sampled_output_is_reproducible_for_a_seed() -> None:
    target = tiny_target()
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=3)
    runs = [[s.output_ids for s in Engine(target, tiny_drafter(target), fixed_k(num_draft_tokens=3))
             .generate(PROMPTS[:3], params)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_mixed_greedy_and_sampled_rows_keep_greedy_rows_lossless() -> None:
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=4, num_draft_tokens=4))
    greedy = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    for p in PROMPTS[2:4]:
        engine.add_request(p, SamplingParams(temperature=1.0, max_tokens=40, seed=1))
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in greedy] == target_only(target, PROMPTS[:2])


def test_lookahead_controller_stops_drafting_for_a_useless_drafter_but_keeps_probing() -> None:
    from specd.engine.lookahead import LookaheadConfig, LookaheadController

    controller = LookaheadController(LookaheadConfig(max_k=4, probe_every=4))
    assert controller.choose("v1") == 4  # nothing measured yet
    for _ in range(60):
        k = controller.choose("v1")
        controller.observe(k, accepted=0, rejected=1 if k else 0, draft_seconds=0.02 * k, verify_seconds=0.1)
    choices = [controller.choose("v1") for _ in range(8)]
    assert choices.count(0) == 6 and choices.count(1) == 2  # probes every fourth step
    # a new version gets a fresh start from the prior acceptance 0.6: with 0.02 s a draft and 0.1 s a pass,
    # k = 3 gives (1 - 0.6^4) / 0.4 tokens in 3 * 0.02 + 0.1 * 1.15 / 1.2 s, the best rate (13.96 tokens/s)
    assert controller.choose("v2") == 3 and controller.acceptance == 0.6


def test_lookahead_controller_drafts_fully_for_a_good_drafter() -> None:
    from specd.engine.lookahead import LookaheadConfig, LookaheadController

    controller = LookaheadController(LookaheadConfig(max_k=4))
    for _ in range(30):
        k = controller.choose("v")
        controller.observe(k, accepted=k, rejected=0, draft_seconds=0.005 * k, verify_seconds=0.1 + 0.005 * k)
    assert controller.choose("v") == 4


def test_lookahead_controller_measures_the_same_acceptance_whatever_k_it_drafts() -> None:
    from specd.engine.lookahead import LookaheadConfig, LookaheadController

    # a drafter each of whose drafts is accepted with chance 0.6 once those before it were: at k = 4
    # a row accepts 0.6 + 0.36 + 0.216 + 0.13 = 1.31 drafts on average, 0.33 of those proposed, and
    # ends in a rejection with chance 1 - 0.6^4. Each step below is 1000 such rows, in expectation.
    for k in (1, 2, 4):
        controller = LookaheadController(LookaheadConfig(max_k=4, smoothing=0.5))
        accepted = round(1000 * sum(0.6 ** i for i in range(1, k + 1)))
        rejected = round(1000 * (1 - 0.6 ** k))
        for _ in range(40):
            controller.observe(k, accepted=accepted, rejected=rejected, draft_seconds=0.01 * k, verify_seconds=0.1)
        assert controller.acceptance == pytest.approx(0.6, abs=1e-3)


def test_engine_steps_count_the_rows_whose_chain_ended_in_a_rejection() -> None:
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=4, num_draft_tokens=3))
    for p in PROMPTS[:4]:
        engine.add_request(p, GREEDY)
    while engine.has_work:
        engine.step()
    drafted = [s for s in engine.step_stats if s.num_drafts_proposed]
    assert drafted and all(0 <= s.num_rejections <= s.num_rows for s in drafted)
    # a row's drafts were all accepted or it had one rejected: accepted + rejected <= proposed
    assert all(s.num_drafts_accepted + s.num_rejections <= s.num_drafts_proposed for s in drafted)
    assert any(s.num_rejections for s in drafted)


def test_a_step_without_learned_drafts_is_a_sample_of_verification_only() -> None:
    from specd.engine.lookahead import LookaheadCosts

    running, sampled = LookaheadCosts(), LookaheadCosts(keep_samples=True)
    for costs in (running, sampled):
        costs.observe(2, 0.02, 0.1, weight=0.5)
        costs.observe(2, None, 0.2, weight=0.5)   # continuations served every row: no drafting time
    assert running.draft_seconds == pytest.approx(0.01) and running.verify_seconds[2] == pytest.approx(0.15)
    frozen = sampled.frozen_copy()
    assert frozen.draft_seconds == pytest.approx(0.01) and frozen.measured_verify_seconds == {2: pytest.approx(0.15)}


def test_calibrated_costs_freeze_the_medians_of_their_samples_not_a_running_average() -> None:
    from specd.engine.lookahead import LookaheadCosts

    costs = LookaheadCosts(keep_samples=True)
    # a slow first step (a cold cache, a noisy neighbour) and then the true costs
    for k, draft, verify in [(2, 0.2, 0.5), (2, 0.02, 0.1), (2, 0.02, 0.1), (0, 0.0, 0.3), (0, 0.0, 0.08),
                             (0, 0.0, 0.08), (4, 0.04, 0.12), (4, 0.04, 0.12), (4, 0.4, 0.9)]:
        costs.observe(k, draft, verify, weight=0.1)
    assert costs.verify_seconds[2] > 0.3  # the running average still follows the first sample
    frozen = costs.frozen_copy()
    assert frozen.frozen and frozen.measured_verify_seconds == {0: 0.08, 2: 0.1, 4: 0.12}
    assert frozen.verify_seconds == pytest.approx({0: 0.08, 2: 0.1, 4: 0.12})  # on a line already
    assert frozen.draft_seconds == pytest.approx(0.01)  # per drafted position
    frozen.observe(1, 0.5, 0.5, weight=1.0)
    assert frozen.verify_seconds == pytest.approx({0: 0.08, 2: 0.1, 4: 0.12})


def test_the_line_fit_keeps_one_ks_burst_of_load_from_making_that_k_look_dearer() -> None:
    from specd.engine.lookahead import LookaheadCosts

    costs = LookaheadCosts(keep_samples=True)
    true = {0: 0.08, 1: 0.09, 2: 0.10, 3: 0.11, 4: 0.12}
    for k, seconds in true.items():
        for _ in range(5):  # every sample of k = 2 caught a burst of load
            costs.observe(k, 0.01 * k, seconds * (1.6 if k == 2 else 1.0), weight=0.1)
    frozen = costs.frozen_copy("line")
    assert frozen.measured_verify_seconds[2] == pytest.approx(0.16)
    assert frozen.verify_seconds == pytest.approx(true)


def test_the_monotone_fit_keeps_a_kernels_steps_and_never_prices_a_longer_pass_cheaper() -> None:
    from specd.engine.lookahead import LookaheadCosts

    costs = LookaheadCosts(keep_samples=True)
    # 1-3 positions in one register block cost alike (one measured a hair cheaper), 4-5 in two cost more
    for k, seconds in {0: 0.100, 1: 0.100, 2: 0.098, 3: 0.130, 4: 0.131}.items():
        costs.observe(k, 0.01 * k, seconds, weight=0.1)
    frozen = costs.frozen_copy()
    pooled = (0.100 + 0.100 + 0.098) / 3
    assert frozen.verify_seconds == pytest.approx({0: pooled, 1: pooled, 2: pooled, 3: 0.130, 4: 0.131})
    assert frozen.measured_verify_seconds[2] == 0.098


def test_the_calibration_sweep_drafts_every_k_in_turn() -> None:
    from specd.engine.lookahead import CalibrationSweep, LookaheadCosts

    sweep = CalibrationSweep(3, LookaheadCosts())
    assert [sweep.choose(version=1) for _ in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_adaptive_lookahead_stays_lossless_when_it_changes_k() -> None:
    target = tiny_target()
    engine = Engine(target, noisy_replay(target, every=2), EngineConfig(max_batch=3, num_draft_tokens=6))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == target_only(target)
    assert len({s.k for s in engine.step_stats}) > 1


def test_engine_counts_each_drafting_source_apart() -> None:
    from specd.drafter.hybrid import HybridDrafter

    target = tiny_target()
    engine = Engine(target, HybridDrafter(tiny_drafter(target)), fixed_k(max_batch=3, num_draft_tokens=3))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 3, 3, 3, 3]]   # two repeat themselves
    seqs = engine.generate(prompts, SamplingParams(max_tokens=20))
    counted: dict[str, AcceptanceCounts] = {}
    for stats in engine.step_stats:
        for source, counts in stats.by_source.items():
            counted.setdefault(source, AcceptanceCounts()).add(counts)
    expected = counts_by_source(seqs)
    assert {"learned", "context"} <= set(counted)
    assert {s: c.as_dict() for s, c in counted.items()} == {s: c.as_dict() for s, c in expected.items()}
