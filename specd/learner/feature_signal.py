"""Training signal for the feature drafter: the target's distribution as the label, unrolled.

Contract: pure functions over tensors. A training sequence is token ids x_0..x_{T-1} with the
target's features f_0..f_{T-1} (captured layers, the last one the target's last layer) and a
weight per position. The drafter's entry at position t predicts x_{t+2}; its label is the target's
own distribution there, recomputed from the last layer's state at t + 1 through the target's final
norm and frozen output rows for the draft vocabulary (`label_rows`), so no distribution is ever
stored or sent.
Every unrolled step is trained (step j on the drafter's own states, as draft j + 1 is made when
serving), step j weighted `step_decay ** j`. The objective is forward KL ("kl") or the
acceptance objective −log Σ min(p, q) ("accept"). Replaying a drafter on trajectories (what the
gate measures) lives in `specd.learner.simulation`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specd.drafter.feature_model import FeatureDrafterModel
from specd.learner.head_loss import head_cross_entropy, target_labels

OBJECTIVES = ("kl", "accept")

# Under bf16 autocast the drafter's RMSNorm gets bfloat16 input and float32 weights, so torch takes
# its unfused path and warns on every run; the result is the same norm, so the warning says nothing
# to a user (and printed through every progress bar of pretraining and the demo).
warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight", category=UserWarning)


@dataclass
class FeatureBatch:
    tokens: torch.Tensor     # [B, T] ids, right-padded
    features: torch.Tensor   # [B, T, feature_size] the target's, any float dtype
    weights: torch.Tensor    # [B, T] weight of the label at each position (0: padding, not a label)

    @property
    def num_tokens(self) -> int:
        return int((self.weights > 0).sum())


def collate(sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> FeatureBatch:
    """(tokens [T], features [T, F], weights [T]) per sequence, right-padded to one length."""
    length = max(len(tokens) for tokens, _, _ in sequences)
    feature_size = sequences[0][1].shape[-1]
    tokens = torch.zeros(len(sequences), length, dtype=torch.long)
    features = torch.zeros(len(sequences), length, feature_size, dtype=sequences[0][1].dtype)
    weights = torch.zeros(len(sequences), length)
    for row, (row_tokens, row_features, row_weights) in enumerate(sequences):
        n = len(row_tokens)
        tokens[row, :n], features[row, :n], weights[row, :n] = row_tokens, row_features, row_weights
    return FeatureBatch(tokens, features, weights)


def unlabelled_lead(label_weight: torch.Tensor, steps: int) -> int:
    """Leading entries of a batch that no label weighs and no weighed chain reads: `unrolled` may
    start after them. Step j at entry t reads the chain from entry t - j on, so the window opens
    `steps` - 1 entries before the first weighed one; the loss is the same as over every entry,
    and entries before it (prompts weighed 0) cost nothing."""
    weighed = (label_weight > 0).any(dim=0).nonzero()
    if len(weighed) == 0:
        return 0
    return max(0, int(weighed[0]) - (steps - 1))


def label_rows(lm_head: torch.Tensor, draft_ids: torch.Tensor, final_norm: torch.Tensor) -> torch.Tensor:
    """The target's output rows for the draft vocabulary [N, hidden], its final norm's weight folded
    in (so that logits = rms_normalised(last layer's state) @ rows.T), frozen, float32."""
    return lm_head.detach().float()[draft_ids.to(lm_head.device)] * final_norm.detach().float().to(lm_head.device)


def feature_loss(model: FeatureDrafterModel, batch: FeatureBatch, rows: torch.Tensor, steps: int,
                 step_decay: float = 0.8, objective: str = "kl",
                 with_stats: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled loss and, per step (when `with_stats`), the mean KL and how often the drafter's
    argmax is the target's.

    The output head, the label and the loss run over weighed entries only (gathered): they are
    about half a step's work over the whole draft vocabulary, and a batch's window holds padding
    and rows that start labelling later than the first (about a fifth of its entries)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    device = model.head.weight.device
    features = batch.features.to(device)
    tokens = batch.tokens.to(device)
    length = tokens.shape[1]
    if length < 3:
        raise ValueError("a training sequence needs at least 3 tokens")
    label_weight = batch.weights[:, 1:].to(device)
    start = unlabelled_lead(label_weight, steps)
    outputs = model.unrolled(features[:, :-1], tokens[:, 1:], steps, start=start)
    label_weight = label_weight[:, start:]
    # the weighed entries of the window, flattened: [n]
    weighed = (label_weight > 0).flatten().nonzero().squeeze(-1)
    positions = torch.arange(start, length - 1, device=device).repeat(len(label_weight))[weighed]
    entry_weight = label_weight.flatten()[weighed]
    with torch.no_grad():
        # at t + 1: [n, hidden], the last captured layer's states
        labels_at = features[:, 1 + start:].flatten(0, 1)[weighed][..., -rows.shape[1]:]
        # KL = cross-entropy − the target's entropy, which no parameter changes
        target_p, target_entropy, target_top = target_labels(labels_at, rows, model.config.rms_norm_eps)
    total = torch.zeros((), device=device)
    stats: dict[str, float] = {}
    for j, state in enumerate(outputs):
        weight = entry_weight * (positions >= j)
        normaliser = weight.sum()
        if float(normaliser) == 0:
            continue
        normed = model.norm(state.flatten(0, 1)[weighed])
        if objective == "kl":
            weighed_ce, cross_entropy, drafted = head_cross_entropy(normed, model.head.weight, target_p, weight)
            step_loss = (weighed_ce - (weight * target_entropy).sum()) / normaliser
            kl = cross_entropy - target_entropy
        else:
            logq = F.log_softmax(model.head(normed).float(), dim=-1)
            overlap = torch.minimum(target_p, logq.exp()).sum(-1)
            step_loss = (-torch.log(overlap.clamp(min=1e-6)) * weight).sum() / normaliser
            kl = -(target_p * logq.detach()).sum(-1) - target_entropy
            drafted = logq.detach().argmax(-1)
        total = total + step_decay ** j * step_loss
        if with_stats:
            stats[f"kl{j + 1}"] = float((kl * weight).sum() / normaliser)
            agree = torch.eq(drafted, target_top).float()
            stats[f"top1_{j + 1}"] = float((agree * weight).sum() / normaliser)
    return total, stats
