"""What the learner trains and how it measures a drafter, per drafter architecture.

Contract: an objective turns sampled trajectory records into one loss (and the number of label
tokens it covers) and replays the drafter as it serves on held-out records, greedy or sampled
alike (`simulate`; how sampled ones are judged: `specd.learner.gate`), for its kind of drafter
network. `TokenObjective` trains the token-level `Transformer` on the records' ids.
`FeatureObjective` trains a `FeatureDrafterModel` on the target's features: those a record
carries, or, for records without them (a vLLM server ships ids only), features it recomputes
with its own copy of the target (one no-grad pass per record), counted in `recomputed_*` so the cost is
visible. Recomputed features are kept per record id for as long as the learner holds the
record; features a record carries are read in place (never copied). The cache is locked, so the
learner's thread and an operator's gate evaluation may both read it.
"""

from __future__ import annotations

import random
import threading
import time
import warnings
from collections import OrderedDict
from typing import Protocol

import torch

from specd.core.records import LEARNED_SOURCE, AcceptanceCounts, TrajectoryRecord
from specd.drafter.checkpoint import DrafterModel
from specd.drafter.feature_model import FeatureDrafterModel
from specd.learner.feature_signal import collate, feature_loss, label_rows
from specd.learner.signal import build_batch, drafter_loss
from specd.learner.signal import simulated_counts as token_simulated_counts
from specd.learner.simulation import ExpectedCounts, SampledRow, replay_start, simulated_counts
from specd.model.distributions import target_probs
from specd.model.transformer import Transformer

Replayed = AcceptanceCounts | ExpectedCounts  # what a replay gives: counts, or their expectations

# padded tokens (rows x the longest) a recomputation batch may hold: short records share a pass,
# long ones go alone. On this 2-core CPU a 200-380-token record already fills the matmuls: 48 chat
# records recomputed at 517-530 tokens/s at 1024 against 525-542 one by one and 452-487 at 4096
RECOMPUTE_BATCH_TOKENS = 1024


class Objective(Protocol):
    feature_size: int | None   # width of the features records must carry, None: ids only
    min_tokens: int            # shorter records teach nothing and are not kept

    def loss(self, model: DrafterModel, records: list[TrajectoryRecord],
             rng: random.Random) -> tuple[torch.Tensor, int]: ...

    def simulate(self, model: DrafterModel, records: list[TrajectoryRecord], k: int) -> Replayed: ...


class TokenObjective:
    """Cross-entropy on the target's tokens, misses weighted up (see `specd.learner.signal`)."""

    feature_size: int | None = None
    min_tokens = 2

    def __init__(self, window: int, miss_weight: float, prompt_weight: float, negative_coef: float) -> None:
        self.window, self.miss_weight, self.prompt_weight = window, miss_weight, prompt_weight
        self.negative_coef = negative_coef

    def loss(self, model: DrafterModel, records: list[TrajectoryRecord],
             rng: random.Random) -> tuple[torch.Tensor, int]:
        assert isinstance(model, Transformer)
        batch = build_batch(records, self.window, self.miss_weight, self.prompt_weight, rng)
        loss, _ = drafter_loss(model.train_logits(batch.tokens), batch, self.negative_coef)
        return loss, batch.num_label_tokens

    def simulate(self, model: DrafterModel, records: list[TrajectoryRecord], k: int) -> AcceptanceCounts:
        assert isinstance(model, Transformer)
        return token_simulated_counts(model, records, k)


