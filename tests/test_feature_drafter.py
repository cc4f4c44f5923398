"""The feature drafter in the engine: lossless greedy output, real acceptance, captured features,
weight swaps and batch compaction, on tiny float64 targets.

The sampled-mode distribution test with a pruned draft vocabulary is in test_sampled_lossless.py."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import fixed_k, tiny_drafter, tiny_target

from specd.core.errors import BadWeights
from specd.drafter.base import DraftBatch, Proposal
from specd.drafter.factory import DrafterSpec, build_drafter
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.drafter.hybrid import HybridDrafter
from specd.engine.engine import Engine, EngineConfig
from specd.engine.request import SamplingParams, Sequence, VerifyStep, record_from_sequence
from specd.learner.feature_signal import collate, feature_loss, label_rows
from specd.model.transformer import Transformer
from specd.testing import learnable_target

# different lengths, a one-token prompt (no features before its first step) and a repeated token
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [4], [12, 13], [20, 30, 40, 50], [7] * 9]
GREEDY = SamplingParams(max_tokens=30)


def feature_model(target: Transformer, vocab: int | None = None, seed: int = 1,
                  capture_layers: tuple[int, ...] | None = None, num_layers: int = 1) -> FeatureDrafterModel:
    """A day-0 feature drafter over the first `vocab` ids (all of them by default)."""
    ids = torch.arange(vocab or target.config.vocab_size)
    return new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight, ids,
                               capture_layers, seed=seed, num_layers=num_layers)


def random_feature_model(target: Transformer, vocab: int | None = None, seed: int = 1,
                         num_layers: int = 1) -> FeatureDrafterModel:
    """A float64 feature drafter with loud random weights: every input (attention over its cache
    included) moves its argmax, so drafts compared exactly catch a wrong cache entry."""
    model = feature_model(target, vocab, seed, num_layers=num_layers).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.3)
    return model


def target_only(target: Transformer, prompts: list[list[int]] = PROMPTS,
                params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    engine = Engine(target, None, EngineConfig(max_batch=len(prompts)))
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
    while engine.has_work:
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.fixture(scope="module")
def learnable() -> Transformer:
    return learnable_target()


@pytest.fixture(scope="module")
def trained(learnable: Transformer) -> FeatureDrafterModel:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest's one_torch_thread, which module fixtures run before
    try:
        return train_briefly(learnable)
    finally:
        torch.set_num_threads(threads)


def train_briefly(target: Transformer, steps: int = 300) -> FeatureDrafterModel:
    """A feature drafter trained for a moment on the learnable target: right often, not always."""
    model = feature_model(target, seed=2).train()
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight)
    # the next token's embedding reaches EAGLE-3's layer through attention only: this toy target's
    # rule (the successor of the next token) takes a few hundred steps to find
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        # any token sequence will do: the labels are the target's own distributions
        tokens = torch.randint(0, target.config.vocab_size, (16, 24), generator=generator)
        with torch.no_grad():
            features = target.train_features(tokens, model.config.capture_layers).float()
        batch = collate([(tokens[i], features[i], torch.ones(24)) for i in range(len(tokens))])
        loss, _ = feature_loss(model, batch, rows, steps=3)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model.eval()


def hybrid(drafter: FeatureDrafter) -> HybridDrafter:
    return HybridDrafter(drafter, window=0)  # no context matches: every row drafts with the feature drafter


WRAPS: dict[str, Callable[[FeatureDrafter], FeatureDrafter | HybridDrafter]] = {"plain": lambda d: d, "hybrid": hybrid}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_greedy_output_identical_to_target_only(k: int, wrap: str) -> None:
    target = tiny_target()
    drafter = WRAPS[wrap](FeatureDrafter(feature_model(target)))
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=k))
    assert engine.capture_layers == (0, 1)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == target_only(target)


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_trained_drafter_is_accepted_and_rows_accept_different_counts(
        learnable: Transformer, trained: FeatureDrafterModel, wrap: str) -> None:
    engine = Engine(learnable, WRAPS[wrap](FeatureDrafter(trained)), fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == target_only(learnable)
    assert sum(s.num_drafts_accepted for s in seqs) > 0.5 * sum(s.num_drafts_proposed for s in seqs)
    assert len({step.num_accepted for s in seqs for step in s.steps}) > 2
    # the one-token prompt has no features before its first step: it drafts nothing there, then drafts
    assert seqs[2].steps[0].drafts == () and seqs[2].num_drafts_accepted > 0


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_greedy_output_identical_across_weight_swaps(wrap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target()
    # two shapes (a swap needs a new cache); float64, so that drafts can be compared exactly
    models = {i: random_feature_model(target, vocab, seed=i) for i, vocab in enumerate((96, 50, 96))}
    # a small catch-up budget: after each swap, long rows rebuild their cache over several steps
    learned = FeatureDrafter(models[0], 0, catchup_tokens_per_step=6)
    drafter = WRAPS[wrap](learned)
    engine = Engine(target, drafter, fixed_k(max_batch=4, num_draft_tokens=3))
    seen = trace(engine, learned, models.values(), monkeypatch)
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    step = offers = 0
    while engine.has_work:
        engine.step()
        step += 1
        if step % 2 == 0 and engine.has_work:  # each offer is taken by the next step's proposal
            offers += 1
            version = offers % len(models)
            drafter.offer(models[version], version)
    assert learned.num_swaps == offers >= 5
    assert [s.output_ids for s in seqs] == target_only(target)
    assert any(step.drafts == () for s in seqs for step in s.steps[1:])  # rows waited while catching up
    assert_drafting_is_unrolled(seqs, seen, models)


def test_swap_to_weights_reading_other_layers_stays_lossless() -> None:
    target = tiny_target()
    drafter = FeatureDrafter(feature_model(target, capture_layers=(1,)))
    engine = Engine(target, drafter, fixed_k(max_batch=2, num_draft_tokens=3))
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    engine.step()
    drafter.offer(feature_model(target, capture_layers=(0, 1)), 1)
    while engine.has_work:
        engine.step()
    assert engine.capture_layers == (0, 1)
    assert [s.output_ids for s in seqs] == target_only(target)
    # rows in flight lost their features and draft nothing; requests admitted after the swap draft
    assert all(step.drafts == () for step in seqs[0].steps[1:])
    assert any(step.drafts for step in seqs[-1].steps)


def test_swap_to_other_layers_during_a_chunked_prefill_fails_no_request() -> None:
    target = tiny_target()
    drafter = FeatureDrafter(feature_model(target, capture_layers=(1,)))
    long_prompt = [(5 * i + 2) % 90 + 1 for i in range(23)]
    prompts = [[1, 2, 3], long_prompt, [4, 5]]
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=3, prefill_chunk=4, record_features=True))
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()  # the long prompt is part-way into the cache, its chunks captured at layer 1
    assert engine.prefilling is not None and engine.prefilling.filled > 0
    drafter.offer(feature_model(target, capture_layers=(0, 1)), 1)
    while engine.has_work:
        engine.step()
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [s.output_ids for s in seqs] == target_only(target, prompts)
    # the part-filled prompt lost its layer-1 features: it drafts nothing and its record carries none
    assert all(step.drafts == () for step in seqs[1].steps)
    assert [record_from_sequence(s, "s", 0.0).features is None for s in seqs] == [True, True, False]


def test_verification_features_equal_whole_sequence_features(monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target()
    drafter = FeatureDrafter(feature_model(target))
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4, record_features=True))
    seen = trace(engine, drafter, (), monkeypatch)
    seqs = engine.generate(PROMPTS, GREEDY)
    for seq in seqs:
        tokens = torch.tensor([seq.prompt_ids + seq.output_ids])
        expected = target.train_features(tokens[:, :-1], drafter.capture_layers)[0]  # positions 0..n-2
        torch.testing.assert_close(torch.cat(seen.features[seq.request_id]), expected, atol=1e-10, rtol=1e-10)
        record = record_from_sequence(seq, "test", time.time())
        assert record.features is not None
        torch.testing.assert_close(torch.from_numpy(record.features.array().copy()), expected.half(),
                                   atol=1e-3, rtol=1e-3)


def test_history_holds_the_features_of_the_verified_positions(learnable: Transformer,
                                                              trained: FeatureDrafterModel) -> None:
    drafter = FeatureDrafter(trained)
    engine = Engine(learnable, drafter, fixed_k(max_batch=6, num_draft_tokens=4))
    seqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    assert sum(s.num_drafts_accepted for s in seqs) > 0  # drafts were accepted: the history grew by steps
    for slot, seq in enumerate(engine.running):
        tokens = torch.tensor([seq.prompt_ids + seq.output_ids])
        expected = learnable.train_features(tokens[:, :-1], trained.config.capture_layers)[0]
        torch.testing.assert_close(drafter.history(slot), expected.half(), atol=1e-3, rtol=1e-3)


def test_batch_compaction_keeps_each_row_drafting_as_if_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target()
    model = random_feature_model(target)  # float64: batching changes no argmax
    params = [SamplingParams(max_tokens=n) for n in (5, 30, 12, 3, 25, 18)]
    drafter = FeatureDrafter(model)
    moves: list[tuple[int, int]] = []
    move = drafter.move

    def spy(src: int, dst: int) -> None:
        moves.append((src, dst))
        move(src, dst)

    monkeypatch.setattr(drafter, "move", spy)
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4))
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while engine.has_work:
        engine.step()
    assert moves  # rows finished out of order: the batch was compacted
    assert [s.output_ids for s in seqs] == target_only(target, PROMPTS, params)
    for prompt, sp, seq in zip(PROMPTS, params, seqs, strict=True):
        alone = Engine(target, FeatureDrafter(model), fixed_k(max_batch=1, num_draft_tokens=4))
        solo = alone.generate([prompt], sp)[0]
        assert [step.drafts for step in seq.steps] == [step.drafts for step in solo.steps]


def unsure(trained: FeatureDrafterModel) -> FeatureDrafterModel:
    """The trained drafter in float64 with noise on its attention: right about half the time, so
    rows accept several drafts at some steps and one at others."""
    model = copy.deepcopy(trained).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.attn.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    return model


@pytest.mark.parametrize("chunk", [None, 3])   # 3: prompts prefilled over several steps, features chunk by chunk
@pytest.mark.parametrize("name", ["random", "unsure", "random, two layers"])
def test_drafting_computes_what_training_unrolls(name: str, chunk: int | None, learnable: Transformer,
                                                 trained: FeatureDrafterModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # a random drafter is rarely accepted (rows feed one entry a step); a trained one often is (several)
    if name.startswith("random"):
        target = tiny_target()
        model = random_feature_model(target, vocab=60, num_layers=2 if "two" in name else 1)
    else:
        target, model = learnable, unsure(trained)
    params = [SamplingParams(max_tokens=n) for n in (9, 30, 12, 4, 25, 18)]
    drafter = FeatureDrafter(model, 0)
    engine = Engine(target, drafter, fixed_k(max_batch=3, num_draft_tokens=4, prefill_chunk=chunk))  # moves
    seen = trace(engine, drafter, [model], monkeypatch)
    seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    while engine.has_work:
        engine.step()
    assert_drafting_is_unrolled(seqs, seen, {0: model})
    if name == "unsure":
        assert sum(step.num_accepted >= 2 for s in seqs for step in s.steps) >= 5


@dataclass
class Trace:
    """What a feature drafter was given and what it computed, per request id."""

    features: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # [n, F] chunks, in position order
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)    # per step: [k, N], one row a draft


def trace(engine: Engine, drafter: FeatureDrafter, models: Iterable[FeatureDrafterModel],
          monkeypatch: pytest.MonkeyPatch) -> Trace:
    """Spy on the features the drafter is given and the logits its models draft from."""
    seen = Trace()
    observe, propose = drafter.observe, drafter.propose

    def observe_spy(slot: int, start: int, features: torch.Tensor) -> None:
        chunks = seen.features.setdefault(engine.running[slot].request_id, [])
        assert start == sum(len(c) for c in chunks)  # every position once, in order
        chunks.append(features.clone())
        observe(slot, start, features)

    step_logits: list[list[torch.Tensor]] = []  # the current proposal's, per row

    def propose_spy(batch: DraftBatch, k: int) -> Proposal:
        step_logits[:] = [[] for _ in range(batch.num_rows)]
        proposal = propose(batch, k)
        for seq, logits in zip(engine.running, step_logits, strict=True):
            if logits:  # models spied on
                seen.logits.setdefault(seq.request_id, []).append(torch.stack(logits))
        return proposal

    def logits_spy(logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def spy(state: torch.Tensor) -> torch.Tensor:
            logits = logits_of(state)  # [B, 1, N]
            for row, row_logits in enumerate(logits[:, 0]):
                step_logits[row].append(row_logits)
            return logits
        return spy

    monkeypatch.setattr(drafter, "observe", observe_spy)
    monkeypatch.setattr(drafter, "propose", propose_spy)
    for model in models:
        monkeypatch.setattr(model, "logits", logits_spy(model.logits))
    return seen


def assert_drafting_is_unrolled(seqs: list[Sequence], seen: Trace, models: dict[int, FeatureDrafterModel],
                                proposed_at: Callable[[VerifyStep], bool] = lambda step: True) -> None:
    """Every proposal of a row that drafted computed what training's `unrolled` computes from the
    same features and chain tokens: the serving cache (catch-up, blocks, chain, moves) is exact.
    `proposed_at`: the steps at which the feature drafter proposed (all, unless a hybrid skipped it)."""
    num_checked = 0
    for seq in seqs:
        tokens = seq.prompt_ids + seq.output_ids
        features = torch.cat(seen.features[seq.request_id]).half()  # as the drafter stores them
        proposed = [step for step in seq.steps if proposed_at(step)]
        for step, logits in zip(proposed, seen.logits[seq.request_id], strict=True):
            if not step.drafts:  # not ready (or no tokens left to draft): its logits mean nothing
                continue
            model, length, k = models[step.drafter_version], step.position, len(logits)
            drafts = model.draft_ids[logits.argmax(-1)].tolist()
            assert tuple(drafts[:len(step.drafts)]) == step.drafts
            chain = torch.tensor([tokens[:length] + drafts[:-1]])  # x_0..x_{L-1}, then d_1..d_{k-1}
            # only features 0..L-2 are read: later entries run on the chain's own states
            entries = torch.cat([features[:length - 1], features.new_zeros(k - 1, features.shape[1])])
            with torch.no_grad():
                outputs = model.unrolled(entries[None].to(torch.float64), chain[:, 1:], k)
                expected = torch.stack([model.head(model.norm(outputs[j][0, length - 2 + j])) for j in range(k)])
            torch.testing.assert_close(logits, expected, atol=1e-9, rtol=1e-9)
            num_checked += 1
    assert num_checked > 20


def test_a_hybrid_skips_its_feature_drafter_where_a_continuation_serves_the_row_and_catches_up_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    target = tiny_target()
    model = random_feature_model(target, vocab=60)
    drafter = FeatureDrafter(model, 0)
    engine = Engine(target, HybridDrafter(drafter), fixed_k(max_batch=1, num_draft_tokens=3))
    seen = trace(engine, drafter, [model], monkeypatch)
    seqs = engine.generate(PROMPTS, GREEDY)
    assert [s.output_ids for s in seqs] == target_only(target)
    continued = [step for s in seqs for step in s.steps if step.source.startswith(("context", "table"))]
    assert len(continued) >= 5, "no step was served by a continuation: nothing was skipped"
    # at batch 1 the feature drafter proposed exactly where no continuation served the row, and each
    # proposal after skipped steps drafted from a cache caught up to the verified features
    assert_drafting_is_unrolled(seqs, seen, {0: model},
                                proposed_at=lambda step: not step.source.startswith(("context", "table")))


def test_a_version_offered_while_continuations_serve_every_row_goes_live_at_the_next_step() -> None:
    target = tiny_target()
    drafter = FeatureDrafter(random_feature_model(target, vocab=60), 0)
    hybrid = HybridDrafter(drafter)
    hybrid.bind(1, 64, torch.device("cpu"))
    tokens = torch.zeros(1, 64, dtype=torch.long)
    tokens[0, :12] = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7])  # "5 6 7" again: a context match
    batch = DraftBatch(tokens, torch.tensor([12]), [12], ["r0"], torch.zeros(1), torch.ones(1), [])
    hybrid.offer(random_feature_model(target, vocab=60, seed=2), 7)
    proposal = hybrid.propose(batch, 3)
    assert not hybrid.learned_ran and hybrid.row_sources == ["context3"]
    assert proposal.drafts.tolist() == [[8, 9, 10]] and hybrid.version == 7


def test_build_drafter_serves_a_feature_model_behind_context_matching() -> None:
    target = tiny_target()
    drafter = build_drafter(DrafterSpec(kind="hybrid"), feature_model(target), 7)
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.learned, FeatureDrafter)
    assert drafter.version == 7 and drafter.capture_layers == (0, 1)
    learned = build_drafter(DrafterSpec(kind="learned"), feature_model(target), 7)
    assert isinstance(learned, FeatureDrafter)


def test_weights_of_the_other_kind_are_refused() -> None:
    target = tiny_target()
    with pytest.raises(BadWeights):
        FeatureDrafter(feature_model(target)).offer(target, 1)
    with pytest.raises(BadWeights):
        tiny_drafter(target).offer(feature_model(target), 1)
    assert HybridDrafter(tiny_drafter(target)).capture_layers == ()
