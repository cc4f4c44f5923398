"""The traffic table: continuations learned across requests, chained into drafts, bounded in memory."""

from __future__ import annotations

import torch
from conftest import tiny_drafter, tiny_target

from specd.drafter.base import DraftBatch
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.traffic_table import TrafficTable


def test_a_continuation_seen_in_earlier_requests_is_drafted_for_a_new_one() -> None:
    table = TrafficTable(min_count=2)
    table.add([1, 2, 3, 4, 5, 6])
    assert table.draft([9, 2, 3], 3) == []            # seen once: not trusted yet
    table.add([7, 2, 3, 4, 5, 8])
    assert table.draft([9, 2, 3], 3) == [4, 5]        # chained, and stops where requests disagreed (6 vs 8)
    assert table.draft_with_order([9, 2, 3], 3) == ([4, 5], 2)


def test_an_uncertain_continuation_is_not_drafted() -> None:
    table = TrafficTable(min_count=1, min_share=0.6)
    for following in (10, 11, 10, 11):
        table.add([1, 2, following])
    assert table.draft([1, 2], 4) == []               # 10 and 11 each half the time
    table.add([1, 2, 10])
    assert table.draft([1, 2], 1) == [10]             # 3 of 5 times


def test_the_longest_known_context_decides() -> None:
    table = TrafficTable(min_count=1)
    table.add([5, 1, 2, 40])
    table.add([6, 1, 2, 50])
    table.add([6, 1, 2, 50])
    assert table.draft([5, 1, 2], 1) == [40]          # the 3-token context knows better than "1 2"
    assert table.draft([9, 1, 2], 1) == [50]          # unknown 3-token context: "1 2" decides


def test_memory_is_bounded_by_dropping_the_oldest_contexts() -> None:
    table = TrafficTable(max_contexts=50, min_count=1)
    for start in range(0, 1000, 10):
        table.add(list(range(start, start + 10)))
    assert len(table) <= 50
    assert table.draft([991, 992], 2) == [993, 994]   # recent traffic is still known


def test_hybrid_drafter_asks_the_table_where_its_own_context_has_no_match() -> None:
    target = tiny_target()
    table = TrafficTable(min_count=1)
    hybrid = HybridDrafter(tiny_drafter(target), table)
    hybrid.bind(2, 64, torch.device("cpu"))
    table.add([30, 31, 32, 33, 34])
    tokens = torch.zeros(2, 64, dtype=torch.long)
    tokens[0, :4] = torch.tensor([1, 2, 30, 31])      # no repeat inside the row; the table knows "30 31"
    tokens[1, :4] = torch.tensor([5, 6, 7, 8])        # nobody knows anything
    batch = DraftBatch(tokens, torch.tensor([4, 4]), [2, 2], ["a", "b"], torch.zeros(2), torch.ones(2), [])
    hybrid.use_learned = False
    proposal = hybrid.propose(batch, 3)
    assert proposal.drafts[0].tolist() == [32, 33, 34] and proposal.limits is not None
    assert proposal.limits.tolist() == [3, 0] and hybrid.num_table_rows == 1
    assert hybrid.row_sources == ["table2", "none"]   # sources name the context length that matched
    hybrid.commit(torch.tensor([3, 0]))               # the learned part did not run: nothing to settle


def test_its_stats_count_contexts_against_the_bound_and_the_sequences_added() -> None:
    table = TrafficTable(min_n=2, max_n=3, max_contexts=1000)
    table.add([1, 2, 3, 4])
    # positions 2 and 3: contexts (1,2), then (2,3) and (1,2,3)
    assert table.stats() == {"contexts": 3, "max_contexts": 1000, "sequences_added": 1}
