"""From trajectory records to training tensors, the loss, and the simulated accept length.

Contract: pure functions over records and tensors. Every output token is the target's own choice,
so every output position is a label (teacher forcing); positions where the live learned drafter's
draft was rejected (not a context match's or the traffic table's) weigh `miss_weight` times more
(OSD's emphasis on the drafter's mistakes), and the rejected draft itself becomes a negative at
that position for greedy records (under sampling a rejection can be chance, so it is not evidence
against the token). The gate's accept length is
simulated exactly for greedy decoding: with the true prefix, the drafter's i-th draft is its
teacher-forced argmax, so a step accepts the run of consecutive correct predictions, up to k.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.core.records import LEARNED_SOURCE, AcceptanceCounts, TrajectoryRecord
from specd.model.transformer import Transformer


@dataclass
class TrainingBatch:
    tokens: torch.Tensor      # [B, T] inputs
    labels: torch.Tensor      # [B, T] next token at each position, -1 where not a label
    weights: torch.Tensor     # [B, T]
    negatives: torch.Tensor   # [B, T] rejected draft to push down at each position, -1 for none

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels >= 0).sum())


def build_batch(records: list[TrajectoryRecord], window: int, miss_weight: float, prompt_weight: float,
                rng: random.Random) -> TrainingBatch:
    """One random window (ending inside the output) per record, right-padded to a common length."""
    rows = []
    for record in records:
        ids = record.prompt_ids + record.output_ids
        first_output = len(record.prompt_ids)
        end = rng.randint(min(first_output + 1, len(ids)), len(ids))
        start = max(0, end - window - 1)
        weight = [prompt_weight if j < first_output else 1.0 for j in range(len(ids))]
        negative = [-1] * len(ids)
        for step in record.steps:
            # a context or table draft's miss is not the drafter's mistake, nor its draft a token to push down
            if step.source == LEARNED_SOURCE and step.num_accepted < len(step.drafts):
                miss = step.position + step.num_accepted  # the position of the target's correction
                if miss < len(ids):
                    weight[miss] = miss_weight
                    if record.temperature == 0:
                        negative[miss] = step.drafts[step.num_accepted]
        # logits at input position j predict token j + 1
        rows.append((ids[start:end - 1], ids[start + 1:end], weight[start + 1:end], negative[start + 1:end]))
    length = max(len(r[0]) for r in rows)

    def pad(values: list, fill: float | int) -> list:
        return values + [fill] * (length - len(values))

    return TrainingBatch(
        tokens=torch.tensor([pad(r[0], 0) for r in rows]),
        labels=torch.tensor([pad([t if w > 0 else -1 for t, w in zip(r[1], r[2], strict=True)], -1) for r in rows]),
        weights=torch.tensor([pad(r[2], 0.0) for r in rows]),
        negatives=torch.tensor([pad(r[3], -1) for r in rows]))


def drafter_loss(logits: torch.Tensor, batch: TrainingBatch, negative_coef: float) -> tuple[torch.Tensor, dict]:
    """Weighted cross-entropy on the target's tokens plus negative_coef * −log(1 − q(rejected draft)).

    logits: [B, T, V'] over the drafter's head ids; labels or negatives past V' are skipped.
    """
    head = logits.shape[-1]
    logq = F.log_softmax(logits.float(), dim=-1)  # [B, T, V']
    is_label = (batch.labels >= 0) & (batch.labels < head)
    label_logq = logq.gather(-1, batch.labels.clamp(0, head - 1)[..., None]).squeeze(-1)
    weights = batch.weights * is_label
    cross_entropy = -(label_logq * weights).sum() / weights.sum().clamp(min=1e-6)
    is_negative = (batch.negatives >= 0) & (batch.negatives < head)
    negative_term = torch.zeros((), device=logits.device)
    if bool(is_negative.any()):
        q_rejected = logq.gather(-1, batch.negatives.clamp(0, head - 1)[..., None]).squeeze(-1).exp()
        penalty = -torch.log1p(-q_rejected.clamp(max=1 - 1e-6))
        negative_term = (penalty * is_negative).sum() / is_negative.sum()
    loss = cross_entropy + negative_coef * negative_term
    return loss, {"cross_entropy": float(cross_entropy.detach()), "negative": float(negative_term.detach())}


@torch.no_grad()
def simulated_counts(model: Transformer, records: list[TrajectoryRecord], k: int,
                     window: int = 512) -> AcceptanceCounts:
    """Drafts, accepted drafts, target passes and tokens the drafter would reach on these outputs
    (greedy drafting, teacher-forced): each pass drafts up to k, accepts the run of correct predictions.
    Exact on greedy records, an unbiased estimate on sampled ones (see `specd.learner.gate`)."""
    counts = AcceptanceCounts()
    for record in records:
        ids = (record.prompt_ids + record.output_ids)[-(window + 1):]
        num_output = min(len(record.output_ids), len(ids) - 1)
        logits = model.train_logits(torch.tensor([ids[:-1]], device=model.embed.weight.device))
        correct = (logits[0].argmax(-1).cpu() == torch.tensor(ids[1:])).tolist()[-num_output:]
        j = 0
        while j < num_output:
            run = 0
            while run < k and j + run < num_output - 1 and correct[j + run]:
                run += 1
            counts.add(AcceptanceCounts(drafts=min(k, num_output - 1 - j), accepted=run, passes=1, emitted=run + 1))
            j += run + 1
    return counts


def simulated_accept_length(model: Transformer, records: list[TrajectoryRecord], k: int, window: int = 512) -> float:
    """Tokens per target pass the drafter would reach on these outputs (greedy, teacher-forced)."""
    return simulated_counts(model, records, k, window).accept_length or 0.0
