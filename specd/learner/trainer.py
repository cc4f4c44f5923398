"""The trainer: one optimiser step on a batch of buffered trajectories, per drafter architecture.

Contract: `TRAINING` maps each drafter architecture to how it is trained online (`TrainingPlan`: its
objective, buffer size and step size, and which weights train); `Trainer(model, config, target)`
owns the float32 training copy, its optimiser and the seeded batch sampler. A batch takes
`recent_share` of its records from the newest `recent_records` and the rest from the whole buffer,
so that a shift in traffic is learned within steps; with `anchor_pull` each step ends by moving
every weight that share of the way back to the anchor: the weights training started from or last
adopted, and with `anchor` "live" also each version of its own that went live
(`version_went_live`; with ranks at the next sync, on every rank alike). `step`
counts into the learner's stats and notes how stale the batch was (record age and versions behind
the live one). `take_weights` loads another version's weights when they fit this architecture and
shape (an adopted live version) and counts the adoption (`weights_epoch`). With a `RankGroup` (data-
parallel ranks), the loss runs under DistributedDataParallel: its construction starts every rank
from rank 0's weights and each backward pass averages the gradients of all ranks' batches, so every
rank takes the same optimiser step.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from specd.core.errors import ConfigurationError
from specd.core.records import TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel
from specd.drafter.feature_model import FeatureDrafterModel
from specd.learner.config import LearnerConfig, LearnerStats
from specd.learner.objectives import FeatureObjective, Objective, TokenObjective
from specd.learner.ranks import RankGroup
from specd.model.transformer import Transformer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingPlan:
    objective: Objective
    buffer_capacity: int
    learning_rate: float


def _feature_plan(model: DrafterModel, config: LearnerConfig, target: Transformer | None) -> TrainingPlan:
    assert isinstance(model, FeatureDrafterModel)
    if target is None:
        raise ConfigurationError("a feature drafter's learner needs the target (labels, recomputed features)")
    objective = FeatureObjective(target, model.draft_ids, model.config.capture_layers, config.feature_window,
                                 config.unroll, config.miss_weight, config.feature_prompt_weight,
                                 cache_records=config.feature_buffer_capacity + config.holdout_capacity)
    # the feature drafter starts trained (pretrained or the target's own head): smaller steps
    return TrainingPlan(objective, config.feature_buffer_capacity, config.feature_learning_rate)


def _token_plan(model: DrafterModel, config: LearnerConfig, target: Transformer | None) -> TrainingPlan:
    assert isinstance(model, Transformer)
    model.embed.weight.requires_grad_(config.train_embeddings)  # the target's embeddings are a good, frozen start
    objective = TokenObjective(config.window, config.miss_weight, config.prompt_weight, config.negative_coef)
    return TrainingPlan(objective, config.buffer_capacity, config.learning_rate)


PlanMaker = Callable[[DrafterModel, LearnerConfig, "Transformer | None"], TrainingPlan]
TRAINING: dict[type, PlanMaker] = {FeatureDrafterModel: _feature_plan, Transformer: _token_plan}


class ObjectiveLoss(torch.nn.Module):
    """The objective's loss on a batch as a module's forward, which DistributedDataParallel wraps
    (the drafter's own forward is its serving step, not its training loss)."""

    def __init__(self, model: DrafterModel, objective: Objective) -> None:
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, records: list[TrajectoryRecord], rng: random.Random) -> tuple[torch.Tensor, int]:
        return self.objective.loss(self.model, records, rng)


