"""Self-distilled training data and the pretraining data ranges.

The distillation stage answers training prompts with the target's own greedy continuations
exactly (what target-only decoding emits), records features equal to a fresh capture, makes the
same sampled answers again for the same settings, and resumes an interrupted run without
duplicating or losing a prompt. Offline training never reads a conversation outside its range.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import specd.core.traffic as traffic
import specd.offline.distill as distill_module
from specd.core.errors import ConfigurationError
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams
from specd.offline.corpus import first_user_turns
from specd.offline.distill import DistillConfig, distill, iter_training_prompts, prompt_params
from specd.testing import tiny_loaded_target

CAPTURE = (0, 1)
SMALL = DistillConfig(prompts=7, max_prompt=160, max_new_tokens=10, sampled_every=3, batch=3, shard_size=3,
                      dtype="float32")


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded_target()


@pytest.fixture(scope="module")
def prompts(loaded):
    return list(iter_training_prompts(loaded, SMALL.max_prompt, 2, limit=SMALL.prompts))


def key(examples) -> list[tuple[int, list[int], float]]:
    return [(e.conversation, e.tokens.tolist(), e.temperature) for e in examples]


def test_greedy_responses_are_the_targets_own_and_features_equal_a_fresh_capture(loaded, prompts, tmp_path) -> None:
    examples = distill(loaded, SMALL, CAPTURE, tmp_path, prompts)
    assert len(examples) == len(prompts) == SMALL.prompts
    greedy = [e for e in examples if e.temperature == 0]
    assert len(greedy) == 5 and len(examples) - len(greedy) == 2  # every 3rd sampled
    alone = Engine(loaded.model, None, EngineConfig(max_batch=1, eos_token_ids=loaded.eos_token_ids))
    for prompt, example in zip(prompts, examples, strict=True):
        assert example.tokens[:example.prompt_length].tolist() == prompt.ids
        fresh = loaded.model.train_features(example.tokens[None], CAPTURE)[0, :-1]
        assert example.features.shape == fresh.shape and example.features.dtype == torch.float16
        torch.testing.assert_close(example.features.float(), fresh.float(), atol=2e-3, rtol=2e-3)
        if example.temperature == 0:
            [seq] = alone.generate([prompt.ids], SamplingParams(max_tokens=SMALL.max_new_tokens))
            assert example.tokens[example.prompt_length:].tolist() == seq.output_ids


def test_sampled_responses_are_remade_identically_from_their_seeds(loaded, prompts, tmp_path) -> None:
    first = distill(loaded, SMALL, CAPTURE, tmp_path / "a", prompts)
    second = distill(loaded, SMALL, CAPTURE, tmp_path / "b", prompts)
    assert key(first) == key(second)
    assert prompt_params(SMALL, 2).temperature == SMALL.temperature and prompt_params(SMALL, 1).is_greedy


def test_an_interrupted_generation_resumes_without_duplicating_or_losing_a_prompt(loaded, prompts, tmp_path,
                                                                                   monkeypatch) -> None:
    whole = distill(loaded, SMALL, CAPTURE, tmp_path / "whole", prompts)
    real = distill_module.generate_examples
    calls: list[int] = []

    def dies_on_the_second_shard(*args: Any, **kwargs: Any):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt  # a stop mid-run
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_module, "generate_examples", dies_on_the_second_shard)
    work = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        distill(loaded, SMALL, CAPTURE, work, prompts)
    assert sorted(p.name for p in work.glob("distilled-*")) == ["distilled-0000.safetensors"]
    calls.clear()
    monkeypatch.setattr(distill_module, "generate_examples", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    resumed = distill(loaded, SMALL, CAPTURE, work, prompts)
    assert calls == [3, 6]  # only the shards not yet written
    assert key(resumed) == key(whole)


def test_a_work_folder_made_with_other_settings_is_refused(loaded, prompts, tmp_path) -> None:
    distill(loaded, SMALL, CAPTURE, tmp_path, prompts[:3])
    with pytest.raises(ConfigurationError, match="other settings"):
        distill(loaded, DistillConfig(**{**SMALL.__dict__, "temperature": 1.0}), CAPTURE, tmp_path, prompts[:3])



def test_more_rounds_continue_a_folder_with_new_sampled_answers_to_the_same_prompts(loaded, prompts,
                                                                                     tmp_path, monkeypatch) -> None:
    one = distill(loaded, SMALL, CAPTURE, tmp_path, prompts)
    real = distill_module.generate_examples
    rounds_made: list[int] = []
    monkeypatch.setattr(distill_module, "generate_examples",
                        lambda *a, **k: rounds_made.append(a[5]) or real(*a, **k))
    two = distill(loaded, DistillConfig(**{**SMALL.__dict__, "rounds": 2}), CAPTURE, tmp_path, prompts)
    assert rounds_made == [1, 1, 1]  # round 0's shards were read back, not remade
    assert key(two[:len(one)]) == key(one)
    again = two[len(one):]
    assert [e.conversation for e in again] == [e.conversation for e in one]
    assert all(e.temperature == pytest.approx(SMALL.temperature) for e in again)
    for first, second in zip(one, again, strict=True):
        assert second.tokens[:second.prompt_length].tolist() == first.tokens[:first.prompt_length].tolist()
    assert any(a.tokens.tolist() != b.tokens.tolist() for a, b in zip(one, again, strict=True))
    assert len(list(tmp_path.glob("distilled-*.safetensors"))) == 6  # every round has shards of its own
    with pytest.raises(ValueError, match="temperature"):
        DistillConfig(rounds=2, temperature=0.0)


def test_a_continuations_data_is_new_sampled_answers_to_a_seeded_draw_of_the_prompts(loaded, prompts, tmp_path,
                                                                                      monkeypatch) -> None:
    real = distill_module.generate_examples
    rounds_made: list[int] = []
    monkeypatch.setattr(distill_module, "generate_examples",
                        lambda *a, **k: rounds_made.append(a[5]) or real(*a, **k))
    config = DistillConfig(**{**SMALL.__dict__, "rounds": 2, "first_round": 1, "sample": 4})
    examples = distill(loaded, config, CAPTURE, tmp_path, prompts)
    assert rounds_made == [1, 1]  # round 0 is neither made nor read: 4 prompts, 3 a shard
    assert len(examples) == 4 and all(e.temperature == pytest.approx(SMALL.temperature) for e in examples)
    drawn = [next(i for i, p in enumerate(prompts) if p.ids == e.tokens[:e.prompt_length].tolist()) for e in examples]
    assert drawn == sorted(set(drawn)) and drawn != [0, 1, 2, 3]  # a draw kept in file order, not the first ones
    assert key(distill(loaded, config, CAPTURE, tmp_path / "again", prompts)) == key(examples)  # the same draw
    for bad in ({"first_round": 2}, {"sample": 0}):
        with pytest.raises(ValueError, match="first_round"):
            DistillConfig(**{**SMALL.__dict__, "rounds": 2, **bad})

# ---- the data ranges -------------------------------------------------------------------------------

def fake_file(count: int):
    """ShareGPT-shaped records whose text names their index in the file."""
    def records(path=None):
        for index in range(count):
            yield {"conversations": [{"from": "human", "value": f"conversation {index} asks"},
                                     {"from": "gpt", "value": f"conversation {index} answers"}]}
    return records


def index_of(messages: list[dict[str, str]]) -> int:
    return int(messages[0]["content"].split()[1])


def test_the_ranges_split_the_file_without_overlap() -> None:
    assert range(6000, 9500) == traffic.PRETRAINING_RANGE
    assert traffic.TRAINING_RANGE.stop == traffic.VALIDATION_RANGE.start
    assert traffic.VALIDATION_RANGE.stop == traffic.EVALUATION_START == 9500
    assert traffic.TRAINING_RANGE.start == traffic.EVALUATION_RESERVE == 6000


def test_offline_training_never_reads_a_conversation_outside_its_range(monkeypatch, loaded) -> None:
    monkeypatch.setattr(traffic, "iter_sharegpt", fake_file(12_000))
    seen = [index_of(m) for m in traffic.iter_training_conversations()]
    assert seen == list(traffic.TRAINING_RANGE)
    prompts = list(iter_training_prompts(loaded, 400, 2))
    assert {p.conversation for p in prompts} == set(traffic.TRAINING_RANGE)
    assert all(str(p.conversation) in loaded.tokenizer.decode(p.ids) for p in prompts)
    for outside in (range(5990, 6010), range(9490, 9510), range(0, 100), range(9500, 12000)):
        with pytest.raises(ConfigurationError, match="6000-9499 only"):
            next(traffic.iter_training_conversations(outside))


def long_conversations(count: int, exchanges: int, words: int):
    """ShareGPT-shaped records of `exchanges` exchanges, each message `words` words naming its turn."""
    def records(path=None):
        for index in range(count):
            yield {"conversations": [{"from": "human" if m % 2 == 0 else "gpt",
                                      "value": f"conversation {index} turn {m} " + "word " * words}
                                     for m in range(2 * exchanges)]}
    return records


def test_later_turns_follow_the_first_ones_with_their_context_cut_to_fit(monkeypatch, loaded) -> None:
    monkeypatch.setattr(traffic, "iter_sharegpt", long_conversations(12_000, exchanges=4, words=12))
    span = range(6000, 6010)
    one_turn = [{"role": "user", "content": "conversation 6000 turn 0 " + "word " * 12}]
    one_exchange = len(loaded.encode_messages(one_turn))
    max_prompt = 3 * one_exchange  # the first two turns fit whole; the third and fourth only cut
    first = list(iter_training_prompts(loaded, max_prompt, 2, span=span))
    every = list(iter_training_prompts(loaded, max_prompt, 2, span=span, later_turns=True))
    assert every[:len(first)] == first and len(first) == 2 * len(span)
    later = every[len(first):]
    assert len(later) == 2 * len(span) and [p.conversation for p in later] == sorted(p.conversation for p in later)
    for prompt in later:
        text = loaded.tokenizer.decode(prompt.ids)
        assert len(prompt.ids) <= max_prompt and "turn 0 " not in text  # the earliest exchange dropped
        assert text.count(f"conversation {prompt.conversation} turn") >= 2  # yet some context kept
    assert {loaded.tokenizer.decode(p.ids).rsplit("turn ", 1)[1][0] for p in later} == {"4", "6"}


def test_held_out_prompts_come_from_their_own_spans(monkeypatch) -> None:
    monkeypatch.setattr(traffic, "iter_sharegpt", fake_file(12_000))
    validation = [int(t.split()[1]) for t in first_user_turns(traffic.VALIDATION_RANGE, 500)]
    evaluation = [int(t.split()[1]) for t in first_user_turns(range(traffic.EVALUATION_START, 10**9), 50)]
    assert validation == list(traffic.VALIDATION_RANGE)
    assert evaluation == list(range(9500, 9550))


def test_every_real_training_prompt_is_from_the_training_range(loaded) -> None:
    found = list(iter_training_prompts(loaded, 200, 2, limit=20))
    assert len(found) == 20 and all(p.conversation in traffic.TRAINING_RANGE for p in found)
    assert found == sorted(found, key=lambda p: p.conversation)


def test_distilled_examples_remember_their_conversation(loaded, prompts, tmp_path) -> None:
    examples = distill(loaded, SMALL, CAPTURE, tmp_path, prompts)
    assert [e.conversation for e in examples] == [p.conversation for p in prompts]
    assert all(isinstance(e.prompt_length, int) and e.prompt_length == len(p.ids)
               for e, p in zip(examples, prompts, strict=True))


def test_shards_are_written_whole(loaded, prompts, tmp_path: Path) -> None:
    distill(loaded, SMALL, CAPTURE, tmp_path, prompts)
    assert not list(tmp_path.glob("*.partial"))
    assert len(list(tmp_path.glob("distilled-*.safetensors"))) == 3
