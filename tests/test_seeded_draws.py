"""Seeded sampled requests answer as the target alone does with that seed, under any drafter, k,
batch or swap (their tokens are the seed's Gumbel-max draws), and drafters draw with the same
noise. Distribution tests of seeded draws are in test_sampled_lossless.py."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import fixed_k, tiny_drafter, tiny_target

from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.token_drafter import TokenDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, Sequence
from specd.model.seeded_draws import PositionNoise
from specd.model.transformer import Transformer

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13, 12, 13], [20, 30, 40, 50], [7] * 9]


def seeded(seed: int, temperature: float = 0.9, top_p: float = 0.95) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=24, seed=seed)


def served(target: Transformer, drafter, config: EngineConfig, params: list[SamplingParams]) -> list[Sequence]:
    engine = Engine(target, drafter, config)
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while engine.has_work:
        engine.step()
    return seqs


def answers(target: Transformer, drafter, config: EngineConfig, params: list[SamplingParams]) -> list[list[int]]:
    return [s.output_ids for s in served(target, drafter, config, params)]


def feature_drafter(target: Transformer) -> FeatureDrafter:
    return FeatureDrafter(new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight,
                                              target.norm.weight, torch.arange(target.config.vocab_size), seed=3))


DRAFTERS = {"token": tiny_drafter, "token, argmax drafts": lambda t: TokenDrafter(tiny_drafter(t).model,
                                                                                   sampled_drafts="argmax"),
            "feature": feature_drafter, "hybrid": lambda t: HybridDrafter(feature_drafter(t))}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_a_seeded_request_answers_as_the_target_alone_under_any_drafter(name: str, k: int) -> None:
    target = tiny_target()
    params = [seeded(seed) for seed in range(len(PROMPTS))]
    alone = answers(target, None, EngineConfig(max_batch=1), params)  # one at a time, no speculation
    seqs = served(target, DRAFTERS[name](target), fixed_k(max_batch=3, num_draft_tokens=k), params)
    assert [s.output_ids for s in seqs] == alone
    assert sum(s.num_drafts_accepted for s in seqs) > 0  # speculation took part


def test_seeded_answers_hold_across_swaps_and_the_adaptive_lookahead() -> None:
    target = tiny_target()
    params = [seeded(seed, temperature=1.2, top_p=1.0) for seed in range(len(PROMPTS))]
    alone = answers(target, None, EngineConfig(max_batch=len(PROMPTS)), params)
    drafter = tiny_drafter(target)
    models = [tiny_drafter(target, seed=s).model for s in (4, 5)]
    engine = Engine(target, drafter, EngineConfig(max_batch=4, num_draft_tokens=3))
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    step = 0
    while engine.has_work:
        engine.step()
        drafter.offer(models[step % 2], step + 2)  # a new version every step
        step += 1
    assert [s.output_ids for s in seqs] == alone
    assert drafter.num_swaps >= 5 and sum(s.num_drafts_proposed for s in seqs) > 0


def test_drafts_drawn_with_the_seeds_noise_from_the_targets_own_distribution_are_all_accepted() -> None:
    # a drafter that is the target itself (q = p) and draws with the seed's noise for the index it
    # drafts proposes exactly the target's draws: every draft is accepted, at every chain position
    target = tiny_target()
    drafter = TokenDrafter(copy.deepcopy(target))
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4))
    seqs = [engine.add_request(p, seeded(seed)) for seed, p in enumerate(PROMPTS)]
    while engine.has_work:
        engine.step()
    assert all(s.num_drafts_accepted == s.num_drafts_proposed > 0 for s in seqs)
    alone = answers(target, None, EngineConfig(max_batch=len(PROMPTS)), [seeded(s) for s in range(len(PROMPTS))])
    assert [s.output_ids for s in seqs] == alone


def test_other_seeds_give_other_answers_and_greedy_rows_ignore_the_seed() -> None:
    target = tiny_target()
    config = fixed_k(max_batch=6, num_draft_tokens=2)
    first = answers(target, tiny_drafter(target), config, [seeded(1)] * len(PROMPTS))
    second = answers(target, tiny_drafter(target), config, [seeded(2)] * len(PROMPTS))
    assert first != second
    greedy = SamplingParams(max_tokens=24)
    assert answers(target, tiny_drafter(target), config, [SamplingParams(max_tokens=24, seed=9)] * len(PROMPTS)) \
        == answers(target, None, EngineConfig(max_batch=6), [greedy] * len(PROMPTS))


def test_with_seeded_draws_off_the_seed_fixes_the_stream_not_the_answer() -> None:
    target = tiny_target()
    params = [seeded(seed, temperature=1.5, top_p=1.0) for seed in range(len(PROMPTS))]
    config = fixed_k(max_batch=3, num_draft_tokens=3, seeded_draws=False)
    runs = [answers(target, tiny_drafter(target), config, params) for _ in range(2)]
    assert runs[0] == runs[1]  # the same drafter and batch: the same draws
    other_drafter = answers(target, tiny_drafter(target, seed=7), config, params)
    assert other_drafter != runs[0]  # drafts decide which draws a row takes


def test_position_noise_depends_on_seed_and_position_alone() -> None:
    noise = PositionNoise(5, 50, keep=2)
    first = noise.at(3).clone()
    for position in range(10):  # evicts position 3
        noise.at(position + 4)
    assert torch.equal(noise.at(3), first) and torch.equal(PositionNoise(5, 50).at(3), first)
    assert not torch.equal(noise.at(4), first) and not torch.equal(PositionNoise(6, 50).at(3), first)
    assert len(noise._kept) <= 2 and bool(torch.isfinite(first).all())
    assert torch.equal(PositionNoise(-1, 50).at(0), PositionNoise(2**64 - 1, 50).at(0))  # one 64-bit seed
