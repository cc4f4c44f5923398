"""Per-request objects: sampling settings and the `Sequence` that travels through the engine.

Contract: `SamplingParams` is validated on construction, so a bad setting is refused before it
reaches the engine; settings too small for float32 on the device (a temperature under
`GREEDY_BELOW`, a top_p under `MIN_TOP_P`) are replaced by the ones that mean the same. A
`Sequence` carries one request's prompt, output and the log of its verification steps (position,
drafts, how many were accepted, drafter version): that log is the raw material of the learner's
trajectory records (`record_from_sequence`), and its counts are the request's statistics. An
engine that records features appends the target's features of each step's verified positions
(`feature_chunks`, fp16 on the CPU); the record carries them when they cover every position
0..num_tokens-2.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

import torch

from specd.core.errors import RequestRefused
from specd.core.records import LEARNED_SOURCE, AcceptanceCounts, FeatureBlock, StepRecord, TrajectoryRecord
from specd.model.seeded_draws import PositionNoise

# As vLLM: temperatures below 1e-5 mean greedy. Far below it, logits / temperature overflow float32
# to inf and the probabilities become NaN (a tiny target then emitted its last token forever).
GREEDY_BELOW = 1e-5
# A top_p under float32's smallest subnormal rounds to 0 on the device and keeps no token at all;
# any top_p this small keeps just the most likely token, as 1e-6 does (for vocabularies under 10**6).
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0 means greedy
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN and infinity fail too (JSON parsers accept them)
            raise RequestRefused(f"temperature must be a finite number, 0 or more, got {self.temperature}",
                                 param="temperature")
        if not 0 < self.top_p <= 1:
            raise RequestRefused(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if 0 < self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        # torch's generators take seeds in [-2**63, 2**64); outside it the engine step would fail
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise RequestRefused(f"seed must be in [-2**63, 2**64), got {self.seed}", param="seed")
        if self.max_tokens < 1:
            raise RequestRefused(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class VerifyStep:
    """One verification pass of one request."""

    position: int              # sequence length before the step (index of the first new token)
    drafts: tuple[int, ...]    # the drafts that were verified (empty without speculation)
    num_accepted: int          # drafts the target accepted
    drafter_version: int | None   # None: no drafter ran
    source: str = LEARNED_SOURCE  # who drafted: the learned drafter, or "context<n>", "table<n>", ...


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "stop" (EOS), "length" (max_tokens), "cancelled" or "error"
    error: str | None = None             # why it failed alone ("error"), the rest of the batch unharmed
    steps: list[VerifyStep] = field(default_factory=list)
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0         # accepted and emitted (a stop can cut accepted drafts)
    created: float = field(default_factory=time.time)
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)
    noise: PositionNoise | None = field(default=None, repr=False)  # a seeded sampled request's draws
    feature_chunks: list[torch.Tensor] = field(default_factory=list, repr=False)  # each [n, F], in order

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_target_passes(self) -> int:
        return len(self.steps)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def accept_length(self) -> float:
        """Tokens emitted per target verification pass."""
        return self.num_output_tokens / max(self.num_target_passes, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_drafts_accepted / max(self.num_drafts_proposed, 1)

    @property
    def counts(self) -> AcceptanceCounts:
        """This request's drafts, accepted drafts, target passes and tokens, as reports count them."""
        return AcceptanceCounts(self.num_drafts_proposed, self.num_drafts_accepted, self.num_target_passes,
                                self.num_output_tokens)

    def record_step(self, position: int, drafts: list[int], num_accepted: int, num_kept: int,
                    drafter_version: int | None, source: str = LEARNED_SOURCE) -> None:
        self.steps.append(VerifyStep(position, tuple(drafts), num_accepted, drafter_version, source))
        self.num_drafts_proposed += len(drafts)
        self.num_drafts_accepted += num_kept


def record_from_sequence(seq: Sequence, server_id: str, finished: float, domain: str | None = None) -> TrajectoryRecord:
    """The trajectory record of a finished request."""
    # the engine's step position is the sequence length before the step, which is exactly the
    # index of the first token that step emitted
    steps = [StepRecord(s.position, list(s.drafts), s.num_accepted, s.drafter_version, s.source) for s in seq.steps]
    return TrajectoryRecord(uuid.uuid4().hex, server_id, list(seq.prompt_ids), list(seq.output_ids), steps,
                            seq.params.temperature, seq.params.top_p, seq.created, finished, domain,
                            features=_features(seq))


def _features(seq: Sequence) -> FeatureBlock | None:
    """The features of positions 0..num_tokens-2, when they were captured for all of them (a drafter
    swapped in mid-request, or to other layers, leaves a partial or mixed capture: none is sent)."""
    chunks = seq.feature_chunks
    if not chunks or len({c.shape[-1] for c in chunks}) > 1 or sum(len(c) for c in chunks) != seq.num_tokens - 1:
        return None
    return FeatureBlock.of(torch.cat(chunks).numpy())