class FeatureObjective:
    """Forward KL to the target's distribution, unrolled, on a window of each record.

    Label weights follow who drafted: a token the learned drafter missed weighs `miss_weight`; a
    token that context matching or the traffic table drafted and had accepted weighs
    `covered_weight` (those positions are served without the learned drafter, so they matter less
    to it); prompt positions weigh `prompt_weight`; the rest 1."""

    min_tokens = 4  # an entry at t needs tokens t + 1 and t + 2 and the target's state at t + 1

    def __init__(self, target: Transformer, draft_ids: torch.Tensor, capture_layers: tuple[int, ...],
                 window: int = 256, unroll: int = 3, miss_weight: float = 2.0, prompt_weight: float = 0.5,
                 objective: str = "kl", cache_records: int = 600, covered_weight: float = 0.5) -> None:
        self.target = target
        self.capture_layers = capture_layers
        if not capture_layers or capture_layers[-1] != target.config.num_layers - 1:
            raise ValueError(f"the feature learner's labels come from the target's last layer "
                             f"({target.config.num_layers - 1}); the drafter reads {capture_layers}")
        self.feature_size: int | None = len(capture_layers) * target.config.hidden_size
        self.rows = label_rows(target.lm_head.weight, draft_ids, target.norm.weight)
        self.window, self.unroll, self.objective = window, unroll, objective
        self.miss_weight, self.prompt_weight, self.covered_weight = miss_weight, prompt_weight, covered_weight
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._cache_records = cache_records
        self._cache_lock = threading.Lock()
        self.recomputed_records = 0
        self.recomputed_tokens = 0
        self.recomputed_seconds = 0.0

    def features(self, records: list[TrajectoryRecord]) -> list[torch.Tensor]:
        """[num_tokens - 1, feature_size] fp16 per record: carried, cached, or recomputed now."""
        # a batch samples with replacement: a record drawn twice is still computed (and counted) once
        with self._cache_lock:
            missing = list({r.record_id: r for r in records
                            if r.record_id not in self._cache and not _complete(r)}.values())
        # outside the lock: the other thread's reads do not wait for a target pass
        recomputed = self._recompute(missing) if missing else {}
        found = []
        with self._cache_lock:
            for record in records:
                features = self._cache.get(record.record_id, recomputed.get(record.record_id))
                if features is None:
                    found.append(_carried(record))
                    continue
                self._remember(record.record_id, features)
                found.append(features)
        return found

    @property
    def cache_bytes(self) -> int:
        with self._cache_lock:
            return sum(t.numel() * t.element_size() for t in self._cache.values())

    @torch.inference_mode()
    def _recompute(self, records: list[TrajectoryRecord]) -> dict[str, torch.Tensor]:
        """The target's features of records that carry none, in padded batches of similar lengths
        (right padding: with causal attention a row's real positions never see its pads)."""
        begin = time.perf_counter()
        device = self.target.embed.weight.device
        recomputed = {}
        sequences = sorted(((r.record_id, (r.prompt_ids + r.output_ids)[:-1]) for r in records),
                           key=lambda item: len(item[1]))
        for batch in length_batches(sequences, RECOMPUTE_BATCH_TOKENS):
            ids = torch.zeros(len(batch), len(batch[-1][1]), dtype=torch.long)
            for row, (_, sequence) in enumerate(batch):
                ids[row, :len(sequence)] = torch.tensor(sequence)
            features = self.target.train_features(ids.to(device), self.capture_layers)
            for row, (record_id, sequence) in enumerate(batch):
                recomputed[record_id] = features[row, :len(sequence)].to(torch.float16).cpu()
                self.recomputed_tokens += len(sequence)
        self.recomputed_records += len(records)
        self.recomputed_seconds += time.perf_counter() - begin
        return recomputed

    def _remember(self, record_id: str, features: torch.Tensor) -> None:
        """Keep (or refresh) `record_id`'s features as the newest; the oldest go past the bound."""
        self._cache[record_id] = features
        self._cache.move_to_end(record_id)
        while len(self._cache) > self._cache_records:
            self._cache.popitem(last=False)

    def loss(self, model: DrafterModel, records: list[TrajectoryRecord],
             rng: random.Random) -> tuple[torch.Tensor, int]:
        assert isinstance(model, FeatureDrafterModel)
        rows = []
        for record, features in zip(records, self.features(records), strict=True):
            ids = record.prompt_ids + record.output_ids
            weights = self._weights(record)
            # a window that ends inside the output: the output is what the drafter will serve
            end = rng.randint(min(len(record.prompt_ids) + 2, len(ids) - 1), len(ids) - 1)
            start = max(0, end - self.window)
            rows.append((torch.tensor(ids[start:end]), features[start:end], torch.tensor(weights[start:end])))
        batch = collate(rows)
        loss, _ = feature_loss(model, batch, self.rows.to(model.head.weight.device), self.unroll,
                               objective=self.objective)
        return loss, batch.num_tokens

    def _weights(self, record: TrajectoryRecord) -> list[float]:
        """weights[i] weighs the prediction of token i + 1 (collate's convention)."""
        total = record.num_tokens
        first_output = len(record.prompt_ids)
        weights = [self.prompt_weight if i + 1 < first_output else 1.0 for i in range(total)]
        for step in record.steps:
            if step.source != LEARNED_SOURCE:  # drafted by context matching or the table: covered
                for token in range(max(step.position, 1), min(step.position + step.num_accepted, total)):
                    weights[token - 1] = min(weights[token - 1], self.covered_weight)
            elif step.num_accepted < len(step.drafts):
                miss = step.position + step.num_accepted  # the token the target put in place of a draft
                if 0 < miss < total:
                    weights[miss - 1] = self.miss_weight
        return weights

    def simulate(self, model: DrafterModel, records: list[TrajectoryRecord], k: int) -> ExpectedCounts:
        """The accept length `model` reaches as served: greedy records replayed exactly, sampled
        ones by each draft's exact acceptance Σ min(p, q) (`specd.learner.simulation`)."""
        assert isinstance(model, FeatureDrafterModel)
        sequences, sampled = [], []
        for record, features in zip(records, self.features(records), strict=True):
            ids = torch.tensor((record.prompt_ids + record.output_ids)[:-1])
            sequences.append((ids, features, len(record.prompt_ids)))
            sampled.append(self._sampled_row(record, features, model.draft_ids) if record.temperature > 0 else None)
        return simulated_counts(model, sequences, k, sampled)

    @torch.inference_mode()
    def _sampled_row(self, record: TrajectoryRecord, features: torch.Tensor, draft_ids: torch.Tensor,
                     chunk: int = 128) -> SampledRow:
        """The target's distribution after the record's temperature and top-p at every entry the
        replay reads (from its last layer's state one position on), over the draft vocabulary; the
        full vocabulary's logits are needed for the normaliser and the nucleus, one chunk of
        positions at a time, and the prompt's entries are skipped (the costly part: the whole
        vocabulary's head)."""
        first_entry = replay_start(len(record.prompt_ids))
        hidden = self.target.config.hidden_size
        head_weight = self.target.lm_head.weight
        temperature, top_p = torch.tensor([record.temperature]), torch.tensor([record.top_p])
        parts = []
        for begin in range(first_entry + 1, len(features), chunk):
            last = features[begin:begin + chunk, -hidden:].to(head_weight)
            logits = self.target.lm_head(self.target.norm(last))
            parts.append(target_probs(logits[None], temperature, top_p)[0][:, draft_ids.to(logits.device)].cpu())
        target_p = torch.cat(parts) if parts else torch.zeros(0, len(draft_ids))
        return SampledRow(record.temperature, record.top_p, target_p, first_entry)

    @property
    def recompute_stats(self) -> dict[str, float | None]:
        seconds = self.recomputed_seconds
        return {"records": self.recomputed_records, "tokens": self.recomputed_tokens, "seconds": round(seconds, 2),
                "tokens_per_s": round(self.recomputed_tokens / seconds, 1) if seconds else None}


def _carried(record: TrajectoryRecord) -> torch.Tensor:
    """The features a record carries, as a tensor over the record's own bytes (read-only, never
    written: batches and replays copy what they change)."""
    block = record.features
    assert block is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the bytes are not writable
        flat = torch.frombuffer(block.data, dtype=torch.float16)
    return flat.view(block.num_positions, block.feature_size)


def length_batches(sequences: list[tuple[str, list[int]]], budget: int) -> list[list[tuple[str, list[int]]]]:
    """Consecutive runs of `sequences` (sorted by length) whose padded size, rows times the
    longest, stays within `budget` tokens (a longer sequence goes alone)."""
    batches: list[list[tuple[str, list[int]]]] = []
    for item in sequences:
        if batches and (len(batches[-1]) + 1) * len(item[1]) <= budget:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


def _complete(record: TrajectoryRecord) -> bool:
    return record.features is not None and record.features.num_positions == record.num_tokens - 1
