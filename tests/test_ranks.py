"""Data-parallel learner ranks (`specd.learner.ranks`): two real gloo ranks in two processes.

Each rank starts from different weights and trains on records of its own; DistributedDataParallel
must leave both with rank 0's start moved by the average of both ranks' gradients (checked
against that step computed in one process), an adoption on rank 0 must reach rank 1 at the next
sync, and records held out on rank 1 must reach rank 0's gate.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from specd.core.records import TrajectoryRecord
from specd.drafter.feature_model import FeatureDrafterModel, new_feature_drafter
from specd.learner.config import LearnerConfig, LearnerStats
from specd.learner.ranks import (
    RANK_STALL_S,
    RankGroup,
    RankInfo,
    group_status,
    rank_cores,
    status_path,
    weights_digest,
    write_status,
)
from specd.learner.trainer import Trainer
from specd.testing import learnable_target
from specd.testing.processes import free_port

pytestmark = pytest.mark.slow

VOCAB = 32


def drafter(seed: int) -> FeatureDrafterModel:
    target = learnable_target(VOCAB).float()
    return new_feature_drafter(target.config, target.embed.weight, target.lm_head.weight, target.norm.weight,
                               torch.arange(VOCAB), seed=seed).float().train()


def records_of(rank: int, count: int = 6) -> list[TrajectoryRecord]:
    rng = random.Random(100 + rank)
    return [TrajectoryRecord(uuid.UUID(int=rank * 1000 + i).hex, f"server-{rank}", [rng.randrange(1, VOCAB)
                             for _ in range(6)], [rng.randrange(1, VOCAB) for _ in range(12)], [], 0.0, 1.0,
                             0.0, 0.0, "chat") for i in range(count)]


def config(rank: int) -> LearnerConfig:
    # anchored: after every step each rank's weights move 10% back toward the version it adopted last
    return LearnerConfig(seed=rank, batch_size=2, feature_learning_rate=1e-2, anchor_pull=0.1)


def rank_body(rank: int, port: int, folder: str) -> None:
    # the store is hosted by the test process, as torchrun's agent hosts it in production: a rank
    # that exits first then never tears it down under the other (a race that aborted a rank once
    # in a full CI run: "terminate called without an active exception")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="true")
    torch.set_num_threads(1)
    group = RankGroup(RankInfo(rank, 2, rank), pin_cores=False)
    model = drafter(seed=rank)  # different starts: DDP must begin both from rank 0's
    trainer = Trainer(model, config(rank), learnable_target(VOCAB).float(), group=group)
    mine = records_of(rank)
    trainer.step(trainer.batch(mine), LearnerStats(), None)
    after_step = {k: v.detach().clone() for k, v in model.state_dict().items()}
    group.sync([], trainer.weights_epoch, model)
    if rank == 0:  # rank 0 adopts other weights (a rollback): the next sync hands them to rank 1
        assert trainer.take_weights(drafter(seed=7))
    gathered = group.sync(mine[:2] if rank == 1 else [], trainer.weights_epoch, model, adopted=trainer.reanchor)
    anchored = all(torch.equal(a, p) for a, p in zip(trainer._anchor or [], trainer._params, strict=True))
    adopted = weights_digest(model)
    if rank == 0:  # a version of rank 0's went live: at the next sync every rank re-anchors alike
        trainer.version_went_live()
    trainer.step(trainer.batch(mine), LearnerStats(), None)
    group.sync([], trainer.weights_epoch, model, adopted=trainer.reanchor)
    out = {"after_step": after_step, "adopted": adopted, "gathered": [r.record_id for r in gathered],
           "anchored_to_adopted": anchored, "after_live": weights_digest(model),
           "anchored_to_live": all(torch.equal(a, p) for a, p in zip(trainer._anchor or [], trainer._params,
                                                                     strict=True))}
    Path(folder, f"rank-{rank}.pkl").write_bytes(pickle.dumps(out))
    # both ranks past every collective before either tears gloo down: under a full CI run's load one
    # rank aborted in teardown once more ("terminate called without an active exception", 2026-12-03)
    # with the store already hosted here; a barrier leaves no work in flight when the group closes
    torch.distributed.barrier()
    group.close()


def reference_step() -> dict[str, torch.Tensor]:
    """The same step in one process: rank 0's start, each rank's batch drawn by its own seed, the
    gradient of the mean of both losses, then the trainer's clipping and optimiser."""
    model = drafter(seed=0)
    trainers = [Trainer(model, config(rank), learnable_target(VOCAB).float()) for rank in (0, 1)]
    losses = []
    for rank, trainer in enumerate(trainers):
        batch = trainer.batch(records_of(rank))
        losses.append(trainer.objective.loss(model, batch, trainer.rng)[0])
    optimizer = trainers[0].optimizer
    optimizer.zero_grad(set_to_none=True)
    (sum(losses) / 2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    with torch.no_grad():  # the pull back toward the start (rank 0's weights)
        torch._foreach_lerp_(trainers[0]._params, trainers[0]._anchor, config(0).anchor_pull)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory) -> dict[int, dict]:
    folder = tmp_path_factory.mktemp("ranks")
    context = mp.get_context("spawn")
    port = free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    ranks = [context.Process(target=rank_body, args=(rank, port, str(folder))) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=240)
        assert process.exitcode == 0, f"a rank failed (exit code {process.exitcode})"
    del store  # only once both ranks are gone
    return {rank: pickle.loads((folder / f"rank-{rank}.pkl").read_bytes()) for rank in (0, 1)}


