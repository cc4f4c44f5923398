"""EAGLE-3's rows trimmed by the drafter's own confidence in each draft, without vLLM: the top
probability of each drafting pass is read alongside the very token vLLM would draft, calibrated
against acceptance (verified and shadow-scored drafts alike), and decides how many of a row's drafts
are sent and whether the row's context match beats them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from specd.serving.vllm.eagle3.confidence import PassConfidence
from specd.serving.vllm.eagle3.hybrid_rows import HybridRows
from specd.serving.vllm.shared.budget import ConfidenceCalibration, DraftBudget
from specd.serving.vllm.shared.policy import Candidates, DraftPolicy
from specd.serving.vllm.shared.tracking import StepTracker

SURE, UNSURE = 0.95, 0.15


def priced(budget: DraftBudget) -> DraftBudget:
    """A budget whose verification bar at batch 1 is measured near 0.3."""
    for step in range(200):  # 20 ms per step plus 6 ms per verified token, about 50 tokens/s
        verified = 1 + step % 4
        budget.observe_step(0.020 + 0.006 * verified, verified, emitted_tokens=2, rows=1)
    return budget


def calibrated(budget: DraftBudget) -> DraftBudget:
    """Sure drafts have always been accepted, unsure ones never."""
    for _ in range(200):
        budget.observe_drafts("learned", drafted=2, accepted=1, confidences=[SURE, UNSURE])
    return budget


def test_calibration_learns_the_acceptance_of_each_band_of_confidence() -> None:
    calibration = ConfidenceCalibration(bands=10)
    assert calibration.chance(0.95) == 0.95 and calibration.chance(0.15) == 0.15  # the prior: calibrated
    for _ in range(300):  # an overconfident drafter: its 0.9s are accepted half the time
        calibration.observe([0.92, 0.91, 0.93], drafted=3, accepted=0)
        calibration.observe([0.92, 0.91, 0.93], drafted=3, accepted=1)
    assert abs(calibration.chance(0.9) - 1 / 3) < 0.02  # reached 3 times per pair, accepted once
    assert calibration.chance(0.15) == 0.15             # bands never reached keep their prior
    calibration.observe([0.5], drafted=0, accepted=0)   # nothing verified: nothing learned
    assert calibration.chance(0.5) == 0.55


def test_a_sure_late_draft_is_sent_and_an_unsure_early_one_is_not() -> None:
    budget = calibrated(priced(DraftBudget(k=4, explore_every=0)))
    assert 0.2 < budget.bar < 0.5
    assert budget.keep_confident([SURE, SURE, SURE, SURE], 4) == 4
    assert budget.keep_confident([UNSURE, SURE, SURE, SURE], 4) == 0
    assert budget.keep_confident([SURE, SURE, UNSURE, SURE], 4) == 2
    assert budget.keep_confident([SURE, SURE, SURE, SURE], 3) == 3  # never more than usable


def test_the_policy_trims_rows_by_confidence_and_calibrates_on_verified_and_held_back_drafts() -> None:
    budget = priced(DraftBudget(k=3, explore_every=0))
    policy, tracker = DraftPolicy(budget, max_model_len=64), StepTracker("vllm-test")
    sequence = [1, 2, 3, 10]  # a prompt of 3 and the token its prefill sampled
    tracker.observe(["a"], [[10]], np.array([4]), np.array([3]), np.array([sequence]), 1)
    offered = Candidates([[11, 12, 13]], [3], ["learned"], confidences=[[SURE, SURE, UNSURE]])
    drafts = policy.choose(["a"], offered, np.array([4]), [[10]])
    assert drafts == [[11, 12]], "the unsure third draft is below the bar"
    before = list(budget.calibration.reached)
    # the target accepts 11 and 12 and writes 40 where the unsure draft said 13
    sequence += [11, 12, 40]
    tracker.remember(["a"], drafts, np.array([4]), 1)
    tracker.observe(["a"], [[11, 12, 40]], np.array([7]), np.array([3]), np.array([sequence]), 1)
    policy.observe(["a"], [[11, 12, 40]], tracker, now=0.1)
    sure, unsure = budget.calibration.band(SURE), budget.calibration.band(UNSURE)
    assert budget.calibration.reached[sure] > before[sure] + 1.5    # both sure drafts, scored in the shadow
    assert budget.calibration.reached[unsure] > before[unsure]      # and the held-back one's rejection
    assert budget.calibration.chance(UNSURE) < UNSURE


def test_context_wins_a_row_where_eagle3_is_unsure_and_loses_one_where_it_is_sure() -> None:
    budget = calibrated(DraftBudget(k=4))
    for _ in range(200):  # context matches of length 3 are right about half the time
        budget.observe_drafts("context3", drafted=1, accepted=1)
        budget.observe_drafts("context3", drafted=1, accepted=0)
    hybrid = HybridRows(4)
    repeating = [7, 8, 9, 10, 11, 12, 3, 7, 8, 9]  # "7 8 9" occurred before: context proposes 10 11 12 3
    tokens = np.array([repeating + [0] * 4, repeating + [0] * 4])
    lengths = np.array([len(repeating)] * 2)
    eagle, sure = [[1, 2, 3, 4], [5, 6, 7, 8]], [[SURE] * 4, [UNSURE] * 4]
    candidates = hybrid.candidates(["a", "b"], eagle, hybrid.offers(tokens, lengths), lengths, budget, sure)
    assert candidates.sources == ["learned", "context3"]
    assert candidates.confidences == [[SURE] * 4, []]


class FakeDrafterHead(nn.Module):
    """The parts of vLLM's EAGLE-3 model the sampling reads: a logits processor over the draft
    vocabulary and its offsets into the target's."""

    def __init__(self, logits: torch.Tensor, offsets: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = SimpleNamespace(tp_size=1)
        self.logits = logits
        self.logits_processor = lambda head, hidden_states: self.logits[: len(hidden_states)]
        self.draft_id_to_target_id = offsets


def fake_proposer(logits: torch.Tensor, offsets: torch.Tensor) -> SimpleNamespace:
    """vLLM's proposer as far as drafting goes: `propose(passes)` samples once per pass and stacks the drafts."""
    proposer = SimpleNamespace(model=FakeDrafterHead(logits, offsets), use_heterogeneous_vocab=False)
    proposer.propose = lambda passes: torch.stack([proposer._greedy_sample(torch.zeros(len(logits), 4))
                                                   for _ in range(passes)], dim=1)
    return proposer


def test_pass_confidence_drafts_vllms_tokens_and_keeps_each_passs_top_probability() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.0], [1.0, 1.0, 5.0]])
    proposer = fake_proposer(logits, torch.tensor([10, 20, 30]))
    confidence = PassConfidence()
    assert confidence.take(2) is None          # not attached: nothing to report
    assert confidence.attach(proposer)
    confidence.start()
    assert confidence.take(2) == [[], []]      # no pass ran (EAGLE-3 stood down)
    confidence.start()
    for _ in range(2):                          # two drafting passes
        tokens = proposer._greedy_sample(torch.zeros(2, 4))
        assert tokens.tolist() == [1 + 20, 2 + 30]  # argmax over the draft vocabulary, then its offset
    taken = confidence.take(2)
    assert taken is not None
    expected = torch.softmax(logits, dim=-1).max(dim=-1).values.tolist()
    assert np.allclose(taken, [[expected[0]] * 2, [expected[1]] * 2])


