"""The feature drafter replayed on recorded trajectories: the accept length it reaches as served.

Contract: `simulated_counts(model, sequences, k, sampled)` drafts along each (tokens [T],
features [T, F], prompt_length) trajectory as the engine would, k drafts a target pass, and
returns the expected drafts, accepted drafts, passes and tokens (`ExpectedCounts`). Draft j + 1
after row length L is step j's output at entry L − 2 + j (entry e predicts token e + 2). Each
draft is accepted with a probability α, and a walk over pass starts (the probability that a pass
begins at each position, carried forward) turns the α into expectations:
- greedy trajectories (`sampled[i]` None): α is 1 where the drafter's argmax is the recorded
  token and 0 elsewhere, and the walk is exactly the engine's;
- sampled ones (`SampledRow`: the request's temperature and top-p, and the target's distribution
  at every position, over the draft vocabulary): the drafter serves a draw from its own q (the
  request's temperature and top-p applied to its logits, as `FeatureDrafter` does), which
  speculative sampling accepts with probability α = Σ_x min(p(x), q(x)), computed exactly per
  position rather than read off one recorded draw (the draft vocabulary's ids are distinct, as
  every drafter builds them). The chain after an accepted draft is replayed on the recorded
  token, one draw of the same distribution.
`walk_passes` is that walk alone, for a caller that computes its own α per step and entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.core.records import TrajectoryRecord
from specd.drafter.feature_model import FeatureDrafterModel
from specd.model.distributions import target_probs


@dataclass
class ExpectedCounts:
    """Expected drafts, accepted drafts, target passes and tokens emitted (sums of expectations)."""

    drafts: float = 0.0
    accepted: float = 0.0
    passes: float = 0.0
    emitted: float = 0.0

    @property
    def accept_length(self) -> float | None:
        """Tokens emitted per target pass, None before any pass."""
        return self.emitted / self.passes if self.passes else None


@dataclass(frozen=True)
class SampledRow:
    temperature: float
    top_p: float
    target_p: torch.Tensor   # [T - 1 - first_entry, N]: p at entries e >= first_entry (of token e + 2)
    first_entry: int = 0     # over the draft vocabulary; at most replay_start(prompt length)


def replayable(prompt_length: int, length: int) -> bool:
    """Whether a row of `length` tokens after a prompt of `prompt_length` holds a pass a replay can
    score: two prompt tokens and two output tokens at least (the first output token comes from the
    prefill, not from drafts). A shorter one says nothing about a drafter."""
    return prompt_length >= 2 and length - prompt_length >= 2


def record_replayable(record: TrajectoryRecord) -> bool:
    """`replayable` for a whole record (the gate's and the canary's filter)."""
    return replayable(len(record.prompt_ids), record.num_tokens)


def replay_start(prompt_length: int) -> int:
    """The first entry a replay reads: a pass begins at row length L >= prompt_length, and its
    first draft is entry L - 2's output; entries before it are prompt the walk never reaches."""
    return max(prompt_length - 2, 0)


@torch.no_grad()
def simulated_counts(model: FeatureDrafterModel, sequences: list[tuple[torch.Tensor, torch.Tensor, int]],
                     k: int, sampled: Sequence[SampledRow | None] | None = None) -> ExpectedCounts:
    counts = ExpectedCounts()
    device = model.head.weight.device
    for index, (tokens, features, prompt_length) in enumerate(sequences):
        tokens, features = tokens.to(device), features.to(device)
        length = len(tokens)
        if not replayable(prompt_length, length):
            continue
        start = replay_start(prompt_length)
        outputs = model.unrolled(features[None, :-1], tokens[None, 1:], k, start=start)
        row = sampled[index] if sampled is not None else None
        states = [state[0] for state in outputs]   # [T - 1 - start, hidden]: entries start..
        alphas = _greedy_acceptance(model, states, tokens, start) if row is None else [
            _sampled_acceptance(model, state, row, start) for state in states]
        walk_passes(alphas, prompt_length, length, k, counts)
    return counts


def _greedy_acceptance(model: FeatureDrafterModel, states: list[torch.Tensor],
                       tokens: torch.Tensor, start: int) -> list[list[float]]:
    """α per step and entry on a greedy trajectory: 1 where the argmax is the recorded token. Step
    j's output head (the costly part: the whole draft vocabulary) runs only at the entries a pass
    can reach, those where step j − 1 matched one entry before; elsewhere α stays 0, which the
    walk never reads (no pass gets that far). `states` begin at entry `start`."""
    entries = len(tokens) - 1
    reachable = torch.zeros(entries, dtype=torch.bool, device=tokens.device)
    reachable[start:-1] = True  # the last entry predicts past the record
    alphas = []
    for state in states:
        where = reachable.nonzero().squeeze(-1)
        matched = torch.zeros(entries, dtype=torch.bool, device=tokens.device)
        if len(where):
            predicted = model.draft_ids[model.logits(state[where - start]).argmax(-1)]
            matched[where] = predicted == tokens[where + 2]
        alphas.append(matched.float().tolist())
        reachable = torch.zeros_like(matched)
        reachable[1:-1] = matched[:-2]
    return alphas


def _sampled_acceptance(model: FeatureDrafterModel, state: torch.Tensor, row: SampledRow,
                        start: int) -> list[float]:
    """α at every entry for one drafting step (output states [T - 1 - start, hidden], entries
    start..) on a sampled trajectory; entries before `start` are never read and stay 0."""
    logits = model.logits(state).float()
    q = target_probs(logits[None], torch.tensor([row.temperature]), torch.tensor([row.top_p]))[0]
    target_p = row.target_p[start - row.first_entry:].to(q)
    return [0.0] * start + torch.minimum(target_p, q).sum(-1).tolist()


def walk_passes(alphas: list[list[float]], prompt_length: int, length: int, k: int, counts: ExpectedCounts) -> None:
    """Add one trajectory's expectations: start[L] is the probability that a pass begins at row length L."""
    start = [0.0] * (length + 1)
    start[prompt_length] = 1.0
    for row_length in range(prompt_length, length):
        reached = start[row_length]
        if reached == 0.0:
            continue
        drafts = min(k, length - row_length - 1)
        all_accepted, expected_run = 1.0, 0.0   # P(the first j drafts accepted), E[accepted drafts]
        for j in range(drafts):
            alpha = alphas[j][row_length - 2 + j]
            start[row_length + 1 + j] += reached * all_accepted * (1 - alpha)  # j accepted, then a miss
            all_accepted *= alpha
            expected_run += all_accepted
        start[row_length + 1 + drafts] += reached * all_accepted
        counts.passes += reached
        counts.drafts += reached * drafts
        counts.accepted += reached * expected_run
        counts.emitted += reached * (1 + expected_run)