def test_a_step_averages_both_ranks_gradients_from_rank_0s_start(outcome) -> None:
    expected = reference_step()
    for rank in (0, 1):
        for name, tensor in outcome[rank]["after_step"].items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-5, rtol=1e-4, msg=f"rank {rank}: {name}")


def test_weights_rank_0_adopts_reach_every_rank_at_the_next_sync(outcome) -> None:
    assert outcome[0]["adopted"] == outcome[1]["adopted"] == weights_digest(drafter(seed=7))
    # and every rank's anchor with them: a rank still pulled toward its old anchor would drift apart
    assert outcome[0]["anchored_to_adopted"] and outcome[1]["anchored_to_adopted"]


def test_when_rank_0s_version_goes_live_every_rank_re_anchors_to_the_same_weights(outcome) -> None:
    # (config(rank)'s anchor is "live", LearnerConfig's default)
    assert outcome[0]["after_live"] == outcome[1]["after_live"] != outcome[0]["adopted"]
    assert outcome[0]["anchored_to_live"] and outcome[1]["anchored_to_live"]


def test_records_held_out_on_any_rank_reach_rank_0s_gate(outcome) -> None:
    assert outcome[0]["gathered"] == [r.record_id for r in records_of(1)[:2]]
    assert outcome[1]["gathered"] == []


def test_each_rank_gets_its_own_cores() -> None:
    assert rank_cores(0, 2, [0, 1]) == [0] and rank_cores(1, 2, [0, 1]) == [1]
    assert rank_cores(1, 2, [0, 1, 2, 3]) == [2, 3]
    assert rank_cores(2, 3, [0, 1]) == [0]          # more ranks than cores: they share, none is left out
    assert rank_cores(0, 1, [0, 1], per_rank=1) == [0]


def test_rank_0s_gate_judges_gathered_records_as_if_it_had_held_them_out_itself() -> None:
    from specd.learner.gate import Gate

    records = records_of(0) + records_of(1)
    alone, gathered = Gate(1, 16, 4, 0.05), Gate(1, 16, 4, 0.05)
    for index, record in enumerate(records, start=1):
        alone.hold_out(record, index)
    other_rank = Gate(1, 16, 4, 0.05)
    for index, record in enumerate(records[6:], start=1):
        other_rank.hold_out(record, index)
    for index, record in enumerate(records[:6], start=1):
        gathered.hold_out(record, index)
    gathered.keep(other_rank.drain())  # what sync hands rank 0
    assert not other_rank.held_out

    def judged(model, held_out) -> float:  # a replay that depends on every record it is given
        return 1.0 + sum(len(r.output_ids) * (i + 1) for i, r in enumerate(held_out)) / 1000

    candidate, live = drafter(seed=0), drafter(seed=1)
    assert gathered.verdict(candidate, live, judged) == alone.verdict(candidate, live, judged)


def test_a_step_with_a_non_finite_loss_is_skipped_and_learning_goes_on() -> None:
    model = drafter(0)
    trainer = Trainer(model, config(0), learnable_target(VOCAB).float())
    stats = LearnerStats()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    real_loss = trainer._loss
    trainer._loss = lambda records, rng: (real_loss(records, rng)[0] * float("nan"), 1)  # type: ignore[assignment]
    trainer.step(records_of(0), stats, None)
    assert stats.skipped_steps == 1 and stats.steps == 0
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    trainer._loss = real_loss
    trainer.step(records_of(0), stats, None)  # Adam's moments were not poisoned: a finite step still trains
    assert stats.steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_a_version_drafting_another_vocabulary_is_not_adopted_into_the_trainer() -> None:
    model = drafter(0)
    trainer = Trainer(model, config(0), learnable_target(VOCAB).float())
    other = drafter(7)
    other.get_buffer("draft_ids").copy_(torch.arange(VOCAB).flip(0))  # the same shape, other ids
    assert not trainer.take_weights(other)  # its head's rows would mean other tokens than the labels'
    assert trainer.take_weights(drafter(7))


def test_rank_0s_status_sums_every_ranks_records_and_names_a_rank_that_stopped_writing(tmp_path: Path) -> None:
    write_status(tmp_path, RankInfo(0, 2, 0), {"records_in": 30, "tokens_trained": 900, "steps": 4})
    write_status(tmp_path, RankInfo(1, 2, 1), {"records_in": 12, "tokens_trained": 800, "steps": 4})
    late = status_path(tmp_path, 1)
    late.write_text(json.dumps({**json.loads(late.read_text()), "time": time.time() - RANK_STALL_S - 5}))
    status = group_status(tmp_path)
    assert status["ranks_total"] == {"records_in": 42, "tokens_trained": 1700}
    assert status["ranks_stalled"] == [1] and [r["stalled"] for r in status["ranks"]] == [False, True]
