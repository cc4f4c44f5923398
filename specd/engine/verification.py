"""Sampling and speculative verification as pure tensor functions.

Contract: every function here is stateless; randomness comes in as uniforms drawn by the caller
from per-request generators, so a request's sample path depends only on its own seed and drafts.
The distributions themselves (`target_probs`, `sample_from`) live in `specd.model.distributions`,
where drafters that sample read them too.

Speculative verification (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023): for row b
with drafts x_1..x_k proposed from q, the target gives p_1..p_{k+1}. Draft i is accepted with
probability min(1, p_i(x_i) / q_i(x_i)); the first rejected position m emits a *recovered* token
drawn from norm(max(p_m - q_m, 0)); when all drafts pass, a *bonus* token is drawn from p_{k+1}.
The emitted tokens are then distributed exactly as if drawn from the target alone. Greedy rows
(temperature 0) accept a draft iff it equals the target's argmax and emit the argmax, which is
the same rule with one-hot p. A per-row draft limit masks drafts past it as "not proposed": the
token at the limit is then drawn from p itself, as an ordinary target step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specd.model.distributions import sample_from


@dataclass
class Verdict:
    """Result of verifying one speculative step for a batch."""

    num_accepted: torch.Tensor  # [B] drafts accepted per row, 0..limit
    tokens: torch.Tensor        # [B, k+1] row b emits tokens[b, :num_accepted[b] + 1]


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor) -> Verdict:
    """Greedy acceptance. logits: [B, k+1, V]; drafts: [B, k]; limit: [B] drafts that may count."""
    k = drafts.shape[1]
    argmax = logits.argmax(-1)  # [B, k+1]
    allowed = torch.arange(k, device=drafts.device)[None] < limit[:, None]
    matches = (drafts == argmax[:, :k]) & allowed
    num_accepted = matches.long().cumprod(-1).sum(-1)
    # accepted drafts equal the argmax, so the argmax row is already the emitted sequence
    return Verdict(num_accepted, argmax)


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, limit: torch.Tensor,
                   accept_uniforms: torch.Tensor, resample_uniforms: torch.Tensor) -> Verdict:
    """Exact rejection sampling.

    p: [B, k+1, V] target probabilities; q: [B, k, V] the draft distributions the drafts came from;
    drafts: [B, k]; limit: [B]; accept_uniforms: [B, k]; resample_uniforms: [B].
    """
    batch, k = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # [B, k]
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    # u < p/q without dividing (q(x) > 0 for a draft actually drawn from q)
    accepted = accept_uniforms * q_draft < p_draft
    allowed = torch.arange(k, device=drafts.device)[None] < limit[:, None]
    num_accepted = (accepted & allowed).long().cumprod(-1).sum(-1)  # [B]
    # the emitted last token: recovered from max(p - q, 0) at a tested rejection, else from p
    p_last = p[rows, num_accepted]  # [B, V]
    was_rejected = num_accepted < limit
    q_last = q[rows, num_accepted.clamp(max=k - 1)] if k > 0 else torch.zeros_like(p_last)
    residual = (p_last - q_last).clamp_(min=0)
    # p == q leaves no residual mass, and then rejection has probability 0: fall back to p
    has_mass = residual.sum(-1) > 0
    use_residual = (was_rejected & has_mass)[:, None]
    last = sample_from(torch.where(use_residual, residual, p_last), resample_uniforms)
    tokens = torch.zeros(batch, k + 1, dtype=drafts.dtype, device=drafts.device)
    tokens[:, :k] = drafts
    tokens[rows, num_accepted] = last
    return Verdict(num_accepted, tokens)
