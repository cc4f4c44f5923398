"""What the lookahead k governs: the learned drafter alone (continuations draft at every k, 0
included; the controller's acceptance is the learned drafter's own), or, as before, every source;
and how far continuations reach: as far as their measured acceptance pays for, outputs unchanged."""

from __future__ import annotations

import pytest
from conftest import tiny_drafter, tiny_target
from test_hybrid_reach import REPEATING, _batch, _hybrid

from specd.core.records import AcceptanceCounts
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.lookahead import LookaheadConfig, LookaheadController, LookaheadCosts
from specd.engine.request import SamplingParams
from specd.engine.step_stats import StepStats, feed_lookahead

PROMPTS = [REPEATING, [3, 4, 3, 4, 3, 4, 3], [9, 10, 11, 12]]
PARAMS = SamplingParams(max_tokens=30)


class NeverDrafts(LookaheadController):
    """A controller that finds the learned drafter never worth its cost: k = 0 at every step."""

    def choose(self, version: int) -> int:
        return 0


def _engine_at_k0(scope: str) -> Engine:
    target = tiny_target()
    engine = Engine(target, HybridDrafter(tiny_drafter(target), context_k=8),
                    EngineConfig(max_batch=1, num_draft_tokens=4, lookahead_scope=scope))
    engine.lookahead = NeverDrafts(LookaheadConfig(max_k=4))
    return engine


def test_a_hybrid_at_k0_drafts_continuations_without_running_its_learned_drafter() -> None:
    hybrid = _hybrid(8, 2)
    proposal = hybrid.propose(_batch([REPEATING, [20, 21, 22, 23]]), 0)
    assert not hybrid.learned_ran and hybrid.row_sources == ["context3", "none"]
    # two rows of 6 positions fill the pass's WIDE_PASS_ROWS: the continuation keeps 5 of its 6 drafts
    assert proposal.limits is not None and proposal.limits.tolist() == [5, 0]


def test_continuations_are_served_at_k0_and_outputs_stay_the_targets() -> None:
    alone = Engine(tiny_target(), None, EngineConfig(max_batch=1)).generate(PROMPTS, PARAMS)
    engine = _engine_at_k0("learned")
    outputs = engine.generate(PROMPTS, PARAMS)
    assert [s.output_ids for s in outputs] == [s.output_ids for s in alone]
    assert all(stats.k == 0 for stats in engine.step_stats)
    drafted = [stats for stats in engine.step_stats if stats.num_drafts_proposed]
    assert drafted, "no continuation was served at k = 0"
    assert all("learned" not in stats.by_source for stats in engine.step_stats)


def test_when_k_covers_every_source_k0_drafts_nothing() -> None:
    engine = _engine_at_k0("all")
    engine.generate(PROMPTS, PARAMS)
    assert all(stats.num_drafts_proposed == 0 for stats in engine.step_stats)


def test_an_unknown_lookahead_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="lookahead_scope"):
        EngineConfig(lookahead_scope="context")


def _mixed_step() -> StepStats:
    """A pass 8 wide at k = 2: one row's continuation all accepted, one learned row's first draft rejected."""
    stats = StepStats(2, 10, 8, 10, 0.0, 1, k=2, num_rejections=1, row_outcomes=[("context", 8, 8), ("learned", 2, 0)])
    stats.by_source = {"context": AcceptanceCounts(8, 8, 1, 9), "learned": AcceptanceCounts(2, 0, 1, 1)}
    return stats


@pytest.mark.parametrize("scope", ["learned", "all"])
def test_the_controller_follows_the_learned_drafters_acceptance_and_no_wide_pass_is_a_cost_sample(scope) -> None:
    controller = LookaheadController(LookaheadConfig(max_k=4))
    prior = controller.acceptance
    feed_lookahead(controller, scope, 2, 8, _mixed_step(), True, draft_seconds=0.01, verify_seconds=0.1)
    assert controller.verify_seconds == {}  # 8 positions wide: no sample of what k = 2 costs
    if scope == "learned":  # the learned row's rejection alone: 0 of 1 trials
        assert controller.acceptance == pytest.approx(0.9 * prior)
    else:  # the old policy observed nothing of a wide pass
        assert controller.acceptance == prior
    feed_lookahead(controller, scope, 2, 2, _mixed_step(), True, draft_seconds=0.01, verify_seconds=0.1)
    assert controller.verify_seconds == {2: 0.1} and controller.draft_seconds == pytest.approx(0.005)


def test_a_swap_pending_at_k0_goes_live_at_the_next_step() -> None:
    target = tiny_target()
    engine = _engine_at_k0("learned")
    hybrid = engine.drafter
    assert isinstance(hybrid, HybridDrafter)
    hybrid.offer(tiny_drafter(target, seed=2).model, version=7)
    engine.add_request(PROMPTS[0], PARAMS)
    engine.step()   # admits the request and decodes its first step, at k = 0
    assert engine.step_stats[-1].k == 0 and hybrid.version == 7


def test_continuations_reach_far_where_their_spans_hold_and_short_where_they_break() -> None:
    costs = LookaheadCosts(verify_seconds={0: 0.10, 1: 0.10, 2: 0.11, 3: 0.13, 4: 0.135}, draft_seconds=0.01)
    controller = LookaheadController(LookaheadConfig(max_k=4, probe_every=1000), costs)
    for _ in range(60):
        controller.observe_continuation("context", drafts=8, accepted=8)   # copied spans that hold
        controller.observe_continuation("table", drafts=8, accepted=1)     # right once, then wrong
    reaches = controller.continuation_reaches(("context", "table"), most=8)
    # past the widest measured pass a position costs the measured slope (0.035 s over 4 positions)
    assert reaches == {"context": 8, "table": 1}
    assert controller.chains["table"][:3] == [pytest.approx(1.0, abs=0.01), pytest.approx(0.0, abs=0.01), 0.8]


def test_every_probe_every_th_step_continuations_reach_the_most() -> None:
    costs = LookaheadCosts(verify_seconds={0: 0.1, 4: 0.5}, draft_seconds=0.01)
    controller = LookaheadController(LookaheadConfig(max_k=4, probe_every=3), costs)
    for _ in range(40):
        controller.observe_continuation("context", drafts=4, accepted=0)
    assert [controller.continuation_reaches(("context",), 6)["context"] for _ in range(6)] == [1, 1, 6, 1, 1, 6]


def test_a_measured_reach_caps_a_continuation_unless_the_pass_is_k_wide_anyway() -> None:
    hybrid = _hybrid(8, 1)
    hybrid.reach = {"context": 2, "table": 2}
    proposal = hybrid.propose(_batch([REPEATING]), 0)      # no learned drafts: the pass is as wide as the reach
    assert proposal.drafts.tolist() == [[8, 9]]
    proposal = hybrid.propose(_batch([REPEATING]), 4)      # a token drafter runs at k = 4: 4 positions anyway
    assert hybrid.learned_ran and proposal.drafts.tolist() == [[8, 9, 10, 11]]


def test_greedy_output_equals_the_target_alone_with_measured_reaches() -> None:
    target = tiny_target()
    alone = Engine(target, None, EngineConfig(max_batch=2)).generate(PROMPTS, PARAMS)
    engine = Engine(target, HybridDrafter(tiny_drafter(target), context_k=8), EngineConfig(max_batch=2))
    outputs = engine.generate(PROMPTS, PARAMS)
    assert [s.output_ids for s in outputs] == [s.output_ids for s in alone]
    assert engine.lookahead.chains, "no continuation was measured"
