"""The hybrid drafter's reach: long continuations draft past the step's k while the pass stays small,
without changing an output."""

from __future__ import annotations

import torch
from conftest import fixed_k, tiny_drafter, tiny_target

from specd.drafter.base import DraftBatch
from specd.drafter.hybrid import WIDE_PASS_ROWS, HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams

REPEATING = [5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7]   # "5 6 7" seen before: continues 8 9 10 11 ...


def _batch(rows: list[list[int]]) -> DraftBatch:
    width = max(len(row) for row in rows) + 16
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        tokens[index, :len(row)] = torch.tensor(row)
    lengths = torch.tensor([len(row) for row in rows])
    return DraftBatch(tokens, lengths, [len(row) for row in rows], [f"r{i}" for i in range(len(rows))],
                      torch.zeros(len(rows)), torch.ones(len(rows)), [])


def _hybrid(context_k: int | None, rows: int) -> HybridDrafter:
    target = tiny_target()
    hybrid = HybridDrafter(tiny_drafter(target), context_k=context_k)
    hybrid.bind(rows, 64, torch.device("cpu"))
    return hybrid


def test_a_row_without_a_continuation_still_gets_the_learned_drafts() -> None:
    hybrid = _hybrid(None, 2)
    proposal = hybrid.propose(_batch([REPEATING, [20, 21, 22, 23]]), 3)
    assert hybrid.learned_ran and hybrid.row_sources == ["context3", "learned"]
    assert proposal.limits is not None and proposal.limits.tolist() == [3, 3]


def test_a_long_continuation_drafts_past_k_at_batch_one() -> None:
    hybrid = _hybrid(6, 1)
    proposal = hybrid.propose(_batch([REPEATING]), 2)
    assert proposal.drafts.tolist() == [[8, 9, 10, 11, 12, 13]]
    assert proposal.limits is not None and proposal.limits.tolist() == [6]


def test_learned_rows_keep_k_beside_a_longer_continuation() -> None:
    hybrid = _hybrid(6, 2)
    proposal = hybrid.propose(_batch([REPEATING, [20, 21, 22, 23]]), 2)
    assert proposal.drafts.shape == (2, 5)   # 2 rows x 6 positions fill the pass's 12
    assert proposal.limits is not None and proposal.limits.tolist() == [5, 2]


def test_a_batch_of_many_rows_is_not_widened() -> None:
    rows = WIDE_PASS_ROWS // 3
    hybrid = _hybrid(8, rows)
    proposal = hybrid.propose(_batch([REPEATING] * rows), 2)
    assert proposal.drafts.shape == (rows, 2)


def test_greedy_output_equals_the_target_alone_with_continuations_past_k() -> None:
    target = tiny_target()
    prompts = [REPEATING, [3, 4, 3, 4, 3, 4, 3], [9, 10, 11, 12]]
    params = SamplingParams(max_tokens=30)
    alone = Engine(target, None, EngineConfig(max_batch=1)).generate(prompts, params)
    engine = Engine(target, HybridDrafter(tiny_drafter(target), context_k=8), fixed_k(max_batch=1, num_draft_tokens=2))
    spec = engine.generate(prompts, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in alone]
    assert any(stats.num_drafts_proposed > 2 for stats in engine.step_stats), "no step drafted past k"


def test_a_request_at_the_context_limit_has_room_for_the_widest_pass() -> None:
    target = tiny_target()
    config = fixed_k(max_batch=1, num_draft_tokens=2, max_context=len(REPEATING) + 12)
    engine = Engine(target, HybridDrafter(tiny_drafter(target), context_k=8), config)
    alone = Engine(target, None, EngineConfig(max_batch=1, max_context=len(REPEATING) + 12))
    params = SamplingParams(max_tokens=12)
    assert engine.generate([REPEATING], params)[0].output_ids == alone.generate([REPEATING], params)[0].output_ids
