"""The eagle3 route's hybrid choice, per row and step, without vLLM: context matching where it is
expected to earn more than EAGLE-3's drafts, EAGLE-3 elsewhere, the other source scored in the shadow.
Records name the drafting source, and records without one read as the learned drafter's."""

from __future__ import annotations

import numpy as np
import pytest

from specd.core.errors import RecordRefused
from specd.core.records import StepRecord, TrajectoryRecord, validate_record
from specd.serving.vllm.eagle3.hybrid_rows import HybridRows
from specd.serving.vllm.shared.budget import DraftBudget
from specd.serving.vllm.shared.tracking import StepTracker

K = 4
REPEATING = [7, 8, 9, 10, 11, 12, 3, 7, 8, 9]   # "7 8 9" occurred before: context proposes 10 11 12 3
FRESH = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # nothing repeats: no context match


def rows(*sequences: list[int]) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(s) for s in sequences) + K
    table = np.zeros((len(sequences), width), dtype=np.int64)
    for row, sequence in enumerate(sequences):
        table[row, :len(sequence)] = sequence
    return table, np.array([len(s) for s in sequences])


def test_a_row_with_a_context_match_drafts_from_it_and_the_others_keep_eagle3s_drafts() -> None:
    hybrid, budget = HybridRows(K), DraftBudget(K)
    tokens, lengths = rows(REPEATING, FRESH)
    eagle = [[1, 2, 3, 4], [5, 6, 7, 8]]
    candidates = hybrid.candidates(["a", "b"], eagle, hybrid.offers(tokens, lengths), lengths, budget)
    assert candidates.drafts == [[10, 11, 12, 3], [5, 6, 7, 8]]
    assert candidates.sources == ["context3", "learned"] and candidates.limits == [4, 4]
    assert hybrid.mixed_steps == 1


def test_eagle3_stands_down_only_where_context_serves_every_row_of_the_step() -> None:
    hybrid, budget = HybridRows(K), DraftBudget(K)
    tokens, lengths = rows(REPEATING, FRESH)
    assert not hybrid.context_serves_every_row(hybrid.offers(tokens, lengths), budget)  # FRESH needs EAGLE-3
    tokens, lengths = rows(REPEATING, REPEATING[1:])
    offers = hybrid.offers(tokens, lengths)
    assert hybrid.context_serves_every_row(offers, budget)
    # EAGLE-3 stood down: its rows are empty, and every row drafts from its context
    candidates = hybrid.candidates(["a", "b"], [[], []], offers, lengths, budget)
    assert candidates.drafts == [[10, 11, 12, 3]] * 2 and candidates.sources == ["context3", "context2"]
    for _ in range(50):  # measured: context3 drafts are never accepted, EAGLE-3's always are
        budget.observe_drafts("context3", 4, 0)
        budget.observe_drafts("learned", 4, 4)
    assert not hybrid.context_serves_every_row(offers, budget)
    assert not hybrid.context_serves_every_row([], budget)  # no rows: nothing to stand down for


def test_eagle3_keeps_a_row_when_its_drafts_are_measured_to_pay_more_than_the_context_match() -> None:
    hybrid, budget = HybridRows(K), DraftBudget(K)
    for _ in range(50):  # measured: context3 drafts are never accepted, EAGLE-3's always are
        budget.observe_drafts("context3", 4, 0)
        budget.observe_drafts("learned", 4, 4)
    tokens, lengths = rows(REPEATING)
    candidates = hybrid.candidates(["a"], [[1, 2, 3, 4]], hybrid.offers(tokens, lengths), lengths, budget)
    assert candidates.drafts == [[1, 2, 3, 4]] and candidates.sources == ["learned"]


