"""Context matching and the hybrid drafter: what they propose, and that the engine stays lossless."""

from __future__ import annotations

import pytest
from conftest import fixed_k, tiny_drafter, tiny_target

from specd.drafter.context_match import context_match, context_match_drafts
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, record_from_sequence


def test_longest_recent_suffix_match_proposes_what_followed() -> None:
    assert context_match_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2) == [7, 5]  # most recent occurrence
    assert context_match_drafts([4, 5, 6, 4, 5], k=3) == [6, 4, 5]
    assert context_match_drafts([1, 2, 3, 4], k=3) == []  # nothing repeats
    assert context_match_drafts([8, 9, 8, 9], k=5, min_n=2) == [8, 9]  # what followed, up to the end
    assert context_match([7, 1, 2, 3, 9, 5, 1, 2, 3], k=1) == ([9], 3)  # and how long the match was


@pytest.mark.parametrize("k", [1, 4, 8])
def test_hybrid_drafter_is_lossless_and_uses_matches(k: int) -> None:
    target = tiny_target()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], [9, 9, 9, 9], [20, 21, 22, 20, 21]]
    params = SamplingParams(max_tokens=40)
    expected = [s.output_ids for s in Engine(target, None, EngineConfig(max_batch=4)).generate(prompts, params)]
    drafter = HybridDrafter(tiny_drafter(target))
    seqs = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=k)).generate(prompts, params)
    assert [s.output_ids for s in seqs] == expected
    assert drafter.num_matched_rows > 0


def test_hybrid_drafter_sampling_is_reproducible_for_a_seed() -> None:
    target = tiny_target()
    drafter = HybridDrafter(tiny_drafter(target))
    params = SamplingParams(temperature=0.9, max_tokens=30, seed=4)
    engine = Engine(target, drafter, fixed_k(max_batch=2, num_draft_tokens=3))
    runs = [[s.output_ids for s in engine.generate([[5, 6, 5, 6, 5], [7, 8, 7, 8]], params)] for _ in range(2)]
    assert runs[0] == runs[1]  # reproducible for a seed, with matched and learned rows mixed


def test_the_engines_records_name_who_drafted_each_step() -> None:
    target = tiny_target()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3]]
    drafter = HybridDrafter(tiny_drafter(target))
    seqs = Engine(target, drafter, fixed_k(max_batch=2, num_draft_tokens=4)).generate(
        prompts, SamplingParams(max_tokens=24))
    sources = {step.source for seq in seqs for step in record_from_sequence(seq, "test", 0.0).steps}
    assert any(s.startswith("context") for s in sources), sources
    assert sources <= {"learned", "none"} | {f"context{n}" for n in range(2, 5)}, sources
