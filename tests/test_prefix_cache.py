"""Shared prefixes: a chat template's opening is prefilled once and copied into later prompts'
slots, with the same cache entries and features as computing it, and greedy output unchanged."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_k, tiny_target
from test_chunked_prefill import DRAFTERS, feature_drafter, target_only

from specd.engine.engine import Engine
from specd.engine.prefill import InProgress, run_chunk
from specd.engine.prefix_cache import PrefixCache
from specd.engine.request import SamplingParams, Sequence
from specd.testing import tiny_loaded_target

OPENING = (1, 17, 23, 5, 9, 40, 2)   # a system prompt every chat request starts with
PROMPTS = [[*OPENING, 11, 12, 13], [*OPENING, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70], [4, 5, 6],
           [*OPENING, 30], list(OPENING), [*OPENING, 11, 12, 13]]
PARAMS = [SamplingParams(max_tokens=n) for n in (12, 20, 9, 15, 6, 8)]


def serve(engine: Engine, prompts=PROMPTS, params=PARAMS) -> list[Sequence]:
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while engine.has_work:
        engine.step()
    return seqs


@pytest.mark.parametrize("chunk", [3, 48])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_greedy_output_equals_the_target_alone_with_a_shared_prefix(drafter: str, chunk: int) -> None:
    target = tiny_target()
    engine = Engine(target, DRAFTERS[drafter](target), fixed_k(max_batch=2, num_draft_tokens=3, prefill_chunk=chunk,
                                                               shared_prefixes=(OPENING,)))
    seqs = serve(engine)
    assert [s.output_ids for s in seqs] == target_only(target, PROMPTS, PARAMS)
    # the opening is computed for the first prompt that has it and copied for the next three; the
    # prompt that is the opening alone has too few positions to fill to take it
    assert (engine.prefixes.computed, engine.prefixes.copied) == (1, 3)


def test_a_copied_prefix_holds_the_same_keys_values_and_features_as_a_computed_one() -> None:
    target = tiny_target()
    engine = Engine(target, feature_drafter(target), fixed_k(max_batch=1, num_draft_tokens=2, record_features=True,
                                                              shared_prefixes=(OPENING,)))
    prompt = [*OPENING, 11, 12, 13]
    computed, copied = serve(engine, [prompt, prompt], [SamplingParams(max_tokens=5)] * 2)
    assert (engine.prefixes.computed, engine.prefixes.copied) == (1, 1)
    assert torch.equal(torch.cat(computed.feature_chunks), torch.cat(copied.feature_chunks))
    assert computed.output_ids == copied.output_ids
    n = len(OPENING)
    kept = engine.prefixes.kept[OPENING]
    assert torch.equal(engine.cache.k[:, 0, :, :n], kept.keys) and torch.equal(engine.cache.v[:, 0, :, :n], kept.values)


def test_a_copied_prefix_runs_no_target_pass_and_the_rest_of_the_prompt_starts_after_it() -> None:
    target = tiny_target()
    prefixes = PrefixCache([OPENING, OPENING[:3]])
    engine = Engine(target, None, fixed_k(max_batch=1))
    prompt = [*OPENING, 11, 12, 13]
    first, second = InProgress(Sequence("a", prompt, SamplingParams()), 0), InProgress(Sequence("b", prompt,
                                                                                              SamplingParams()), 0)
    engine.tokens[0, :len(prompt)] = torch.tensor(prompt)
    assert prefixes.prefix_of(prompt, first.to_fill) == OPENING   # the longest that fits
    assert run_chunk(target, engine.cache, engine.tokens, first, None, (), prefixes) == len(OPENING)
    assert run_chunk(target, engine.cache, engine.tokens, second, None, (), prefixes) == 0
    assert first.filled == second.filled == len(OPENING)
    assert prefixes.prefix_of(list(OPENING), len(OPENING) - 1) == OPENING[:3]   # the whole opening does not fit


def test_a_drafter_reading_other_layers_gets_the_prefix_computed_again_with_its_features() -> None:
    target = tiny_target()
    prefixes = PrefixCache([OPENING])
    engine = Engine(target, None, fixed_k(max_batch=1))
    prompt = [*OPENING, 11]
    engine.tokens[0, :len(prompt)] = torch.tensor(prompt)
    for capture, computes in (((0,), 1), ((0,), 0), ((1,), 1), ((0,), 0)):
        part = InProgress(Sequence("r", prompt, SamplingParams()), 0)
        used = run_chunk(target, engine.cache, engine.tokens, part, None, capture, prefixes)
        assert (used > 0) == bool(computes) and part.captured == {capture} and part.features[0].shape[0] == len(OPENING)
    assert set(prefixes.kept[OPENING].features) == {(0,), (1,)}


def test_a_chat_targets_shared_prefix_is_its_templates_opening() -> None:
    loaded = tiny_loaded_target()
    (opening,) = loaded.shared_prefixes()
    assert loaded.encode("anything at all", chat=True)[:len(opening)] == list(opening)
    assert loaded.tokenizer.decode(list(opening[1:])) == "user: "

    class NoTemplate:
        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("this tokenizer has no chat template")

    loaded.tokenizer = NoTemplate()
    assert loaded.shared_prefixes() == ()
