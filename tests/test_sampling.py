"""The verification rule: hand-built greedy cases, seeded determinism, and distribution tests."""

from __future__ import annotations

import torch

from specd.engine.verification import verify_greedy, verify_sampled
from specd.model.distributions import sample_from, target_probs


def one_hot_logits(rows: list[list[int]], vocab: int = 6) -> torch.Tensor:
    logits = torch.full((len(rows), len(rows[0]), vocab), -10.0)
    for b, row in enumerate(rows):
        for t, token in enumerate(row):
            logits[b, t, token] = 10.0
    return logits


def test_greedy_accepts_all_drafts_and_adds_bonus() -> None:
    logits = one_hot_logits([[1, 2, 3, 4]])
    verdict = verify_greedy(logits, torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.tokens[0, :4].tolist() == [1, 2, 3, 4]


def test_greedy_first_draft_rejected_emits_target_token() -> None:
    logits = one_hot_logits([[1, 2, 3, 4]])
    verdict = verify_greedy(logits, torch.tensor([[5, 2, 3]]), torch.tensor([3]))
    assert verdict.num_accepted.tolist() == [0]
    assert verdict.tokens[0, 0].item() == 1


def test_greedy_rows_accept_different_counts() -> None:
    logits = one_hot_logits([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 0], [1, 0, 0], [1, 2, 3]])
    verdict = verify_greedy(logits, drafts, torch.tensor([3, 3, 3]))
    assert verdict.num_accepted.tolist() == [2, 1, 3]


def test_limit_masks_drafts_past_the_budget() -> None:
    logits = one_hot_logits([[1, 2, 3, 4]])
    verdict = verify_greedy(logits, torch.tensor([[1, 2, 3]]), torch.tensor([1]))
    assert verdict.num_accepted.tolist() == [1]
    assert verdict.tokens[0, 1].item() == 2  # the target's own token at the limit


def test_top_p_keeps_the_nucleus_and_renormalises() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    probs = target_probs(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_sample_from_inverts_the_cdf() -> None:
    probs = torch.tensor([0.25, 0.25, 0.5])
    draws = sample_from(probs.expand(4, 3), torch.tensor([0.0, 0.3, 0.6, 0.999]))
    assert draws.tolist() == [0, 1, 2, 2]


# ---- distribution tests ------------------------------------------------------------------
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],    # target at position 1
                  [0.05, 0.10, 0.20, 0.30, 0.15, 0.20],    # target at position 2
                  [0.30, 0.10, 0.10, 0.10, 0.20, 0.20]])   # target at position 3 (bonus)
Q = torch.tensor([[0.10, 0.10, 0.50, 0.10, 0.10, 0.10],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
DRAWS = 200_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    statistic = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(probs) - 1, dtype=torch.float64)
    return float(1 - torch.special.gammainc(dof / 2, statistic / 2))


def run_rule(q_for_residual: torch.Tensor = Q, always_accept: bool = False, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    p = P.expand(DRAWS, -1, -1)
    drafts = torch.stack([sample_from(Q[i].expand(DRAWS, -1), torch.rand(DRAWS, generator=generator))
                          for i in range(2)], dim=1)
    accept_u = torch.zeros(DRAWS, 2) if always_accept else torch.rand(DRAWS, 2, generator=generator)
    # q_for_residual differs from Q only to plant a bug: Q's draft probabilities, wrong residual
    q = q_for_residual.expand(DRAWS, -1, -1).clone()
    q.scatter_(-1, drafts[..., None], Q.expand(DRAWS, -1, -1).gather(-1, drafts[..., None]))
    return verify_sampled(p, q, drafts, torch.full((DRAWS,), 2), accept_u, torch.rand(DRAWS, generator=generator))


def emitted_counts(verdict, position: int) -> torch.Tensor:
    reached = verdict.num_accepted >= position  # position i is emitted when i drafts passed before it
    return torch.bincount(verdict.tokens[reached, position], minlength=P.shape[1])


def test_rejection_sampling_reproduces_target_distribution_at_every_position() -> None:
    verdict = run_rule()
    for position in range(3):
        assert chi_square_p_value(emitted_counts(verdict, position), P[position]) > 1e-3, position


def test_rejection_sampling_is_deterministic_for_a_seed() -> None:
    a, b = run_rule(seed=7), run_rule(seed=7)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_distribution_test_catches_accepting_every_draft() -> None:
    verdict = run_rule(always_accept=True)
    assert chi_square_p_value(emitted_counts(verdict, 0), P[0]) < 1e-6


def test_distribution_test_catches_a_wrong_residual() -> None:
    # a plausible bug: resampling from max(p - onehot(draft), 0) instead of max(p - q, 0)
    verdict = run_rule(q_for_residual=torch.zeros_like(Q))
    assert chi_square_p_value(emitted_counts(verdict, 0), P[0]) < 1e-6