def test_pass_confidence_leaves_vllms_sampling_alone_where_it_could_draw_other_tokens() -> None:
    sharded = fake_proposer(torch.zeros(1, 3), torch.zeros(3))
    sharded.model.lm_head.tp_size = 2
    assert not PassConfidence().attach(sharded) and not hasattr(sharded, "_greedy_sample")


def test_drafting_stops_between_passes_once_no_row_is_worth_another_and_returns_the_drafts_made() -> None:
    proposer = fake_proposer(torch.tensor([[0.0, 3.0, 0.0]]), torch.tensor([10, 20, 30]))
    confidence = PassConfidence()
    assert confidence.attach(proposer)
    seen: list[int] = []
    confidence.start(4, lambda so_far: seen.append(len(so_far[0])) or len(so_far[0]) < 2)
    drafts = proposer.propose(4)
    assert drafts.tolist() == [[21, 21]] and seen == [1, 2]   # asked after each pass; stopped after the second
    assert confidence.stopped_early == 1 and len(confidence.take(1)[0]) == 2
    confidence.start(3, lambda so_far: True)                   # always worth it: every pass asked for runs
    assert proposer.propose(3).shape == (1, 3) and confidence.stopped_early == 1


def test_another_pass_is_worth_it_while_some_row_is_sure_enough_of_its_drafts() -> None:
    budget = calibrated(priced(DraftBudget(k=4, explore_every=0)))
    assert budget.worth_another_pass([[UNSURE], [SURE, SURE]])
    assert not budget.worth_another_pass([[UNSURE], [SURE, UNSURE]])
    assert not budget.worth_another_pass([[SURE] * 4])  # k drafts made: there is no next
    assert not budget.worth_another_pass([])
