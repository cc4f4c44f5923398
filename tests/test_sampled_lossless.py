"""Sampled decoding is lossless end to end, whatever the drafter: distribution tests on a tiny target.

Each scenario decodes 3000 seeded requests of one prompt (three tokens each, k = 2, so both
drafts of the first step are verified) and compares their first two tokens with the target's
analytic joint distribution by a chi-square test. The seeds fix the random streams of speculative
sampling (`EngineConfig.seeded_draws` off), except in the scenarios of seeded draws, where each
token is its seed's Gumbel-max draw (`specd.model.seeded_draws`). Each scenario also plants the
bug it is there to catch, and the same statistic over as many samples must reject it: a test that
cannot fail proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import fixed_k, tiny_target
from test_sampling import chi_square_p_value

import specd.engine.engine as engine_module
from specd.drafter.base import Drafter, Proposal, one_hot_q
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import new_feature_drafter
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.token_drafter import DrafterShape, TokenDrafter, new_drafter_model
from specd.engine.engine import Engine
from specd.engine.request import SamplingParams, Sequence
from specd.engine.verification import verify_sampled
from specd.model.distributions import target_probs
from specd.model.seeded_draws import PositionNoise
from specd.model.transformer import ModelConfig, Transformer

SMALL = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=8, max_position=64)
NUM_SAMPLES = 3000  # each planted bug's p-value underflows to 0 at 3000 (measured)
FULL_HEAD = DrafterShape(1, 16, 2, 1, 16)
PARTIAL_HEAD = replace(FULL_HEAD, head_vocab_size=5)  # ids 5..7 are never drafted: q = 0 there
PLAIN = SamplingParams(temperature=1.0, max_tokens=3)
DRAFT_IDS = torch.tensor([6, 2, 0, 5, 3])  # a pruned draft vocabulary, not a prefix: 1, 4, 7 are never drafted


def small_target() -> Transformer:
    return tiny_target(SMALL, seed=5, scale=0.5)


def small_drafter(target: Transformer, shape: DrafterShape = FULL_HEAD, seed: int = 2) -> Transformer:
    return new_drafter_model(target, shape, copy_from_target=False, seed=seed)


def small_feature_drafter(target: Transformer, sampled_drafts: str = "sample") -> FeatureDrafter:
    return FeatureDrafter(new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight,
                                              target.norm.weight, DRAFT_IDS, seed=2), sampled_drafts=sampled_drafts)


def target_joint(target: Transformer, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """P(first two tokens = a, b) under the target alone, flattened to [V * V] (index a * V + b)."""
    vocab = target.config.vocab_size
    temperature, top_p = torch.tensor([params.temperature]), torch.tensor([params.top_p])
    with torch.no_grad():
        logits, _ = target(torch.tensor([prompt]), torch.tensor([0]), target.new_cache(1, len(prompt) + 1))
        p1 = target_probs(logits[:, -1:], temperature, top_p)[0, 0]  # [V]
        contexts = torch.tensor([[*prompt, t] for t in range(vocab)])
        logits, _ = target(contexts, torch.zeros(vocab, dtype=torch.long), target.new_cache(vocab, len(prompt) + 1))
        p2 = target_probs(logits[:, -1:], temperature.expand(vocab), top_p.expand(vocab))[:, 0]  # [V, V]
    return (p1[:, None] * p2).flatten().double()


def distribution_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value, cells with under 5 expected pooled; a sample where p = 0 gives 0."""
    if int(counts[probs == 0].sum()) > 0:
        return 0.0
    keep = probs * counts.sum() >= 5
    rest = ~keep & (probs > 0)
    observed, expected = counts[keep], probs[keep]
    if bool(rest.any()):
        observed = torch.cat([observed, counts[rest].sum().unsqueeze(0)])
        expected = torch.cat([expected, probs[rest].sum().unsqueeze(0)])
    return chi_square_p_value(observed, expected / expected.sum())


