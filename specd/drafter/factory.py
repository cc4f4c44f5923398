"""The one place a serving drafter is built: from a kind, a model and its version.

Contract: `DrafterSpec` names what a server runs (kind "hybrid": context matches and the traffic
table before the learned drafter; "learned": the learned drafter alone), which learned drafter
(arch "feature": on the target's hidden states; "token": on token ids only) and how a day-0
drafter starts; it is checked on construction. `initial_model` makes that day-0 drafter for a
target (feature: the shipped pretrained version when it fits, else a fresh one; token: random
layers on the target's frozen embedding, an output head over the first `head_vocab` ids);
`build_drafter` wraps a model and its version into what the
engine, the demo and the vLLM proposer all run. Weights of a stored version are read with
`specd.drafter.checkpoint.load_drafter`; stores themselves live a layer up, in `specd.hotswap`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from specd.core.errors import ConfigurationError
from specd.drafter.base import check_sampled_drafts
from specd.drafter.checkpoint import DrafterModel
from specd.drafter.feature_drafter import FeatureDrafter
from specd.drafter.feature_model import FeatureDrafterModel
from specd.drafter.hybrid import HybridDrafter
from specd.drafter.pretrained import SHIPPED_DRAFTER, day0_feature_model
from specd.drafter.swap import ServingDrafter
from specd.drafter.token_drafter import DrafterShape, TargetHead, TokenDrafter, new_drafter_model
from specd.drafter.traffic_table import TrafficTable
from specd.model.fingerprint import TargetFingerprint
from specd.model.transformer import Transformer

log = logging.getLogger(__name__)

DRAFTER_KINDS = ("hybrid", "learned")
DRAFTER_ARCHS = ("feature", "token")



@dataclass(frozen=True)
class DrafterSpec:
    kind: str = "hybrid"
    arch: str = "feature"         # the learned drafter: "feature" (reads the target's states) or "token"
    layers: int = 1               # decoder layers of a day-0 token drafter
    head_vocab: int = 8192        # ids its output head covers (capped at the target's vocabulary)
    traffic_table: bool = True    # hybrid only: continuations learned across requests
    # hybrid only: the most drafts a context match or table continuation proposes in one step, past
    # the step's k where larger (`HybridDrafter.context_k`); None: k. For engines whose proposals
    # may be wider than k (specd's own), not for vLLM's proposer slot, which takes exactly k.
    context_k: int | None = None
    pretrained: bool = True       # feature: start from the shipped pretrained version when it fits
    # the learned drafter's drafts for sampled rows (`base.SAMPLED_DRAFTS`); None: what its gate
    # replays exactly (feature: a draw from q, its acceptance computed from the target's features;
    # token: the argmax, as its records carry no distribution). benchmarks/sampled_drafts.py
    sampled_drafts: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ConfigurationError(f"drafter kind {self.kind!r}: choose one of {', '.join(DRAFTER_KINDS)}")
        if self.arch not in DRAFTER_ARCHS:
            raise ConfigurationError(f"drafter arch {self.arch!r}: choose one of {', '.join(DRAFTER_ARCHS)}")
        if self.context_k is not None and self.context_k < 1:
            raise ConfigurationError(f"context_k must be at least 1, got {self.context_k}")
        if self.layers < 1 or self.head_vocab < 1:
            raise ConfigurationError(f"a drafter needs at least one layer and one head id, "
                                     f"got {self.layers} and {self.head_vocab}")
        if self.sampled_drafts is not None:
            check_sampled_drafts(self.sampled_drafts)


def initial_model(target: Transformer | TargetHead, spec: DrafterSpec, seed: int = 0,
                  fingerprint: TargetFingerprint | None = None) -> DrafterModel:
    """A day-0 drafter for this target. Feature: the shipped pretrained version when `spec` asks
    for it and it fits the target (checked against `fingerprint`), else a fresh one. Token: random
    layers on the target's embedding, a head over the first ids."""
    if spec.arch == "feature":
        if not isinstance(target, Transformer):
            raise ConfigurationError("a feature drafter needs the whole target (it reads its layers)")
        pretrained = SHIPPED_DRAFTER if spec.pretrained else None
        model, origin = day0_feature_model(target, fingerprint, spec.head_vocab, pretrained, seed)
        log.info("day-0 feature drafter: %s", origin)
        return model
    config = target.config
    shape = DrafterShape.like(config, spec.layers, min(spec.head_vocab, config.vocab_size))
    return new_drafter_model(target, shape, copy_from_target=True, seed=seed)


def build_drafter(spec: DrafterSpec, model: DrafterModel, version: int,
                  table: TrafficTable | None = None) -> ServingDrafter:
    """The drafter a server runs (a feature drafter for a `FeatureDrafterModel`, else a token
    drafter); a hybrid one gets `table`, or a fresh one when the spec wants one."""
    learned: TokenDrafter | FeatureDrafter = (
        FeatureDrafter(model, version, sampled_drafts=spec.sampled_drafts or "sample")
        if isinstance(model, FeatureDrafterModel)
        else TokenDrafter(model, version, sampled_drafts=spec.sampled_drafts or "argmax"))
    if spec.kind == "learned":
        return learned
    if table is None and spec.traffic_table:
        table = TrafficTable()
    return HybridDrafter(learned, table, context_k=spec.context_k)
