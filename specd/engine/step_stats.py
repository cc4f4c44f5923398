"""A decoding step's verdict applied to its requests, and the step's counts.

Contract: `emit_verdict` appends each running row's accepted drafts and its next token to the
request (cut at its token budget and at an end-of-sequence token, which finish it), writes them
into the engine's token buffer, records the step on the request (drafts, accepted, version,
source) and returns the step's `StepStats`: counts over every row and, per drafting source kind
(`source_kind`), the learned drafter's own apart, which is what the lookahead controller's
acceptance follows, and each drafted row's outcome, which its reaches follow. `feed_lookahead`
hands a step's acceptance and costs to the lookahead controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specd.core.records import LEARNED_SOURCE, AcceptanceCounts, source_kind
from specd.engine.lookahead import LookaheadController
from specd.engine.request import Sequence
from specd.engine.verification import Verdict


@dataclass
class StepStats:
    """One decoding step of the whole batch."""

    num_rows: int
    num_drafts_proposed: int
    num_drafts_accepted: int
    num_tokens_emitted: int
    seconds: float
    drafter_version: int | None   # None: no drafter ran
    k: int = 0
    # rows whose drafts were not all accepted: each chain ended in one rejected draft
    num_rejections: int = 0
    # each row that had drafts: (source kind, drafts, drafts accepted), what the lookahead
    # controller follows (the learned drafter's rejections, each continuation kind's chain)
    row_outcomes: list[tuple[str, int, int]] = field(default_factory=list)
    # the same counts per drafting source kind (`source_kind`): the learned drafter's own apart
    by_source: dict[str, AcceptanceCounts] = field(default_factory=dict)

    @property
    def counts(self) -> AcceptanceCounts:
        """The step's drafts, accepted drafts, passes (one per row) and tokens, as reports count them."""
        return AcceptanceCounts(self.num_drafts_proposed, self.num_drafts_accepted, self.num_rows,
                                self.num_tokens_emitted)


def emit_verdict(running: list[Sequence], tokens: torch.Tensor, verdict: Verdict, drafts: torch.Tensor,
                 limit: torch.Tensor, lengths: torch.Tensor, version: int | None, sources: list[str] | None,
                 eos: set[int]) -> StepStats:
    """Apply `verdict` to the `running` requests (slot = index) and their rows of `tokens`;
    `sources` names who drafted each row (None: the learned drafter drafted every row)."""
    stats = StepStats(len(running), 0, 0, 0, 0.0, version)
    if sources is None or len(sources) != len(running):
        sources = [LEARNED_SOURCE] * len(running)
    for slot, (seq, accepted, row_tokens, row_drafts, row_limit, length) in enumerate(zip(
            running, verdict.num_accepted.tolist(), verdict.tokens.tolist(), drafts.tolist(),
            limit.tolist(), lengths.tolist(), strict=True)):
        emitted = row_tokens[:accepted + 1]
        budget = seq.params.max_tokens - seq.num_output_tokens
        emitted = emitted[:budget]
        if not seq.params.ignore_eos:
            stop_at = next((i for i, t in enumerate(emitted) if t in eos), None)
            if stop_at is not None:
                emitted = emitted[:stop_at + 1]
                seq.finish_reason = "stop"
        if seq.finish_reason is None and seq.num_output_tokens + len(emitted) >= seq.params.max_tokens:
            seq.finish_reason = "length"
        tokens[slot, length:length + len(emitted)] = torch.tensor(emitted, device=tokens.device)
        seq.output_ids.extend(emitted)
        drafts_kept = min(accepted, len(emitted))
        kind = source_kind(sources[slot], row_limit)
        seq.record_step(length, row_drafts[:row_limit], accepted, drafts_kept, version, sources[slot])
        stats.num_drafts_proposed += row_limit
        stats.num_drafts_accepted += drafts_kept
        stats.num_rejections += accepted < row_limit
        if row_limit:
            stats.row_outcomes.append((kind, row_limit, min(accepted, row_limit)))
        stats.num_tokens_emitted += len(emitted)
        stats.by_source.setdefault(kind, AcceptanceCounts()).add(AcceptanceCounts(row_limit, drafts_kept, 1,
                                                                                  len(emitted)))
    return stats


def feed_lookahead(lookahead: LookaheadController, scope: str, k: int, width: int, stats: StepStats,
                   learned_ran: bool, draft_seconds: float, verify_seconds: float) -> None:
    """Feed the lookahead controller a step's acceptance and costs. A pass wider than k (a long
    continuation) is no sample of what k costs; a step whose learned drafter did not run (every
    row continued) is no sample of what drafting costs. With scope "learned" (the engine's
    `lookahead_scope`) the acceptance is the learned drafter's rows' alone, wherever they were verified."""
    costs = (draft_seconds if learned_ran else None, verify_seconds) if width == k else None
    if scope == "all":
        if costs is not None:  # the old policy: a wider pass was not observed at all
            lookahead.observe(k, stats.num_drafts_accepted, stats.num_rejections, *costs)
        return
    learned = stats.by_source.get(LEARNED_SOURCE)
    rejected = sum(accepted < drafts for kind, drafts, accepted in stats.row_outcomes if kind == LEARNED_SOURCE)
    lookahead.observe(k, learned.accepted if learned else 0, rejected, *(costs or (None, None)))
    for kind, drafts, accepted in stats.row_outcomes:
        if kind != LEARNED_SOURCE:
            lookahead.observe_continuation(kind, drafts, accepted)
