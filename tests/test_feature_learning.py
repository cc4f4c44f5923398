"""The learner training a feature drafter (EAGLE-3 style) on the target's own hidden states.

On `learnable_target` (greedy continuation: token t -> successor[t]) the feature drafter learns
to high acceptance within tens of steps, from id-only records (features recomputed once per
record with the learner's copy of the target) as from records that carry the features. Misses
weigh more in its loss, and the gate refuses a candidate that is worse than live or not finite.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specd.core.errors import ConfigurationError
from specd.core.records import FeatureBlock, StepRecord, TrajectoryRecord, validate_record
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.hotswap.store import WeightStore
from specd.learner.config import LearnerConfig
from specd.learner.feature_signal import collate, feature_loss, label_rows
from specd.learner.head_loss import head_cross_entropy, target_labels
from specd.learner.learner import Learner
from specd.learner.objectives import FeatureObjective
from specd.model import packed_linear
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer
from specd.testing import learnable_target
from specd.transport.bus import InProcessBus

VOCAB = 96
STEPS = 100  # learner steps in which a feature drafter learns this target (3.9 at 100 steps, seed 0)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return learnable_target(VOCAB).float()


@torch.no_grad()
def greedy(target: Transformer, prompt: list[int], count: int) -> list[int]:
    """The target's greedy continuation (whole-sequence passes: no engine involved)."""
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(target.train_logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def greedy_records(target: Transformer, count: int, seed: int, max_tokens: int = 16,
                   cover: bool = False) -> list[TrajectoryRecord]:
    """Id-only greedy records; with `cover`, prompt i ends in token i, so every successor is seen."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        if cover:
            prompt[-1] = i % VOCAB
        records.append(TrajectoryRecord(f"{seed}-{i}", "test", prompt, greedy(target, prompt, max_tokens), [],
                                        0.0, 1.0, 0.0, 0.0))
    return records


@torch.no_grad()
def with_features(target: Transformer, record: TrajectoryRecord, capture: tuple[int, ...]) -> TrajectoryRecord:
    """The record as a server that captures features ships it: the features of ids[:-1], fp16."""
    ids = torch.tensor((record.prompt_ids + record.output_ids)[:-1])
    features = target.train_features(ids[None], capture)[0].to(torch.float16)
    return replace(record, features=FeatureBlock.of(features.numpy()))


def fresh_feature_drafter(target: Transformer, seed: int = 0) -> FeatureDrafterModel:
    return new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                               torch.arange(VOCAB), seed=seed)


def learner_config(**fields) -> LearnerConfig:
    # EAGLE-3's layer sees the next token's embedding through attention only: on this toy target it
    # needs a higher rate than the token drafter to find the successor rule within 100 steps
    settings = {"learning_rate": 3e-3, "feature_learning_rate": 1e-2, "batch_size": 8, "duty_cycle": 1.0,
                "publish_every_steps": 10**9, "publish_every_seconds": 1e9, "holdout_every": 10**9,
                "min_records": 1, **fields}
    return LearnerConfig(**settings)


def new_learner(tmp_path: Path, target: Transformer, initial, records: list[TrajectoryRecord],
                **fields) -> Learner:
    bus = InProcessBus()
    learner = Learner(learner_config(**fields), bus, WeightStore(tmp_path), initial,
                      TargetFingerprint.of(target.config), torch.float32, target.embed.weight, target=target)
    for record in records:
        bus.publish(record.to_dict())
    assert learner.intake() == len(records)
    return learner


def accept_length_after(learner: Learner, steps: int, held_out: list[TrajectoryRecord]) -> float:
    for _ in range(steps):
        learner.train_step()
    return learner.simulated_accept_length(learner.model, held_out)


def test_feature_drafter_reaches_high_acceptance_from_day_0(tmp_path: Path, target) -> None:
    # (the token drafter, copied from this toy target, learns its successor rule as fast: the
    # feature drafter's lead is measured on SmolLM2 by benchmarks/learning_curve.py, not here)
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, 12, seed=99)
    feature = new_learner(tmp_path / "feature", target, fresh_feature_drafter(target), train)
    before = feature.simulated_accept_length(feature.model, held_out)
    feature_after = accept_length_after(feature, STEPS, held_out)
    assert before < 1.5, before
    assert feature_after >= 3.0, (before, feature_after)



def test_an_anchored_learner_is_pulled_back_toward_the_version_it_started_from_or_adopted(tmp_path: Path,
                                                                                             target) -> None:
    train = greedy_records(target, 16, seed=0)
    start = fresh_feature_drafter(target)
    adopted = fresh_feature_drafter(target, seed=1)
    pull = 0.25
    free, anchored = (new_learner(tmp_path / name, target, start.clone(), train, anchor_pull=a)
                      for name, a in (("free", 0.0), ("anchored", pull)))

    def one_step_each(anchor: FeatureDrafterModel) -> None:
        free.train_step()
        anchored.train_step()
        # the same batch and optimiser state, so the same step; the anchored one then moves a quarter
        # of the way back to its anchor
        anchor_weights, free_weights = dict(anchor.named_parameters()), dict(free.model.named_parameters())
        for name, weight in anchored.model.named_parameters():
            expected = torch.lerp(free_weights[name], anchor_weights[name].float(), pull)
            assert torch.allclose(weight, expected, atol=1e-6), name

    one_step_each(start)
    for learner in (free, anchored):
        assert learner.trainer.take_weights(adopted.clone())
    one_step_each(adopted)


@pytest.mark.parametrize("anchor", ["live", "start"])
def test_the_anchor_follows_the_learners_own_versions_that_go_live_unless_it_is_the_start(
        tmp_path: Path, target, anchor: str) -> None:
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, len(train), seed=99)
    interleaved = [r for pair in zip(train, held_out, strict=True) for r in pair]
    start = fresh_feature_drafter(target)
    learner = new_learner(tmp_path, target, start.clone(), interleaved, holdout_every=2, anchor_pull=0.05,
                          anchor=anchor)
    for _ in range(STEPS):
        learner.train_step()
    version = learner.maybe_publish(force=True)
    assert version is not None and learner.store.live_version() == version
    start_weights = [p.float() for p in start.parameters() if p.requires_grad]
    live_weights = learner.trainer._params  # no step since the candidate was cloned: the live version's
    anchored_to = learner.trainer._anchor or []
    assert not all(torch.equal(w, s) for w, s in zip(live_weights, start_weights, strict=True))  # it learned
    expected = live_weights if anchor == "live" else start_weights
    assert all(torch.equal(a, e) for a, e in zip(anchored_to, expected, strict=True))


def test_with_a_confidence_bound_a_version_that_learned_passes_on_paired_evidence(tmp_path: Path, target) -> None:
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, len(train), seed=99)
    interleaved = [r for pair in zip(train, held_out, strict=True) for r in pair]
    learner = new_learner(tmp_path, target, fresh_feature_drafter(target), interleaved, holdout_every=2,
                          gate_confidence_z=1.64, gate_margin=0.0)
    for _ in range(STEPS):
        learner.train_step()
    version = learner.maybe_publish(force=True)
    assert version is not None and learner.store.live_version() == version
    verdict = learner.stats.published[-1]
    assert verdict["held_out_records"] == LearnerConfig.holdout_capacity  # the newest held out
    assert verdict["lower_bound"] > 0.5 and verdict["candidate"] > verdict["live"] + 0.5


def test_anchor_pull_outside_0_to_1_and_an_unknown_anchor_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="anchor_pull"):
        LearnerConfig(anchor_pull=1.0)
    with pytest.raises(ConfigurationError, match="anchor must be"):
        LearnerConfig(anchor="newest")


def test_a_learner_under_bf16_autocast_learns_as_well(tmp_path: Path, target) -> None:
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, 12, seed=99)
    learner = new_learner(tmp_path, target, fresh_feature_drafter(target), train, precision="bfloat16")
    assert accept_length_after(learner, STEPS, held_out) >= 3.0
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())  # the weights stay float32

def test_trains_on_id_only_records_by_recomputing_their_features_once(tmp_path: Path, target) -> None:
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, 12, seed=99)
    learner = new_learner(tmp_path, target, fresh_feature_drafter(target), train)
    objective = learner.objective
    assert isinstance(objective, FeatureObjective)
    assert objective.recompute_stats["records"] == 0  # nothing computed before it is needed
    after = accept_length_after(learner, STEPS, held_out)
    assert after >= 3.0
    # every record's features (trained on, or replayed for the accept length) were computed once
    # and then kept: asking for all of them again recomputes only those no batch had sampled yet,
    # and the totals count each record once, however often batches drew it
    objective.features(list(learner.buffer))
    stats = objective.recompute_stats
    assert stats["records"] == len(train) + len(held_out)
    assert stats["tokens"] == sum(r.num_tokens - 1 for r in train + held_out)
    assert stats["seconds"] is not None and stats["seconds"] >= 0


def test_trains_on_records_that_carry_features_without_recomputing(tmp_path: Path, target) -> None:
    capture = fresh_feature_drafter(target).config.capture_layers
    ids_only = greedy_records(target, VOCAB, seed=0, cover=True)
    carrying = [with_features(target, r, capture) for r in ids_only]
    held_out = greedy_records(target, 12, seed=99)
    learner = new_learner(tmp_path / "carried", target, fresh_feature_drafter(target), carrying)
    objective = learner.objective
    assert isinstance(objective, FeatureObjective)
    # the carried features are exactly what the learner would have recomputed
    recomputer = FeatureObjective(target, torch.arange(VOCAB), capture)
    for record in (carrying[0], carrying[-1]):
        stripped = replace(record, features=None)
        assert torch.equal(objective.features([record])[0], recomputer.features([stripped])[0])
    losses = [learner.train_step() for _ in range(STEPS)]
    assert objective.recompute_stats["records"] == 0 and objective.recompute_stats["tokens"] == 0
    assert learner.simulated_accept_length(learner.model, held_out) >= 3.0
    # and it is the same training as from ids: identical features, identical losses
    twin = new_learner(tmp_path / "ids", target, fresh_feature_drafter(target), ids_only)
    assert [twin.train_step() for _ in range(STEPS)] == pytest.approx(losses, rel=1e-5)
    assert twin.objective.recompute_stats["records"] > 0


def test_a_record_with_features_of_only_some_positions_is_recomputed(tmp_path: Path, target) -> None:
    capture = fresh_feature_drafter(target).config.capture_layers
    full = with_features(target, greedy_records(target, 1, seed=5)[0], capture)
    assert full.features is not None
    partial = replace(full, record_id="partial", features=FeatureBlock.of(full.features.array()[:4]))
    objective = FeatureObjective(target, torch.arange(VOCAB), capture)
    found = objective.features([full, partial])
    assert objective.recompute_stats["records"] == 1
    assert torch.equal(found[0], found[1])


def test_misses_weigh_more_at_the_prediction_of_the_replacement_token(target, monkeypatch) -> None:
    # the no-gradient replay below is compared with the loss to 1e-4: both in float32 weights (a
    # served drafter's kernel reads them in fp16)
    monkeypatch.setattr(packed_linear, "_HALF_WEIGHTS", False)
    prompt = [5, 17, 40]
    output = greedy(target, prompt, 10)
    ids = prompt + output
    wrong = (output[2] + 1) % VOCAB
    steps = [StepRecord(3, [output[0], output[1], wrong], 2, 1),   # miss: ids[5] replaced the third draft
             StepRecord(6, [output[3], output[4]], 2, 1),          # all accepted: no miss
             StepRecord(9, [(output[6] + 1) % VOCAB], 0, 1)]       # miss: ids[9] replaced the only draft
    record = TrajectoryRecord("r", "test", prompt, output, steps, 0.0, 1.0, 0.0, 0.0)
    validate_record(record.to_dict(), VOCAB)  # a well-formed record
    capture = fresh_feature_drafter(target).config.capture_layers
    objective = FeatureObjective(target, torch.arange(VOCAB), capture, miss_weight=3.0, prompt_weight=0.25)
    weights = objective._weights(record)
    assert len(weights) == len(ids)
    # weights[i] weighs the prediction of token i + 1: the prompt's own tokens count less, the
    # replacement tokens (ids[5], ids[9]) count miss_weight, everything else 1
    expected = [0.25, 0.25] + [1.0] * (len(ids) - 2)
    expected[4] = expected[8] = 3.0
    assert weights == expected

    # and in the loss, weight i lands on the label the target gives for token i + 1: a one-hot
    # weight at i is exactly the KL of the entry that predicts ids[i + 1] against that label
    model = fresh_feature_drafter(target).float()
    with torch.no_grad():
        features = target.train_features(torch.tensor([ids[:-1]]), capture)[0].float()
    tokens = torch.tensor(ids[:-1])
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight)
    for i in (4, 8):
        one_hot = torch.zeros(len(tokens))
        one_hot[i] = 1.0
        loss, _ = feature_loss(model, collate([(tokens, features, one_hot)]), rows, steps=1)
        last = features[i, -rows.shape[1]:]
        label = F.log_softmax(F.rms_norm(last, (len(last),), eps=model.config.rms_norm_eps) @ rows.T, dim=-1)
        assert int(model.draft_ids[label.argmax()]) == ids[i + 1]  # the target's choice: the replacement
        with torch.no_grad():
            entry = model.unrolled(features[None, :-1], tokens[None, 1:], 1)[0][0, i - 1]
            drafted = F.log_softmax(model.logits(entry), dim=-1)
        assert float(loss.detach()) == pytest.approx(float((label.exp() * (label - drafted)).sum()), rel=1e-4)


def test_tokens_context_matching_drafted_weigh_less_and_only_the_learned_drafters_misses_weigh_more(target) -> None:
    prompt = [5, 17, 40]
    output = greedy(target, prompt, 10)
    ids = prompt + output
    steps = [StepRecord(3, [output[0], output[1], (output[2] + 1) % VOCAB], 2, 1, "context4"),  # 2 covered, miss
             StepRecord(6, [(output[3] + 1) % VOCAB], 0, 1, "learned"),                        # the learned miss
             StepRecord(7, [output[4], output[5]], 2, 1, "table2")]                              # 2 covered
    record = TrajectoryRecord("r", "test", prompt, output, steps, 0.0, 1.0, 0.0, 0.0)
    assert validate_record(record.to_dict(), VOCAB).steps == steps  # the sources survive the wire
    capture = fresh_feature_drafter(target).config.capture_layers
    objective = FeatureObjective(target, torch.arange(VOCAB), capture, miss_weight=3.0, prompt_weight=0.25,
                                 covered_weight=0.5)
    weights = objective._weights(record)
    # weights[i] weighs the prediction of token i + 1
    expected = [0.25, 0.25] + [1.0] * (len(ids) - 2)
    expected[2] = expected[3] = 0.5      # ids[3], ids[4]: drafted by context matching and accepted
    expected[5] = 3.0                    # ids[6]: the learned drafter's miss
    expected[6] = expected[7] = 0.5      # ids[7], ids[8]: the table's, accepted
    assert weights == expected          # and context matching's miss (ids[5]) is not the learned drafter's


def gated_learner(tmp_path: Path, target: Transformer) -> Learner:
    """A learner with held-out records whose trained drafter has just been published live."""
    train = greedy_records(target, VOCAB, seed=0, cover=True)
    held_out = greedy_records(target, len(train), seed=99)
    # intake alternates: every second record (records_in % 2 == 0) is held out
    interleaved = [r for pair in zip(train, held_out, strict=True) for r in pair]
    learner = new_learner(tmp_path, target, fresh_feature_drafter(target), interleaved, holdout_every=2)
    assert len(learner.holdout) == learner.config.holdout_capacity and len(learner.buffer) == len(train)
    for _ in range(STEPS):
        learner.train_step()
    version = learner.maybe_publish(force=True)
    assert version is not None and learner.store.live_version() == version
    assert learner.stats.published[-1]["candidate"] >= 3.0
    for group in learner.optimizer.param_groups:  # further steps leave the weights as set below
        group["lr"] = 0.0
    return learner


def test_gate_rejects_a_candidate_worse_than_live_beyond_the_margin(tmp_path: Path, target) -> None:
    learner = gated_learner(tmp_path, target)
    live = learner.store.live_version()
    learner.model.load_state_dict(fresh_feature_drafter(target).state_dict())
    learner.train_step()
    assert learner.maybe_publish(force=True) is None
    rejected = learner.stats.rejected[-1]
    assert rejected["passed"] is False and "worse than live" in rejected["reason"]
    assert rejected["candidate"] < rejected["live"] - learner.config.gate_margin
    assert learner.store.live_version() == live == learner.live_version
    assert learner.store.manifest(rejected["version"])["status"] == "rejected"


def test_gate_rejects_a_candidate_with_non_finite_weights(tmp_path: Path, target) -> None:
    learner = gated_learner(tmp_path, target)
    live = learner.store.live_version()
    learner.train_step()  # a step to publish after (the learner skips a step on NaN weights: set them after it)
    with torch.no_grad():
        learner.model.head.weight[0, 0] = float("nan")
    assert learner.maybe_publish(force=True) is None
    rejected = learner.stats.rejected[-1]
    assert rejected["passed"] is False and rejected["reason"] == "non-finite weights"
    assert learner.store.live_version() == live
    # the same weights, made finite again, are a fine candidate: it was the NaN that was refused
    with torch.no_grad():
        learner.model.load_state_dict(learner.promoter.live_model().float().state_dict())
    assert learner.evaluate(learner.model)["passed"] is True


def test_the_fused_head_cross_entropy_has_autograds_value_gradients_and_argmax_across_chunks() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(11, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(17, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    target_p = torch.softmax(torch.randn(11, 17, generator=generator, dtype=torch.float64), dim=-1).float()
    row_weight = torch.rand(11, generator=generator, dtype=torch.float64).float()
    row_weight[3] = 0.0  # a row no label weighs: it adds nothing and gets no gradient
    fused_x, fused_weight = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    total, per_row, top = head_cross_entropy(fused_x, fused_weight, target_p, row_weight, chunk_rows=4)
    (2.5 * total).backward()  # backward scales the gradients made in the forward pass
    logits = x @ weight.T
    reference_rows = -(target_p.double() * F.log_softmax(logits, dim=-1)).sum(-1)
    reference = (reference_rows * row_weight.double()).sum()
    (2.5 * reference).backward()
    torch.testing.assert_close(total.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(per_row.double(), reference_rows.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(top, logits.argmax(-1))
    assert x.grad is not None and weight.grad is not None and fused_x.grad is not None
    torch.testing.assert_close(fused_x.grad.double(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused_weight.grad.double(), weight.grad, rtol=1e-4, atol=1e-5)
    assert float(fused_x.grad[3].abs().max()) == 0.0


def test_the_target_labels_are_its_float32_distribution_entropy_and_argmax_across_chunks() -> None:
    generator = torch.Generator().manual_seed(1)
    states, rows = torch.randn(9, 6, generator=generator), torch.randn(17, 6, generator=generator)
    p, entropy, top = target_labels(states, rows, eps=1e-5, chunk_rows=4)
    logp = F.log_softmax(F.rms_norm(states, (6,), eps=1e-5) @ rows.T, dim=-1)
    torch.testing.assert_close(p, logp.exp())
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1))
    assert torch.equal(top, logp.argmax(-1))


def test_the_memory_breakdown_counts_carried_features_once_and_recomputed_ones_in_the_cache(tmp_path: Path,
                                                                                           target) -> None:
    from specd.learner.memory import memory_breakdown

    capture = fresh_feature_drafter(target).config.capture_layers
    ids_only = greedy_records(target, 24, seed=0)
    carrying = new_learner(tmp_path / "carried", target, fresh_feature_drafter(target),
                           [with_features(target, r, capture) for r in ids_only])
    recomputing = new_learner(tmp_path / "ids", target, fresh_feature_drafter(target), ids_only)
    for learner in (carrying, recomputing):
        for _ in range(3):
            learner.train_step()
    carried = memory_breakdown(carrying)
    feature_bytes = sum(len(r.features.data) for r in carrying.buffer)
    assert carried["feature_cache"] == 0  # the records' own bytes are read in place: no second copy
    assert carried["buffer"] == feature_bytes + 36 * sum(r.num_tokens for r in carrying.buffer)
    recomputed = memory_breakdown(recomputing)
    assert 0 < recomputed["feature_cache"] <= feature_bytes + sum(len(r.features.data) for r in carrying.holdout)
    assert recomputed["models"] > 0 and recomputed["rss"] > recomputed["models"]


def test_a_loss_that_weighs_no_prompt_position_skips_the_prompts_and_is_unchanged(target, monkeypatch) -> None:
    from specd.learner import feature_signal

    model = fresh_feature_drafter(target, seed=1).double()
    capture = model.config.capture_layers
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight).double()
    rng = random.Random(4)
    examples = []
    for prompt_length in (9, 12):  # the batch's rows start labelling at entries 7 and 10
        ids = torch.tensor([rng.randrange(VOCAB) for _ in range(prompt_length + 10)])
        with torch.no_grad():
            features = target.train_features(ids[None], capture)[0].double()
        weights = torch.zeros(len(ids))
        weights[prompt_length - 1:] = 1.0  # as the distilled corpus weighs answers, prompts at 0
        examples.append((ids, features, weights))
    batch = collate(examples)
    lead = feature_signal.unlabelled_lead(batch.weights[:, 1:], steps=3)

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss, _ = feature_loss(model, batch, rows, steps=3)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    skipped, skipped_grads = loss_and_grads()
    assert lead == 7 - 2  # the first labelled entry less the two chain entries before it
    monkeypatch.setattr(feature_signal, "unlabelled_lead", lambda weights, steps: 0)  # every entry
    whole, whole_grads = loss_and_grads()
    assert torch.allclose(skipped, whole, rtol=1e-10, atol=0)
    assert all(torch.allclose(a, b, rtol=1e-8, atol=1e-12) for a, b in zip(skipped_grads, whole_grads, strict=True))
    # one entry too late would drop chain state the labelled entries read: the loss would change
    monkeypatch.setattr(feature_signal, "unlabelled_lead", lambda weights, steps: lead + 1)
    assert not torch.allclose(loss_and_grads()[0], whole, rtol=1e-6, atol=0)


def test_padding_and_unweighed_rows_leave_the_loss_and_its_gradients_unchanged(target) -> None:
    model = fresh_feature_drafter(target).float().train()
    capture = model.config.capture_layers
    rows = label_rows(target.lm_head.weight, model.draft_ids, target.norm.weight)
    generator = torch.Generator().manual_seed(3)

    def example(length: int, first_weighed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (length,), generator=generator)
        with torch.no_grad():
            features = target.train_features(tokens[None], capture)[0].float()
        weights = torch.ones(length)
        weights[:first_weighed] = 0.0
        return tokens, features, weights

    def loss_and_grads(batch: list) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss, _ = feature_loss(model, collate(batch), rows, steps=3)
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    short, long, longest = example(12, 2), example(20, 4), example(26, 0)
    unweighed = (longest[0], longest[1], torch.zeros(26))
    alone = loss_and_grads([short, long])
    padded = loss_and_grads([short, long, unweighed])  # a row that weighs nothing, and pads `short` further
    assert padded[0] == pytest.approx(alone[0], rel=1e-5)
    for a, b in zip(alone[1], padded[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
