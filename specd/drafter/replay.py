"""The replay drafter: proposes the target's own recorded continuation, at no cost.

Contract: built from recordings {prompt token ids: output token ids} of a target-only greedy run.
For a row whose prompt was recorded it proposes the next k recorded tokens after what the row has
emitted so far (deterministic, q one-hot); past the recording's end, or for an unknown prompt, it
proposes token 0, which the target rejects like any wrong guess. Under greedy decoding every
recorded draft is accepted, so it measures how much of an accept length the engine turns into
speed, with drafting cost zero. `specd.engine.greedy_recording.record_greedy` makes the recordings.
"""

from __future__ import annotations

import torch

from specd.drafter.base import BUILT_IN_VERSION, DraftBatch, Proposal


class ReplayDrafter:
    def __init__(self, recordings: dict[tuple[int, ...], list[int]]) -> None:
        self.recordings = recordings
        self._slots: list[list[int] | None] = []  # per slot: the recording its request replays

    @property
    def version(self) -> int:
        return BUILT_IN_VERSION

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