def test_the_source_not_chosen_is_scored_against_what_the_target_then_produced() -> None:
    hybrid, budget = HybridRows(K), DraftBudget(K)
    tracker = StepTracker("test")
    tokens, lengths = rows(REPEATING)
    tracker.observe(["a"], [[REPEATING[-1]]], lengths, np.array([3]), tokens, 1)
    before = budget.alpha("learned")[0]
    hybrid.candidates(["a"], [[1, 2, 3, 4]], hybrid.offers(tokens, lengths), lengths, budget)  # context chosen
    # the target went on with 10 11 (the context's guess), not EAGLE-3's 1
    grown, grown_lengths = rows([*REPEATING, 10, 11])
    tracker.observe(["a"], [[10, 11]], grown_lengths, np.array([3]), grown, 1)
    hybrid.observe(["a"], tracker, budget)
    assert budget.alpha("learned")[0] < before  # its first draft was scored, and rejected


def test_records_name_their_drafting_source_and_an_unnamed_source_is_the_learned_drafter() -> None:
    steps = [StepRecord(3, [4, 5], 1, 2, "context4"), StepRecord(5, [6], 1, 2)]
    record = TrajectoryRecord("r", "s", [1, 2, 3], [4, 6, 6, 7], steps, 0.0, 1.0, 0.0, 0.0)
    raw = record.to_dict()
    assert validate_record(raw, 100).steps == steps
    del raw["steps"][0]["source"]
    assert validate_record(raw, 100).steps[0].source == "learned"
    for bad in ("", 7, "x" * 33):
        raw["steps"][0]["source"] = bad
        with pytest.raises(RecordRefused, match="source"):
            validate_record(raw, 100)


def test_eagle3_drafts_no_more_than_its_cap_while_context_rows_may_reach_vllms_k(monkeypatch) -> None:
    from types import SimpleNamespace

    from specd.serving.vllm.eagle3.companion import Eagle3Companion

    monkeypatch.setenv("SPECD_EAGLE_MAX", "4")
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8, model="drafter"),
                             model_config=SimpleNamespace(max_model_len=64, model="target"))
    companion = Eagle3Companion(SimpleNamespace(vllm_config=config))
    assert companion.k == 8 and companion.hybrid.k == 8
    long_repeat = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 3, 7, 8, 9]   # context proposes 8 drafts
    tokens, lengths = rows(long_repeat, FRESH)
    offers = companion.hybrid.offers(tokens, lengths)
    assert offers[0] == ([10, 11, 12, 13, 14, 15, 16, 3], "context3")
    assert companion._eagle_k(offers, ["a", "b"], scheduled=8) == 4     # unmeasured: everything EAGLE-3 may draft
    assert companion._eagle_k([], ["a", "b"], scheduled=8) == 4         # hybrid off: the cap still holds
    assert companion._eagle_k(offers, ["a", "b"], scheduled=2) == 2     # vLLM's own k for the step stays the limit
    tokens, lengths = rows(long_repeat, long_repeat[1:])
    assert companion._eagle_k(companion.hybrid.offers(tokens, lengths), ["a", "b"], scheduled=8) == 0


def test_a_request_whose_context_matches_keep_failing_goes_back_to_eagle3_while_another_keeps_its_matches() -> None:
    hybrid, budget = HybridRows(K), DraftBudget(K)
    for _ in range(50):  # pooled over requests: 3-token matches are mostly right, EAGLE-3 half the time
        budget.observe_drafts("context3", 4, 3)
        budget.observe_drafts("learned", 4, 1)
    tokens, lengths = rows(REPEATING, REPEATING)
    offers = hybrid.offers(tokens, lengths)
    assert hybrid.context_pays(offers, budget, request_ids=["chat", "code"]) == [True, True]
    for _ in range(6):   # in this chat request the matches were wrong every time; in the code request right
        budget.observe_drafts("context2", 2, 0, request_id="chat")
        budget.observe_drafts("context4", 4, 4, request_id="code")
    assert hybrid.context_pays(offers, budget, request_ids=["chat", "code"]) == [False, True]
    candidates = hybrid.candidates(["chat", "code"], [[1, 2, 3, 4]] * 2, offers, lengths, budget)
    assert candidates.sources == ["learned", "context3"]
    budget.first_drafts.forget("chat")                       # finished: the pooled rate again
    assert hybrid.context_pays(offers, budget, request_ids=["chat", "code"]) == [True, True]
