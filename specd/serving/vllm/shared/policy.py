"""Which of the drafter's drafts go to vLLM each step, and whether the learned drafter runs at all.

Contract (plain Python, no vLLM import): `DraftPolicy` owns the draft budget, the learned
drafter's gate and the shadow book (see `budget`), and is driven once per vLLM step, in order:
- `observe(request_ids, sampled, tracker, now)` right after `StepTracker.observe` read the step:
  the drafts verified at this step update their source's acceptance, held-back drafts the
  target's tokens have now settled are scored the same way, and a steady decode step's wall time
  (since the previous `observe`), less the drafter's own passes in it, is fitted against the
  tokens it verified;
- `use_learned()` before drafting: the gate's decision (only asked when the drafter has a
  learned part it can switch off);
- `choose(request_ids, candidates, lengths, sampled)` after drafting: per row, the leading drafts
  worth verifying. A row gets none while it prefills (nothing sampled this step) and never more
  than fit before max_model_len; drafts it holds back go to the shadow book, so a source below
  the bar keeps being measured without being verified. Rows whose drafts come with the drafter's
  confidence in each (`Candidates.confidences`) are trimmed by it (`DraftBudget.keep_confident`),
  and their verified and shadow-scored drafts calibrate it. It also tells the gate what the learned
  drafter's sent drafts are expected to earn against its time.
`forget(request_id)` drops a finished request's pending shadow. The policy never changes the
tokens vLLM emits, only how many drafts it verifies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specd.serving.vllm.shared.budget import DraftBudget, LearnedDrafterSwitch, ShadowBook
from specd.serving.vllm.shared.tracking import StepTracker


@dataclass
class Candidates:
    """What the drafter offers at one step, per batch row."""

    drafts: list[list[int]]       # [rows][k] token ids
    limits: list[int]             # [rows] drafts usable (fewer while a row's drafter is not ready)
    sources: list[str]            # [rows] where the drafts came from: "context4", "table2", "learned", ...
    learned_seconds: float | None = None   # the learned drafter's time at this step; None when it did not run
    confidences: list[list[float]] | None = None  # [rows][k] the drafter's top probability per draft ([] if none)


class DraftPolicy:
    def __init__(self, budget: DraftBudget, max_model_len: int, gate: LearnedDrafterSwitch | None = None) -> None:
        self.budget = budget
        self.max_model_len = max_model_len
        self.gate = gate or LearnedDrafterSwitch()
        self.shadow = ShadowBook()
        self.drafts_sent = self.drafts_withheld = 0
        self.learned_steps = 0
        # request id -> source of the drafts sent in full last step, and the drafter's confidence in them
        self._sent: dict[str, tuple[str, list[float]]] = {}
        self._step_seconds, self._emitted = 0.0, 0   # the last steady decode step's time and output
        self._last_call: float | None = None

    def observe(self, request_ids: Sequence[str], sampled: Sequence[Sequence[int]], tracker: StepTracker,
                now: float) -> None:
        """Learn from the step vLLM just verified, as `tracker.observe` read it (`now`: when this step began)."""
        for request_id in request_ids:
            trajectory = tracker.live.get(request_id)
            scored = self.shadow.score(request_id, trajectory.tokens) if trajectory is not None else None
            if scored is not None:
                self.budget.observe_drafts(*scored, request_id=request_id)
        verified_drafts = {}
        for request_id, drafted, accepted in tracker.last_verified:
            verified_drafts[request_id] = drafted
            sent = self._sent.get(request_id)
            if sent is not None:
                self.budget.observe_drafts(sent[0], drafted, accepted, sent[1], request_id)
        previous, self._last_call = self._last_call, now
        # a step that also prefilled a prompt is not a decode step: its time says nothing about drafts
        steady = previous is not None and all(sampled) and set(request_ids) <= set(tracker.previous_rows)
        if steady and previous is not None:
            verified = sum(1 + verified_drafts.get(request_id, 0) for request_id in request_ids)
            self._step_seconds, self._emitted = now - previous, sum(len(s) for s in sampled)
            # the drafter's passes at the step before ran inside this interval: not verification's price
            self.budget.observe_step(self._step_seconds, verified, self._emitted, len(request_ids),
                                     drafting_seconds=self.budget.last_drafting_seconds)

    def use_learned(self) -> bool:
        """Whether the learned drafter runs at this step."""
        decision = self.gate.decide()
        self.learned_steps += decision
        return decision

    def choose(self, request_ids: Sequence[str], candidates: Candidates, lengths: np.ndarray,
               sampled: Sequence[Sequence[int]]) -> list[list[int]]:
        """The drafts to send per row; the rest of each row's usable drafts are held back and shadow-scored."""
        rows = len(request_ids)
        drafts = []
        self._sent = {}
        self.budget.rows = rows
        learned_expected = 0.0
        for row, request_id in enumerate(request_ids):
            source, offered = candidates.sources[row], candidates.drafts[row]
            room = self.max_model_len - 1 - int(lengths[row])  # vLLM never verifies past max_model_len
            usable = max(min(int(candidates.limits[row]), room), 0) if sampled[row] else 0
            confidences = candidates.confidences[row][:usable] if candidates.confidences else []
            worth = self.budget.keep_confident(confidences, usable) if len(confidences) == usable \
                else self.budget.keep(source, usable)
            self.drafts_sent += worth
            self.drafts_withheld += usable - worth
            drafts.append(offered[:worth])
            if worth == usable > 0:  # verification will tell how they fared
                self._sent[request_id] = source, confidences
            elif worth < usable:     # held back (some or all): scored against what the target produces
                self.shadow.add(request_id, source, int(lengths[row]), offered[:usable], confidences)
            if source == "learned":
                learned_expected += self.budget.expected_accepted("learned", worth)
        if candidates.learned_seconds is not None:
            self.gate.observe(learned_expected, self._emitted, candidates.learned_seconds, self._step_seconds)
        return drafts

    def forget(self, request_id: str) -> None:
        """A finished request: its held-back drafts will never be settled."""
        self.shadow.drop(request_id)
        self.budget.first_drafts.forget(request_id)

    def status(self) -> dict[str, Any]:
        """The policy's part of the proposer's status."""
        return {"learned_drafter_steps": self.learned_steps,
                "learned_gain": self.gate.gain, "learned_cost": self.gate.cost,
                "draft_bar": self.budget.bar, "drafting_bar": self.budget.drafting_bar,
                "bars_by_batch": self.budget.bars_by_batch(),
                "drafts_sent": self.drafts_sent,
                "drafts_withheld": self.drafts_withheld,
                "acceptance_by_confidence": self.budget.calibration.status(),
                "acceptance_by_source": {src: [round(a, 3) for a in self.budget.alpha(src)]
                                         for src in sorted(self.budget.reached)}}