def sample(target: Transformer, drafter: Drafter, prompt: list[int], params: SamplingParams,
           between_steps: Callable[[int], None] | None = None,
           seeded_draws: bool = False) -> tuple[torch.Tensor, list[Sequence]]:
    """Decode NUM_SAMPLES seeded requests; counts of their first two tokens over the V * V cells."""
    vocab = target.config.vocab_size
    engine = Engine(target, drafter, fixed_k(max_batch=256, num_draft_tokens=2, seeded_draws=seeded_draws))
    seqs = [engine.add_request(prompt, replace(params, seed=i)) for i in range(NUM_SAMPLES)]
    step = 0
    while engine.has_work:
        engine.step()
        if between_steps is not None:
            between_steps(step)
        step += 1
    cells = torch.tensor([s.output_ids[0] * vocab + s.output_ids[1] for s in seqs])
    return torch.bincount(cells, minlength=vocab * vocab), seqs


def accept_every_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the verifier accepts every draft the target gives any probability."""
    def accepting(p, q, drafts, limit, accept_uniforms, resample_uniforms):
        return verify_sampled(p, q, drafts, limit, torch.zeros_like(accept_uniforms), resample_uniforms)

    monkeypatch.setattr(engine_module, "verify_sampled", accepting)


def ignore_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the verifier's p is the full softmax, not the top-p nucleus the request asked for."""
    def full_softmax(logits, temperature, top_p):
        return target_probs(logits, temperature, torch.ones_like(top_p))

    monkeypatch.setattr(engine_module, "target_probs", full_softmax)


def noise_of_one_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a seeded request's noise is the same at every position, not drawn per position."""
    at = PositionNoise.at
    monkeypatch.setattr(PositionNoise, "at", lambda self, position: at(self, 0))


def uniform_q_for_matched_rows(hybrid: HybridDrafter) -> Callable[[Proposal], Proposal]:
    """Planted bug: context-matched rows' drafts are deterministic, but their q is left a spread-out one
    (also at steps where every row matched and the learned drafter sat out, leaving q None: one-hot)."""
    def tamper(proposal: Proposal) -> Proposal:
        q = proposal.q if proposal.q is not None else one_hot_q(proposal.drafts, SMALL.vocab_size)
        matched = torch.tensor([s.startswith("context") for s in hybrid.row_sources])
        uniform = torch.full_like(q, 1 / q.shape[-1])
        return replace(proposal, q=torch.where(matched[:, None, None], uniform, q))
    return tamper


def misaligned_q(proposal: Proposal) -> Proposal:
    """Planted bug: a partial head's q padded on the wrong side, so q(id) is read from another id."""
    assert proposal.q is not None
    missing = SMALL.vocab_size - (PARTIAL_HEAD.head_vocab_size or SMALL.vocab_size)
    return replace(proposal, q=proposal.q.roll(missing, dims=-1))


def unmapped_q(proposal: Proposal) -> Proposal:
    """Planted bug: a pruned head's q left in draft-vocabulary order, so q(id i) is read from draft index i."""
    assert proposal.q is not None
    unmapped = torch.zeros_like(proposal.q)
    unmapped[..., :len(DRAFT_IDS)] = proposal.q[..., DRAFT_IDS]
    return replace(proposal, q=unmapped)


@dataclass(frozen=True)
class Scenario:
    prompt: list[int]
    params: SamplingParams
    drafter: Callable[[Transformer], Drafter]
    plant: Callable[[pytest.MonkeyPatch, Drafter], None]  # plants the bug the scenario must catch
    swap_every_step: bool = False  # offer the other of two drafter models between every two steps
    seeded_draws: bool = False     # tokens are the seeds' Gumbel-max draws, drafts coupled to them


def tampered_with(make_tamper: Callable[[Drafter], Callable[[Proposal], Proposal]]):
    """A plant that passes the drafter's proposals through a tamper before the engine verifies them."""
    def plant(monkeypatch: pytest.MonkeyPatch, drafter: Drafter) -> None:
        propose, tamper = drafter.propose, make_tamper(drafter)
        monkeypatch.setattr(drafter, "propose", lambda batch, k: tamper(propose(batch, k)))
    return plant


def patched(patch: Callable[[pytest.MonkeyPatch], None]):
    return lambda monkeypatch, drafter: patch(monkeypatch)


