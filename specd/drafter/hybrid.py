"""The hybrid drafter: context matches first, then the traffic table, then the learned drafter.

Contract: a row whose own context has a match (`context_match`) gets the match's drafts; a row
without one asks the `TrafficTable` it was built with (if any) what earlier requests continued its
last tokens with; every other row gets the learned drafter's drafts (a `TokenDrafter` or a
`FeatureDrafter`). The learned drafter still runs for all rows (a token drafter's cache must follow
every row) unless a caller switches it off (`use_learned`), k is 0 (continuations alone draft), or
it is a feature drafter and every row has a continuation (its drafts would all be replaced; its
cache catches up from the verified features at its next proposal). A pending version is installed at
the start of every proposal, whether or not the learned part runs. Rows whose drafts were replaced
commit as "none of your drafts were used", so a token drafter's cache stays exact (a feature
drafter's features come from the verified tokens through `observe`, whoever drafted them). With
`context_k` a continuation may propose up to that many drafts where the step's k is smaller (the
proposal is then wider than k; the learned rows keep k), as long as the pass stays within
`WIDE_PASS_ROWS` positions in all; where the engine sets `reach` (per continuation kind, from
its measured acceptance and what a wider pass costs), a continuation proposes at most that many,
or k where the learned drafter makes the pass k wide anyway, and a pass of continuations alone is
as wide as they are. Swaps, versions and the target layers to capture belong to the
learned part. `row_sources` names where each row's drafts came from at the last proposal
("context<n>", "table<n>", "learned", "none"), with the match length, since long matches are right
far more often than short ones.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from specd.core.records import source_kind
from specd.drafter.base import DraftBatch, Proposal, one_hot_q
from specd.drafter.context_match import context_match
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.token_drafter import TokenDrafter
from specd.drafter.traffic_table import TrafficTable
from specd.model.transformer import Transformer


def continuation(tokens: np.ndarray, k: int, table: TrafficTable | None, max_n: int = 4,
                 min_n: int = 2) -> tuple[list[int], str]:
    """Up to k drafts for a row whose tokens are `tokens`, and their source: its own context match
    ("context<n>"), else the traffic table's continuation ("table<n>"), else ([], ""). The source
    names the match length too: a 4-token match is right far more often than a 2-token one."""
    found, order = context_match(tokens, k, max_n, min_n)
    if found:
        return found, f"context{order}"
    if table is not None:
        found, order = table.draft_with_order([int(t) for t in tokens[-table.max_n:]], k)
        if found:
            return found, f"table{order}"
    return [], ""


# rows (positions of every request together) up to which a pass may widen for long continuations
WIDE_PASS_ROWS = 12
CONTINUATION_KINDS = ("context", "table")   # `source_kind` of a continuation's source


class HybridDrafter:
    def __init__(self, learned: TokenDrafter | FeatureDrafter, table: TrafficTable | None = None, max_n: int = 4,
                 min_n: int = 2, window: int = 1024, context_k: int | None = None) -> None:
        self.learned = learned
        # the most drafts a continuation proposes in one step, past the step's k when larger: its
        # drafts cost nothing to make, and on one thread a few more verified rows cost little
        self.context_k = context_k
        # continuations learned across requests (see traffic_table), asked where the row has no match
        self.table = table
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.num_matched_rows = 0
        # a caller may switch the learned part off while it does not pay for itself (the vLLM
        # proposer's gate); learned_ran / learned_seconds say whether it ran at the last step and its time
        self.use_learned = True
        # a feature drafter skips steps where continuations serve every row (benchmarks switch it off)
        self.skip_covered_steps = True
        self.num_table_rows = 0
        self.row_sources: list[str] = []
        self.learned_ran = False
        self.learned_seconds = 0.0
        # the most drafts each kind of continuation ("context", "table") proposes this step, set by
        # the engine from their measured acceptance and what a wider pass costs; None: context_k
        self.reach: dict[str, int] | None = None

    # the learned part owns versions, swaps and caches
    @property
    def version(self) -> int:
        return self.learned.version

    @property
    def model(self) -> Transformer | FeatureDrafterModel:
        return self.learned.model

    @property
    def num_swaps(self) -> int:
        return self.learned.num_swaps

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers a feature drafter reads; none for a token drafter."""
        return self.learned.capture_layers if isinstance(self.learned, FeatureDrafter) else ()

    def observe(self, slot: int, start: int, features: torch.Tensor) -> None:
        if isinstance(self.learned, FeatureDrafter):
            self.learned.observe(slot, start, features)

    def check_compatible(self, model: Transformer | FeatureDrafterModel) -> None:
        self.learned.check_compatible(model)

    def offer(self, model: Transformer | FeatureDrafterModel, version: int) -> None:
        self.learned.offer(model, version)

    def apply_pending(self) -> bool:
        return self.learned.apply_pending()

    def withdraw(self) -> int | None:
        return self.learned.withdraw()

    def bind(self, max_batch: int, max_seq: int, device: torch.device) -> None:
        self.learned.bind(max_batch, max_seq, device)

    def start(self, slot: int) -> None:
        self.learned.start(slot)

    def move(self, src: int, dst: int) -> None:
        self.learned.move(src, dst)

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        # a version offered since the last step goes live at this proposal whether or not the learned
        # part runs (left to its own proposal, a skipped or switched-off step delayed the swap)
        self.learned.apply_pending()
        reach = max(k, self.context_k or 0)
        continuations = []
        for row, length in enumerate(batch.lengths.tolist()):
            start = max(0, length - self.window)
            continuations.append(continuation(batch.tokens[row, start:length].cpu().numpy(), reach, self.table,
                                              self.max_n, self.min_n))
        # where every row has a continuation the learned drafts would all be replaced: a feature
        # drafter skips the step (its cache catches up from the verified features at its next proposal)
        every_row_continued = (self.skip_covered_steps and isinstance(self.learned, FeatureDrafter)
                               and all(found for found, _ in continuations))
        # at k = 0 (the lookahead controller finds the learned drafter not worth its cost) only
        # continuations draft
        self.learned_ran = self.use_learned and k > 0 and not every_row_continued
        # the pass is k wide where the learned drafter drafts (or where the caller takes exactly k);
        # with measured reaches a pass of continuations alone is as wide as they are
        floor = k if self.learned_ran or self.reach is None else 0
        if self.reach is not None:  # each kind as far as it pays, never short of a pass already k wide
            continuations = [(found[:max(floor, self.reach.get(source_kind(source, len(found)), len(found)))], source)
                             for found, source in continuations]
        # a pass verifies every row at the widest row's width: widen past k only while the pass stays
        # within WIDE_PASS_ROWS rows (one block of the few-row kernel), where extra rows cost little
        width = min(max([floor] + [len(found) for found, _ in continuations]),
                    max(floor, WIDE_PASS_ROWS // batch.num_rows - 1))
        continuations = [(found[:width], source) for found, source in continuations]
        q: torch.Tensor | None = None
        if self.learned_ran:
            begin = time.perf_counter()
            proposal = self.learned.propose(batch, k)
            self.learned_seconds = time.perf_counter() - begin
            drafts, q = _widened(proposal.drafts, proposal.q, width)
            limits = proposal.limits.clone() if proposal.limits is not None else torch.full_like(batch.lengths, k)
        else:  # rows without a continuation draft nothing this step
            drafts = torch.zeros(batch.num_rows, width, dtype=torch.long, device=batch.lengths.device)
            limits = torch.zeros_like(batch.lengths)
        self.row_sources = []  # per row: "context<n>", "table<n>", "learned" or "none"
        for row, (found, source) in enumerate(continuations):
            self.num_table_rows += source.startswith("table")
            if not found:
                source = "learned" if self.learned_ran and int(limits[row]) > 0 else "none"
            self.row_sources.append(source)
            if found:
                drafts[row, :len(found)] = torch.tensor(found, device=drafts.device)
                limits[row] = len(found)
        matched_rows = self._matched
        self.num_matched_rows += sum(matched_rows)
        if q is not None and any(matched_rows):  # matched rows' drafts are deterministic: q one-hot
            matched = torch.tensor(matched_rows, device=q.device)
            q = torch.where(matched[:, None, None], one_hot_q(drafts, q.shape[-1]).to(q), q)
        return Proposal(drafts, q, limits)

    @property
    def _matched(self) -> list[bool]:
        """Per row of the last proposal: were its drafts a context match or table continuation (not learned)?"""
        return [source not in ("learned", "none") for source in self.row_sources]

    def commit(self, num_accepted: torch.Tensor) -> None:
        if not self.learned_ran:
            return
        used = torch.tensor([not m for m in self._matched], device=num_accepted.device)
        self.learned.commit(torch.where(used, num_accepted, torch.zeros_like(num_accepted)))


def _widened(drafts: torch.Tensor, q: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The learned drafter's [B, k] drafts (a copy) and q padded to `width` columns (zeros, q one-hot
    there): the columns a continuation fills past k."""
    extra = width - drafts.shape[1]
    if extra <= 0:
        return drafts.clone(), q
    padding = drafts.new_zeros(drafts.shape[0], extra)
    if q is not None:
        q = torch.cat([q, one_hot_q(padding, q.shape[-1]).to(q)], dim=1)
    return torch.cat([drafts, padding], dim=1), q
