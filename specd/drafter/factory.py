"""The one place a serving drafter is built: from a kind, a model and its version.

Contract: `DrafterSpec` names what a server runs (kind "hybrid": context matches and the traffic
table before the learned drafter; "learned": the learned drafter alone) and the shape of a
day-0 drafter (`layers`, `head_vocab`); it is checked on construction. `initial_model` makes
that day-0 drafter for a target (random layers on the target's frozen embedding, an output head
over the first `head_vocab` ids); `build_drafter` wraps a model and its version into what the
engine, the demo and the vLLM proposer all run. Weights of a stored version are read with
`specd.drafter.checkpoint.load_drafter`; stores themselves live a layer up, in `specd.hotswap`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd.drafter.hybrid import HybridDrafter
from specd.drafter.token_drafter import DrafterShape, TargetHead, TokenDrafter, new_drafter_model
from specd.drafter.traffic_table import TrafficTable
from specd.errors import ConfigurationError
from specd.model.transformer import Transformer

DRAFTER_KINDS = ("hybrid", "learned")

# what servers run: the learned drafter, alone or behind context matching
ServingDrafter = TokenDrafter | HybridDrafter


@dataclass(frozen=True)
class DrafterSpec:
    kind: str = "hybrid"
    layers: int = 1               # decoder layers of a day-0 drafter
    head_vocab: int = 8192        # ids its output head covers (capped at the target's vocabulary)
    traffic_table: bool = True    # hybrid only: continuations learned across requests

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ConfigurationError(f"drafter kind {self.kind!r}: choose one of {', '.join(DRAFTER_KINDS)}")
        if self.layers < 1 or self.head_vocab < 1:
            raise ConfigurationError(f"a drafter needs at least one layer and one head id, "
                                     f"got {self.layers} and {self.head_vocab}")


def initial_model(target: Transformer | TargetHead, spec: DrafterSpec, seed: int = 0) -> Transformer:
    """A day-0 drafter for this target: random layers on its embedding, a head over the first ids."""
    config = target.config
    shape = DrafterShape.like(config, spec.layers, min(spec.head_vocab, config.vocab_size))
    return new_drafter_model(target, shape, copy_from_target=True, seed=seed)


def build_drafter(spec: DrafterSpec, model: Transformer, version: str,
                  table: TrafficTable | None = None) -> ServingDrafter:
    """The drafter a server runs; a hybrid one gets `table`, or a fresh one when the spec wants one."""
    learned = TokenDrafter(model, version)
    if spec.kind == "learned":
        return learned
    if table is None and spec.traffic_table:
        table = TrafficTable()
    return HybridDrafter(learned, table)
