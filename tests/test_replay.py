"""The gate's replay of a feature drafter: sampled drafts accepted with probability Σ min(p, q).

The drafter is fixed and tiny; the target's distribution at every entry is planted in a
`SampledRow`, so the acceptance the replay must find is known exactly.
"""

from __future__ import annotations

import pytest
import torch

from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.learner.simulation import SampledRow, replay_start, simulated_counts
from specd.model.distributions import target_probs
from specd.testing import learnable_target

VOCAB = 32
LENGTH = 24
PROMPT = 4


def drafter_and_sequence(num_layers: int = 1) -> tuple[FeatureDrafterModel, tuple[torch.Tensor, torch.Tensor, int]]:
    target = learnable_target(VOCAB).float()
    model = new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                                torch.arange(VOCAB), seed=0, num_layers=num_layers).eval()
    tokens = torch.randint(0, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(1))
    features = target.train_features(tokens[None], model.config.capture_layers)[0].detach()
    return model, (tokens, features, PROMPT)


def first_step_q(model: FeatureDrafterModel, sequence: tuple[torch.Tensor, torch.Tensor, int], top_p: float,
                 temperature: float = 1.0) -> torch.Tensor:
    """The drafter's own first-draft distribution at every entry, as it serves it: [T - 1, N]."""
    tokens, features, _ = sequence
    with torch.no_grad():
        [state] = model.unrolled(features[None, :-1], tokens[None, 1:], 1)
        logits = model.logits(state)
    return target_probs(logits, torch.tensor([temperature]), torch.tensor([top_p]))[0]


def replay(model: FeatureDrafterModel, sequence: tuple[torch.Tensor, torch.Tensor, int], target_p: torch.Tensor,
           top_p: float = 1.0) -> tuple[float, float]:
    counts = simulated_counts(model, [sequence], 1, [SampledRow(1.0, top_p, target_p)])
    return counts.accepted, counts.drafts


def test_a_target_equal_to_the_drafters_q_accepts_every_sampled_draft() -> None:
    model, sequence = drafter_and_sequence()
    accepted, drafts = replay(model, sequence, first_step_q(model, sequence, top_p=1.0))
    assert drafts > 0 and accepted == pytest.approx(drafts)


def test_a_target_outside_the_drafters_support_accepts_none() -> None:
    model, sequence = drafter_and_sequence()
    q = first_step_q(model, sequence, top_p=1e-6)  # the nucleus keeps one token: q is one-hot
    elsewhere = torch.roll(q, shifts=1, dims=-1)   # all the target's mass on another token
    accepted, drafts = replay(model, sequence, elsewhere, top_p=1e-6)
    assert drafts > 0 and accepted == 0.0


def test_half_the_mass_on_the_draft_accepts_half_of_them_in_expectation() -> None:
    model, sequence = drafter_and_sequence()
    q = first_step_q(model, sequence, top_p=1e-6)
    half = 0.5 * q + 0.5 * torch.roll(q, shifts=1, dims=-1)  # min(p, q) sums to 0.5 at every entry
    accepted, drafts = replay(model, sequence, half, top_p=1e-6)
    assert accepted == pytest.approx(0.5 * drafts)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_unrolled_from_a_later_start_equals_the_whole_sequences_outputs(num_layers: int) -> None:
    model, (tokens, features, _) = drafter_and_sequence(num_layers)
    with torch.no_grad():
        whole = model.unrolled(features[None, :-1], tokens[None, 1:], 4)
        for start in (1, 5, 11):
            later = model.unrolled(features[None, :-1], tokens[None, 1:], 4, start=start)
            for j, (full_step, late_step) in enumerate(zip(whole, later, strict=True)):
                assert late_step.shape[1] == LENGTH - 1 - start
                # step j at t reads step j - 1 at t - 1: equal wherever the chain began at or after start
                torch.testing.assert_close(late_step[0, j:], full_step[0, start + j:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt", [2, 9])
def test_a_sampled_row_from_the_first_read_entry_replays_as_the_whole_row(prompt: int) -> None:
    model, (tokens, features, _) = drafter_and_sequence()
    sequence = (tokens, features, prompt)
    half = 0.5 * first_step_q(model, sequence, top_p=1.0) + 0.5 / VOCAB
    first = replay_start(prompt)
    whole = simulated_counts(model, [sequence], 3, [SampledRow(1.0, 1.0, half)])
    cut = simulated_counts(model, [sequence], 3, [SampledRow(1.0, 1.0, half[first:], first)])
    assert whole.drafts > 0 and cut.accepted == pytest.approx(whole.accepted)
    assert cut.passes == pytest.approx(whole.passes)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_chain_longer_than_the_record_replays_as_one_the_record_can_hold(num_layers: int) -> None:
    # a short answer replayed at a large k (the demo's -k 12 on 4-token answers crashed here): the
    # steps past the record's end are never read, so any k from the record's length on is the same
    model, (tokens, features, _) = drafter_and_sequence(num_layers)
    short = (tokens[:8], features[:8], 5)
    reach = simulated_counts(model, [short], 7)
    for k in (8, 12, 40):
        longer = simulated_counts(model, [short], k)
        assert (longer.accepted, longer.drafts, longer.passes) == pytest.approx(
            (reach.accepted, reach.drafts, reach.passes))
    with torch.no_grad():   # training unrolls the same way (pretrain --unroll 100 crashed)
        assert len(model.unrolled(features[None, :7], tokens[None, 1:8], 40)) == 40