class Trainer:
    def __init__(self, model: DrafterModel, config: LearnerConfig, target: Transformer | None,
                 group: RankGroup | None = None) -> None:
        if type(model) not in TRAINING:
            raise ConfigurationError(f"no online training is defined for a {type(model).__name__}")
        self.model, self.config, self._group = model, config, group
        plan = TRAINING[type(model)](model, config, target)
        self.objective, self.buffer_capacity = plan.objective, plan.buffer_capacity
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=plan.learning_rate, weight_decay=0.0)
        self._params: list[torch.Tensor] = list(params)
        self.rng = random.Random(config.seed)
        self._staleness: dict[str, Any] | None = None
        # adoptions of other weights (and, anchored to live versions, its own versions gone live):
        # rank 0's count tells the others to take its weights and re-anchor
        self.weights_epoch = 0
        loss = ObjectiveLoss(model, self.objective)
        # buffers (the target's embedding) never change: no broadcast of them at every step
        self._loss: torch.nn.Module = loss if group is None else DistributedDataParallel(
            loss, forward_sync_buffers=False)
        # taken after DistributedDataParallel's broadcast: every rank anchors to rank 0's weights
        self._anchor = self._copy_of(self._params) if config.anchor_pull > 0 else None

    def batch(self, buffered: Sequence[TrajectoryRecord]) -> list[TrajectoryRecord]:
        cfg = self.config
        buffered = list(buffered)
        recent = round(cfg.batch_size * cfg.recent_share)
        return (self.rng.choices(buffered[-cfg.recent_records:], k=recent)
                + self.rng.choices(buffered, k=cfg.batch_size - recent))

    def step(self, records: list[TrajectoryRecord], stats: LearnerStats, live_version: int | None) -> float:
        """One optimiser step on `records`; the loss."""
        device = next(self.model.parameters()).device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.config.precision == "bfloat16"):
            loss, num_tokens = self._loss(records, self.rng)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if not (torch.isfinite(loss) and torch.isfinite(norm)):
            # one such step would make every weight and Adam's moments NaN for good (the gate refuses
            # the versions, but learning stops until a restart): skipped, on every rank alike (the
            # norm is taken after the ranks' gradients are averaged)
            self.optimizer.zero_grad(set_to_none=True)
            stats.skipped_steps += 1
            if stats.skipped_steps <= 3 or stats.skipped_steps % 1000 == 0:
                log.warning("a training step with a non-finite loss or gradient was skipped (%d so far)",
                            stats.skipped_steps)
            return float(loss.detach())
        self.optimizer.step()
        if self._anchor is not None:
            with torch.no_grad():
                torch._foreach_lerp_(self._params, self._anchor, self.config.anchor_pull)
        stats.steps += 1
        stats.tokens_trained += num_tokens
        stats.records_trained += len(records)
        value = float(loss.detach())
        stats.losses.append(value)
        now = time.time()
        ages = [now - r.finished for r in records]
        # version numbers apart (rejected candidates count too); 0, not negative, for records drafted
        # by a version rolled back from
        behind = [max(0, (live_version or 0) - s.version) for r in records for s in r.steps[:1]
                  if s.version is not None]
        self._staleness = {"mean_record_age_s": sum(ages) / len(ages),
                           "mean_versions_behind": sum(behind) / len(behind) if behind else None}
        return value

    @property
    def staleness(self) -> dict[str, Any]:
        """How old the last trained batch was: mean record age (s) and versions behind the live one."""
        return dict(self._staleness or {})

    def accept_length(self, model: DrafterModel, records: list[TrajectoryRecord]) -> float:
        """The simulated accept length of `model` on `records` (1.0 for a drafter of another kind,
        which cannot be replayed here)."""
        if type(model) is not type(self.model):
            return 1.0
        return self.objective.simulate(model, records, self.config.k).accept_length or 0.0

    def take_weights(self, restored: DrafterModel) -> bool:
        """Train on from `restored` if it is this architecture and shape, with the same draft vocabulary;
        False (nothing changed) if not."""
        if type(restored) is not type(self.model) or restored.config != self.model.config:
            return False
        ids = "draft_ids"  # the objective's labels were built for these ids: others would scramble them
        if isinstance(self.model, FeatureDrafterModel) and not torch.equal(restored.get_buffer(ids).cpu(),
                                                                           self.model.get_buffer(ids).cpu()):
            return False
        self.model.load_state_dict(restored.float().state_dict())
        self.reanchor()
        self.weights_epoch += 1
        return True

    def version_went_live(self) -> None:
        """A version of these weights went live: with `anchor` "live" the pull now points at it. With
        ranks the count of adoptions moves on instead, so that at the next sync every rank takes rank
        0's weights and re-anchors to them alike (one step after the version's, on every rank)."""
        if self._anchor is None or self.config.anchor != "live":
            return
        if self._group is None:
            self.reanchor()
        else:
            self.weights_epoch += 1

    def reanchor(self) -> None:
        """Anchor to the weights held now (an adopted version's; with ranks, on every rank after the sync)."""
        if self._anchor is not None:
            self._anchor = self._copy_of(self._params)

    @staticmethod
    def _copy_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.detach().clone() for p in params]
