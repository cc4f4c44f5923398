"""Hybrid drafting on the eagle3 route: per row and step, context matching or EAGLE-3, by measured acceptance.

Contract (plain Python and numpy, no vLLM import): `HybridRows.offers(token_rows, lengths)` finds
each row's context continuation from the rows' tokens (vLLM's `token_ids_cpu`, the first
`lengths[row]` valid); `context_serves_every_row(offers, budget)` says whether every row would
draft from context this step, in which case EAGLE-3 need not draft at all (the companion then asks
vLLM for no drafts: its proposer still runs the one pass that keeps its KV cache in step);
`candidates(request_ids, learned, offers, lengths, budget)` takes the drafts vLLM's EAGLE-3 proposer made
for each row (`learned`, [rows][k], or empty rows where it stood down) and returns `Candidates`
for `DraftPolicy.choose`. A row gets a continuation from its own context (prompt and
output so far: `context_match`, source "context<n>" with the match length n) or, without one, from
the traffic table of recent requests ("table<n>"), when the draft budget expects that continuation
to earn at least as many accepted tokens as EAGLE-3's drafts (by their position's measured
acceptance, or with EAGLE-3's `confidences` in each draft, by this row's own calibrated chances;
the continuation's first draft counts at the rate its source family has had in this request, so
that a chat request that seldom copies is not drafted from a code request's pooled acceptance);
otherwise it keeps EAGLE-3's ("learned"). The source not chosen is scored in the shadow against
the tokens the target then produces (`observe`), so each source's acceptance stays measured
whichever one serves. Drafts carry no probabilities either way (vLLM verifies them as one-hot), so
the choice never changes an output token, only how many are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specd.core.records import LEARNED_SOURCE
from specd.drafter.hybrid import continuation
from specd.drafter.traffic_table import TrafficTable
from specd.serving.vllm.shared.budget import DraftBudget, ShadowBook
from specd.serving.vllm.shared.policy import Candidates
from specd.serving.vllm.shared.tracking import StepTracker


class HybridRows:
    def __init__(self, k: int, table: TrafficTable | None = None, max_n: int = 4, min_n: int = 2,
                 window: int = 1024) -> None:
        self.k, self.table = k, table
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.alternatives = ShadowBook()   # per request: the drafts of the source that did not serve
        self.rows_by_source: dict[str, int] = {}
        self.mixed_steps = 0               # steps where some rows drafted from context and others from EAGLE-3

    def offers(self, token_rows: np.ndarray, lengths: np.ndarray) -> list[tuple[list[int], str]]:
        """Each row's continuation from its own context or the traffic table, and its source."""
        return [continuation(token_rows[row, max(0, int(length) - self.window):int(length)], self.k, self.table,
                             self.max_n, self.min_n) for row, length in enumerate(lengths)]

    def context_serves_every_row(self, offers: Sequence[tuple[list[int], str]], budget: DraftBudget,
                                 learned_drafts: int | None = None, request_ids: Sequence[str] | None = None) -> bool:
        """Whether every row's continuation is expected to earn at least what EAGLE-3's drafts would
        (`learned_drafts` of them: k unless EAGLE-3 is capped below it)."""
        return bool(offers) and all(self.context_pays(offers, budget, learned_drafts, request_ids))

    def context_pays(self, offers: Sequence[tuple[list[int], str]], budget: DraftBudget,
                     learned_drafts: int | None = None, request_ids: Sequence[str] | None = None) -> list[bool]:
        """Per row, whether its continuation is expected to earn at least what EAGLE-3's drafts would
        by their positions' measured acceptance (`learned_drafts` of them: k unless capped); with the
        rows' `request_ids`, a continuation's first draft counts at its request's own rate."""
        reach = self.k if learned_drafts is None else learned_drafts
        ids: Sequence[str | None] = request_ids if request_ids is not None else [None] * len(offers)
        return [self._context_pays(found, source, reach, budget, request_id=request_id)
                for (found, source), request_id in zip(offers, ids, strict=True)]

    @staticmethod
    def _context_pays(found: list[int], source: str, learned_drafts: int, budget: DraftBudget,
                      learned_expected: float | None = None, request_id: str | None = None) -> bool:
        if learned_expected is None:
            learned_expected = budget.expected_accepted(LEARNED_SOURCE, learned_drafts)
        return bool(found) and budget.expected_accepted(source, len(found), request_id) >= learned_expected

    def candidates(self, request_ids: Sequence[str], learned: Sequence[Sequence[int]],
                   offers: Sequence[tuple[list[int], str]], lengths: np.ndarray, budget: DraftBudget,
                   confidences: Sequence[Sequence[float]] | None = None) -> Candidates:
        """Each row's drafts; `confidences` ([rows][k], optional) are EAGLE-3's top probability per draft."""
        drafts, limits, sources, row_confidences = [], [], [], []
        chosen: tuple[list[int], str, list[float]]
        alternative: tuple[list[int], str, list[float]]
        for row, request_id in enumerate(request_ids):
            length = int(lengths[row])
            eagle = [int(t) for t in learned[row]]
            sure = [float(p) for p in confidences[row][:len(eagle)]] if confidences is not None else []
            found, source = offers[row]
            expected = sum(budget.confident_chances(sure)) if sure and len(sure) == len(eagle) else None
            if self._context_pays(found, source, len(eagle), budget, expected, request_id):
                chosen, alternative = (found, source, []), (eagle, LEARNED_SOURCE, sure)
            else:
                chosen, alternative = (eagle, LEARNED_SOURCE, sure), (found, source, [])
            if alternative[0]:
                self.alternatives.add(request_id, alternative[1], length, alternative[0], alternative[2])
            drafts.append(chosen[0])
            limits.append(len(chosen[0]))
            sources.append(chosen[1])
            row_confidences.append(chosen[2])
            self.rows_by_source[chosen[1]] = self.rows_by_source.get(chosen[1], 0) + 1
        self.mixed_steps += LEARNED_SOURCE in sources and any(s != LEARNED_SOURCE for s in sources)
        return Candidates(drafts=drafts, limits=limits, sources=sources,
                          confidences=row_confidences if confidences is not None else None)

    def observe(self, request_ids: Sequence[str], tracker: StepTracker, budget: DraftBudget) -> None:
        """Score the alternatives the target's tokens have settled (after `StepTracker.observe`)."""
        for request_id in request_ids:
            trajectory = tracker.live.get(request_id)
            scored = self.alternatives.score(request_id, trajectory.tokens) if trajectory is not None else None
            if scored is not None:
                budget.observe_drafts(*scored, request_id=request_id)

    def forget(self, request_id: str) -> None:
        self.alternatives.drop(request_id)
