"""The replay drafter: proposes the target's own recorded continuation, at no cost.

Contract: built from recordings {prompt token ids: output token ids} of a target-only greedy run.
For a row whose prompt was recorded it proposes the next k recorded tokens after what the row has
emitted so far (deterministic, q one-hot); past the recording's end, or for an unknown prompt, it
proposes token 0, which the target rejects like any wrong guess. Under greedy decoding every
recorded draft is accepted, so it measures how much of an accept length the engine turns into
speed, with drafting cost zero.
"""

from __future__ import annotations

import torch

from specd.drafter.base import DraftBatch, Proposal
from specd.serving.model import Transformer
from specd.serving.request import SamplingParams


class ReplayDrafter:
    def __init__(self, recordings: dict[tuple[int, ...], list[int]]) -> None:
        self.recordings = recordings
        self._slots: list[list[int] | None] = []  # per slot: the recording its request replays

    @property
    def version(self) -> str:
        return "replay"

    def bind(self, max_batch: int, max_seq: int, device: torch.device) -> None:
        self._slots = [None] * max_batch

    def start(self, slot: int) -> None:
        self._slots[slot] = None

    def move(self, src: int, dst: int) -> None:
        self._slots[dst] = self._slots[src]

    def propose(self, batch: DraftBatch, k: int) -> Proposal:
        drafts = torch.zeros(batch.num_rows, k, dtype=torch.long)
        for row, (length, prompt_length) in enumerate(zip(batch.lengths.tolist(), batch.prompt_lengths, strict=True)):
            recording = self._slots[row]
            if recording is None:
                prompt = tuple(batch.tokens[row, :prompt_length].tolist())
                recording = self._slots[row] = self.recordings.get(prompt, [])
            upcoming = recording[length - prompt_length:length - prompt_length + k]
            drafts[row, :len(upcoming)] = torch.tensor(upcoming, dtype=torch.long)
        return Proposal(drafts.to(batch.tokens.device))

    def commit(self, num_accepted: torch.Tensor) -> None:
        pass


def record_greedy(target: Transformer, prompts: list[list[int]], max_tokens: int,
                  eos_token_ids: tuple[int, ...] = (), max_batch: int = 8) -> ReplayDrafter:
    """Decode the prompts target-only (greedy) and return a drafter that replays the outputs."""
    from specd.serving.engine import Engine, EngineConfig

    engine = Engine(target, None, EngineConfig(max_batch=max_batch, eos_token_ids=eos_token_ids))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return ReplayDrafter({tuple(p): seq.output_ids for p, seq in zip(prompts, outputs, strict=True)})
