"""Chunked prefill: long prompts enter the cache a few tokens a step, beside running streams,
and nothing about the output changes (greedy equals the target alone, features equal training's)."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_k, tiny_drafter, tiny_target

from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams

LONG = [(3 * i + 1) % 90 + 1 for i in range(41)]
PROMPTS = [[1, 2, 3], LONG, [4], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], LONG[:17], [7] * 9]
PARAMS = [SamplingParams(max_tokens=n) for n in (6, 20, 9, 30, 14, 25)]  # rows retire while others prefill


def target_only(target, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(max_batch=8, prefill_chunk=None))
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    return [s.output_ids for s in seqs]


def feature_drafter(target) -> FeatureDrafter:
    return FeatureDrafter(new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight,
                                              target.norm.weight, torch.arange(target.config.vocab_size)))


DRAFTERS = {"none": lambda t: None, "token": tiny_drafter, "feature": feature_drafter,
            "hybrid": lambda t: HybridDrafter(tiny_drafter(t))}


@pytest.mark.parametrize("chunk", [1, 4, 7])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_output_equals_the_target_alone_whatever_the_chunk(chunk: int, drafter: str) -> None:
    target = tiny_target()
    engine = Engine(target, DRAFTERS[drafter](target), fixed_k(max_batch=3, num_draft_tokens=3, prefill_chunk=chunk))
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    prefill_steps_beside_running = 0
    while engine.has_work:
        engine.step()
        if engine.prefilling is not None and engine.running:
            prefill_steps_beside_running += 1
            assert engine.prefilling.slot == len(engine.running)   # the slot just past the running rows
    assert [s.output_ids for s in seqs] == target_only(target)
    assert prefill_steps_beside_running >= len(LONG) // chunk // 2   # the long prompt took many steps


def test_running_streams_emit_every_step_while_a_long_prompt_prefills() -> None:
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=4, num_draft_tokens=2, prefill_chunk=5))
    streams = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=30)) for _ in range(2)]
    engine.step()
    late = engine.add_request(LONG, SamplingParams(max_tokens=4))
    emitted_while_prefilling = []
    while late.num_output_tokens == 0 and engine.has_work:
        before = [s.num_output_tokens for s in streams]
        engine.step()
        if engine.prefilling is not None:
            emitted_while_prefilling.append([s.num_output_tokens - b for s, b in zip(streams, before, strict=True)])
    assert len(emitted_while_prefilling) >= len(LONG) // 5 - 1
    assert all(min(step) >= 1 for step in emitted_while_prefilling)  # no stream stalls for the prefill


def test_a_request_cancelled_during_its_prefill_frees_its_slot() -> None:
    target = tiny_target()
    engine = Engine(target, tiny_drafter(target), fixed_k(max_batch=2, num_draft_tokens=2, prefill_chunk=4))
    running = engine.add_request([1, 2, 3], SamplingParams(max_tokens=12))
    doomed = engine.add_request(LONG, SamplingParams(max_tokens=5))
    after = engine.add_request([9, 8, 7], SamplingParams(max_tokens=6))
    engine.step()
    assert engine.prefilling is not None and engine.prefilling.seq is doomed
    engine.cancel(doomed.request_id)
    while engine.has_work:
        engine.step()
    assert doomed.finish_reason == "cancelled" and doomed.num_output_tokens == 0
    outputs = target_only(target, [[1, 2, 3], [9, 8, 7]], [SamplingParams(max_tokens=12), SamplingParams(max_tokens=6)])
    assert [running.output_ids, after.output_ids] == outputs


def test_prefill_chunk_must_be_positive() -> None:
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(prefill_chunk=0)


def test_a_prompt_admitted_while_nothing_runs_goes_in_large_chunks_and_the_next_in_small_ones() -> None:
    from specd.engine.engine import IDLE_PREFILL_CHUNK

    target = tiny_target()
    engine = Engine(target, None, EngineConfig(max_batch=2, prefill_chunk=5))
    very_long = (LONG * 6)[:IDLE_PREFILL_CHUNK + 40]
    alone = engine.add_request(very_long, SamplingParams(max_tokens=3))
    engine.step()
    assert engine.prefilling is not None and engine.prefilling.filled == IDLE_PREFILL_CHUNK
    engine.step()   # the rest of it, and its first token
    assert engine.prefilling is None and alone.num_output_tokens == 1
    while engine.has_work:
        engine.step()
    assert alone.output_ids == target_only(target, [very_long], [SamplingParams(max_tokens=3)])[0]
    first = engine.add_request(LONG, SamplingParams(max_tokens=30))
    second = engine.add_request(LONG, SamplingParams(max_tokens=4))
    engine.step()   # nothing was running: no stream to keep going, the first prompt in one pass
    assert first.num_output_tokens == 1   # and the step's budget of 5 is spent: the second waits
    assert engine.prefilling is None and list(engine.waiting) == [second]
    engine.step()
    assert engine.prefilling is not None and engine.prefilling.filled == 5   # beside a running stream: chunks
    while engine.has_work:
        engine.step()
    assert [first.output_ids, second.output_ids] == target_only(target, [LONG, LONG], [SamplingParams(max_tokens=30),
                                                                                       SamplingParams(max_tokens=4)])
