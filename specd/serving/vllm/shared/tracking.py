"""Bookkeeping between vLLM's batch rows and specd's drafter: slots, verification outcomes, records.

Contract (plain Python and numpy, no vLLM import, so it is tested without vLLM):
- `SlotTable.arrange(request_ids, drafter)` makes drafter slot i hold request_ids[i] before each
  proposal. vLLM compacts its rows as requests finish and drops unscheduled or preempted requests
  from the batch; a request that leaves the batch is parked in a spare slot (its drafter cache
  kept) and moved back when it returns, and a request the drafter never saw (or whose parked
  state was evicted, least recently seen first) starts from an empty slot.
- `StepTracker.observe` reads one step's outcome: when request r got drafts D at the previous
  step, this step's sampled tokens S for r (its accepted drafts plus one correction or bonus
  token) give accepted = len(S) - 1 and rejected = len(D) - accepted. Drafts pending for a
  request that is not in this batch, or that is back in prefill (S empty), were never verified
  and are voided. It keeps each request's tokens and steps, turns a finished request into a
  `TrajectoryRecord`, and keeps totals (drafts, accepted, target passes, emitted tokens) per
  version and drafting source kind for acceptance reports (a pass that verified no drafts counts
  under "none").
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from specd.core.records import (
    LEARNED_SOURCE,
    NO_DRAFTS_SOURCE,
    AcceptanceCounts,
    AcceptanceReport,
    StepRecord,
    TrajectoryRecord,
    reports_from,
    source_kind,
)
from specd.drafter.base import BUILT_IN_VERSION


class SlotDrafter(Protocol):
    def start(self, slot: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...


class SlotTable:
    """Which request each drafter slot holds: rows [0, rows) mirror the batch, the rest park."""

    def __init__(self, rows: int, parked: int) -> None:
        if rows < 1 or parked < 0:
            raise ValueError(f"slot table needs rows >= 1 and parked >= 0, got {rows} and {parked}")
        self.rows = rows
        self.owner: list[str | None] = [None] * (rows + parked)
        self._seen: dict[str, int] = {}   # request id -> step it was last in the batch
        self._step = 0

    @property
    def capacity(self) -> int:
        return len(self.owner)

    def arrange(self, request_ids: Sequence[str], drafter: SlotDrafter) -> None:
        if len(request_ids) > self.rows:
            raise ValueError(f"{len(request_ids)} rows in the batch, the drafter was bound for {self.rows}")
        self._step += 1
        wanted = {request_id: row for row, request_id in enumerate(request_ids)}
        for request_id in request_ids:
            self._seen[request_id] = self._step
        # requests that left the batch: park their state
        for slot in range(self.rows):
            owner = self.owner[slot]
            if owner is not None and owner not in wanted:
                self._park(slot, drafter, wanted)
        # requests that changed rows: move straight in once the target row is free; park to break cycles
        pending = {slot: wanted[owner] for slot in range(self.rows)
                   if (owner := self.owner[slot]) is not None and wanted[owner] != slot}
        while pending:
            free = [(slot, target) for slot, target in pending.items() if self.owner[target] is None]
            for slot, target in free:
                drafter.move(slot, target)
                self.owner[target], self.owner[slot] = self.owner[slot], None
                del pending[slot]
            if not free:
                slot = next(iter(pending))
                self._park(slot, drafter, wanted)
                del pending[slot]
        for row, request_id in enumerate(request_ids):
            if self.owner[row] == request_id:
                continue
            source = self._find(request_id)
            if source is not None:
                drafter.move(source, row)
                self.owner[source] = None
            else:
                drafter.start(row)
            self.owner[row] = request_id

    def release(self, request_id: str) -> None:
        """A finished request: its slot may be reused at once."""
        for slot, owner in enumerate(self.owner):
            if owner == request_id:
                self.owner[slot] = None
        self._seen.pop(request_id, None)

    def _find(self, request_id: str) -> int | None:
        for slot in range(self.rows, self.capacity):
            if self.owner[slot] == request_id:
                return slot
        return None

    def _park(self, slot: int, drafter: SlotDrafter, wanted: dict[str, int]) -> None:
        owner = self.owner[slot]
        self.owner[slot] = None
        parking = range(self.rows, self.capacity)
        free = [s for s in parking if self.owner[s] is None]
        # evict the parked request seen least recently, never one this batch is about to take back
        evictable = [s for s in parking if self.owner[s] not in wanted]
        if owner is None or not (free or evictable):
            return  # nowhere to keep it: the request starts afresh if it returns
        spare = free[0] if free else min(evictable, key=lambda s: self._seen.get(self.owner[s] or "", -1))
        drafter.move(slot, spare)
        self.owner[spare] = owner


@dataclass
class Trajectory:
    """One request as the proposer saw it."""

    prompt_ids: list[int]
    tokens: list[int]                  # prompt + output so far
    created: float
    steps: list[StepRecord] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)   # proposed at the last step, not yet verified
    drafted_at: int = 0                # sequence length when they were proposed
    version: int = BUILT_IN_VERSION  # of the drafter that proposed `drafts`
    source: str = LEARNED_SOURCE       # who drafted them
    stop_checked: int = 0              # output tokens already known not to be stop tokens
    # {"temperature", "top_p"} from vLLM's params while the request is in its map: a request that
    # leaves it (a stop string, an abort) is recorded with them, not as greedy
    sampling: dict[str, float] | None = None


def stop_index(output: Sequence[int], max_tokens: int | None, stop_ids: set[int], room: int,
               checked: int = 0) -> int | None:
    """How many output tokens a finished request keeps, or None while it is still running.

    Mirrors vLLM's stop check per token: a stop token (kept), max_tokens, or no room left in
    the context (`room`: the output length at which the sequence fills max_model_len). Tokens
    before `checked` are known not to be stop tokens.
    """
    for index in range(checked, len(output)):
        if output[index] in stop_ids:
            return index + 1
    limit = min(max_tokens if max_tokens is not None else room, room)
    return limit if len(output) >= limit else None


class StepTracker:
    def __init__(self, server_id: str, domain: str | None = None, keep_finished: int = 4096) -> None:
        self.server_id = server_id
        self.domain = domain
        self.live: dict[str, Trajectory] = {}
        self.totals: dict[tuple[int, str], AcceptanceCounts] = {}  # (version, source kind)
        self.previous_rows: list[str] = []
        self.last_verified: list[tuple[str, int, int]] = []  # (request id, drafts, accepted) at the last observe
        self._finished: OrderedDict[str, None] = OrderedDict()   # ids already turned into records
        self._keep_finished = keep_finished

    def observe(self, request_ids: Sequence[str], sampled: Sequence[Sequence[int]], lengths: np.ndarray,
                prompt_lengths: np.ndarray, token_rows: np.ndarray, version: int) -> list[int]:
        """Take one step's outcome; returns, per row of the previous proposal, its accepted drafts."""
        row_of = {request_id: row for row, request_id in enumerate(request_ids)}
        accepted_by_previous_row = []
        verified_by: dict[str, tuple[int, str]] = {}   # request id -> (version, source kind) of the drafts verified
        self.last_verified = []
        for request_id in self.previous_rows:
            trajectory, row = self.live.get(request_id), row_of.get(request_id)
            accepted = 0
            if trajectory is not None and trajectory.drafts and row is not None and sampled[row]:
                accepted = min(len(sampled[row]) - 1, len(trajectory.drafts))
                trajectory.steps.append(StepRecord(trajectory.drafted_at, trajectory.drafts, accepted,
                                                   trajectory.version, trajectory.source))
                key = (trajectory.version, source_kind(trajectory.source, len(trajectory.drafts)))
                totals = self.totals.setdefault(key, AcceptanceCounts())
                totals.drafts += len(trajectory.drafts)
                totals.accepted += accepted
                verified_by[request_id] = key
                self.last_verified.append((request_id, len(trajectory.drafts), accepted))
            if trajectory is not None:
                trajectory.drafts = []  # verified, or voided
            accepted_by_previous_row.append(accepted)
        for row, request_id in enumerate(request_ids):
            if request_id in self._finished:
                continue
            length = int(lengths[row])
            trajectory = self.live.get(request_id)
            if trajectory is None:
                prompt = token_rows[row, :int(prompt_lengths[row])].tolist()
                trajectory = self.live[request_id] = Trajectory(prompt, list(prompt), time.time())
            if length > len(trajectory.tokens):
                trajectory.tokens.extend(token_rows[row, len(trajectory.tokens):length].tolist())
            if sampled[row]:
                totals = self.totals.setdefault(verified_by.get(request_id, (version, NO_DRAFTS_SOURCE)),
                                                AcceptanceCounts())
                totals.passes += 1
                totals.emitted += len(sampled[row])
        return accepted_by_previous_row

    def remember(self, request_ids: Sequence[str], drafts: Sequence[list[int]], lengths: np.ndarray,
                 version: int, sources: Sequence[str] | None = None) -> None:
        """The drafts just proposed per row (and who drafted them); the next `observe` learns their fate."""
        self.previous_rows = list(request_ids)
        for row, request_id in enumerate(request_ids):
            trajectory = self.live.get(request_id)
            if trajectory is not None:
                trajectory.drafts, trajectory.drafted_at, trajectory.version = drafts[row], int(lengths[row]), version
                trajectory.source = sources[row] if sources is not None else LEARNED_SOURCE

    def is_finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def finish(self, request_id: str, keep_output: int | None = None, sampling: dict[str, Any] | None = None
               ) -> TrajectoryRecord | None:
        """Close a request; its record, or None when it produced no output (or was closed before)."""
        trajectory = self.live.pop(request_id, None)
        self._finished[request_id] = None
        while len(self._finished) > self._keep_finished:
            self._finished.popitem(last=False)
        if trajectory is None:
            return None
        prompt = trajectory.prompt_ids
        output = trajectory.tokens[len(prompt):]
        if keep_output is not None:
            output = output[:keep_output]
        if not prompt or not output:
            return None
        total = len(prompt) + len(output)
        steps = [step for step in trajectory.steps if step.position < total]
        sampling = sampling or {}
        return TrajectoryRecord(uuid.uuid4().hex, self.server_id, prompt, output, steps,
                                float(sampling.get("temperature", 0.0)), float(sampling.get("top_p", 1.0)),
                                trajectory.created, time.time(), self.domain,
                                extra={"vllm_request_id": request_id})

    def report(self) -> AcceptanceReport:
        """A cumulative acceptance report, as specd's own servers send (one domain)."""
        domain = self.domain or "default"
        totals: dict[tuple[int | None, str, str], AcceptanceCounts] = {
            (version, source, domain): replace(counts) for (version, source), counts in self.totals.items()}
        reports = reports_from(self.server_id, totals)
        return reports[0] if reports else AcceptanceReport(self.server_id, time.time(), domain, {})