SCENARIOS = {
    # a learned drafter over the whole vocabulary, sampling from its own q
    "learned": Scenario([1, 2, 3], PLAIN, lambda t: TokenDrafter(small_drafter(t)), patched(accept_every_draft)),
    # "1 2" occurred before: the first drafts are the context match [3, 1] with one-hot q, later ones learned
    "hybrid": Scenario([1, 2, 3, 1, 2], PLAIN, lambda t: HybridDrafter(TokenDrafter(small_drafter(t))),
                       tampered_with(uniform_q_for_matched_rows)),
    # the feature drafter over a pruned, reordered draft vocabulary: q is scattered back to target ids
    "feature": Scenario([1, 2, 3], PLAIN, small_feature_drafter, tampered_with(lambda drafter: unmapped_q)),
    # sampled rows drafted by argmax (one-hot drafts, what the learner's gate replays), both drafters
    "feature-argmax": Scenario([1, 2, 3], PLAIN, lambda t: small_feature_drafter(t, "argmax"),
                               patched(accept_every_draft)),
    "learned-argmax": Scenario([1, 2, 3], PLAIN, lambda t: TokenDrafter(small_drafter(t), sampled_drafts="argmax"),
                               patched(accept_every_draft)),
    "partial-head": Scenario([1, 2, 3], PLAIN, lambda t: TokenDrafter(small_drafter(t, PARTIAL_HEAD)),
                             tampered_with(lambda drafter: misaligned_q)),
    "top-p": Scenario([1, 2, 3], SamplingParams(temperature=0.8, top_p=0.8, max_tokens=3),
                      lambda t: TokenDrafter(small_drafter(t)), patched(ignore_top_p)),
    # new weights (of another shape) every step: every row rebuilds its drafter cache at once and drafts
    "swapped": Scenario([1, 2, 3], PLAIN, lambda t: TokenDrafter(small_drafter(t), catchup_tokens_per_step=10**6),
                        patched(accept_every_draft), swap_every_step=True),
    # seeded draws: the drafters draw with the seed's noise, the target's draw decides
    "seeded-top-p": Scenario([1, 2, 3], SamplingParams(temperature=0.8, top_p=0.8, max_tokens=3),
                             small_feature_drafter, patched(ignore_top_p), seeded_draws=True),
    "seeded-hybrid": Scenario([1, 2, 3, 1, 2], PLAIN, lambda t: HybridDrafter(TokenDrafter(small_drafter(t))),
                              patched(noise_of_one_position), seeded_draws=True),
}


def swapper(target: Transformer, drafter: Drafter) -> Callable[[int], None]:
    """Between steps, offer the other of two drafter models (two shapes): a new version every step."""
    assert isinstance(drafter, TokenDrafter)
    models = [small_drafter(target, PARTIAL_HEAD, seed=3), small_drafter(target, FULL_HEAD, seed=4)]
    return lambda step: drafter.offer(models[step % 2], step + 1)


def run_scenario(scenario: Scenario, drafter: Drafter, target: Transformer) -> tuple[float, list[Sequence]]:
    between_steps = swapper(target, drafter) if scenario.swap_every_step else None
    counts, seqs = sample(target, drafter, scenario.prompt, scenario.params, between_steps, scenario.seeded_draws)
    return distribution_p_value(counts, target_joint(target, scenario.prompt, scenario.params)), seqs


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sampled_output_follows_the_target_distribution(name: str) -> None:
    scenario, target = SCENARIOS[name], small_target()
    drafter = scenario.drafter(target)
    p_value, seqs = run_scenario(scenario, drafter, target)
    assert p_value > 1e-3
    # the drafter took part: drafts were verified at both positions and accepted
    assert all(len(s.steps[0].drafts) == 2 for s in seqs)
    assert sum(s.num_drafts_accepted for s in seqs) > NUM_SAMPLES // 10
    if isinstance(drafter, HybridDrafter):
        assert all(s.steps[0].drafts == (3, 1) for s in seqs)  # the context match, for every request
    if name == "partial-head":
        assert max(d for s in seqs for step in s.steps for d in step.drafts) < 5  # only ids the head covers
    if name == "feature":
        assert {d for s in seqs for step in s.steps for d in step.drafts} <= set(DRAFT_IDS.tolist())
    if scenario.swap_every_step:
        assert isinstance(drafter, TokenDrafter)
        assert drafter.num_swaps == len({step.drafter_version for s in seqs for step in s.steps}) - 1


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_distribution_test_rejects_the_planted_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scenario, target = SCENARIOS[name], small_target()
    drafter = scenario.drafter(target)
    scenario.plant(monkeypatch, drafter)
    p_value, _ = run_scenario(scenario, drafter, target)
    assert p_value < 1e-6
