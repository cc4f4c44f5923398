"""The embedded default target, SmolLM2-135M-Instruct (converted from the bundled GGUF), in float32."""

from __future__ import annotations

import pytest
import torch
from conftest import always_right_counts, fixed_k

from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine, EngineConfig
from specd.engine.greedy_recording import record_greedy
from specd.engine.request import SamplingParams
from specd.model.target import LoadedTarget

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "Write a haiku about autumn leaves.",
         "Explain recursion to a child in two sentences."]
PARAMS = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def smollm2() -> LoadedTarget:
    return LoadedTarget.load(None)


@pytest.fixture(scope="module")
def prompts(smollm2: LoadedTarget) -> list[list[int]]:
    return [smollm2.encode(c, chat=True) for c in CHATS]


@pytest.fixture(scope="module")
def target_only(smollm2: LoadedTarget, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(smollm2.model, None, EngineConfig(max_batch=3, eos_token_ids=smollm2.eos_token_ids))
    return [s.output_ids for s in engine.generate(prompts, PARAMS)]


def test_target_only_matches_transformers_generate(smollm2, prompts, target_only) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(smollm2.folder), dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, target_only, strict=True):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False)
        assert out[0, len(prompt):].tolist() == ours


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_lossless_with_random_drafter(smollm2, prompts, target_only, k: int) -> None:
    drafter = TokenDrafter(new_drafter_model(smollm2.model, DrafterShape.like(smollm2.model.config)))
    engine = Engine(smollm2.model, drafter, fixed_k(max_batch=3, num_draft_tokens=k,
                                                         eos_token_ids=smollm2.eos_token_ids))
    assert [s.output_ids for s in engine.generate(prompts, PARAMS)] == target_only


def test_greedy_lossless_with_replay_drafter(smollm2, prompts, target_only) -> None:
    drafter = record_greedy(smollm2.model, prompts, PARAMS.max_tokens, smollm2.eos_token_ids)
    engine = Engine(smollm2.model, drafter, fixed_k(max_batch=3, num_draft_tokens=4,
                                                         eos_token_ids=smollm2.eos_token_ids))
    seqs = engine.generate(prompts, PARAMS)
    assert [s.output_ids for s in seqs] == target_only
    # in float32 every replayed draft is the target's own token: all accepted, but for drafts past an EOS
    for seq in seqs:
        stopped_early = seq.num_output_tokens < PARAMS.max_tokens
        assert seq.finish_reason == ("stop" if stopped_early else "length")
        assert (seq.num_target_passes, seq.num_drafts_proposed, seq.num_drafts_accepted) == always_right_counts(
            seq.num_output_tokens, PARAMS.max_tokens, 4)
