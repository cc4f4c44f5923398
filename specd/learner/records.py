"""Trajectory records: what a server tells the learner about one request, and their validation.

Contract: a record is self-contained and small (token ids, not text): schema version, record id,
server id, prompt and output ids, one entry per verification step (position, drafts, accepted
count, drafter version), sampling settings and timestamps. `validate_record` turns an untrusted
dict (from JSON, MQTT, anywhere) into a `TrajectoryRecord` or raises `RecordRefused` with the
reason; it never lets a malformed record reach training.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from specd.serving.request import Sequence

SCHEMA_VERSION = 1
MAX_TOKENS_PER_RECORD = 65_536
MAX_DRAFTS_PER_STEP = 64


class RecordRefused(ValueError):
    """A record that fails validation; the message says which field and why."""


@dataclass(frozen=True)
class StepRecord:
    position: int             # index (in prompt + output) of the first token this step emitted
    drafts: list[int]
    num_accepted: int
    version: str


@dataclass(frozen=True)
class TrajectoryRecord:
    record_id: str
    server_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[StepRecord]
    temperature: float
    top_p: float
    created: float
    finished: float
    domain: str | None = None
    schema_version: int = SCHEMA_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def record_from_sequence(seq: Sequence, server_id: str, finished: float, domain: str | None = None) -> TrajectoryRecord:
    # the engine's step position is the sequence length before the step, which is exactly the
    # index of the first token that step emitted
    steps = [StepRecord(s.position, list(s.drafts), s.num_accepted, s.drafter_version) for s in seq.steps]
    return TrajectoryRecord(uuid.uuid4().hex, server_id, list(seq.prompt_ids), list(seq.output_ids), steps,
                            seq.params.temperature, seq.params.top_p, seq.created, finished, domain)


def _int_list(value: Any, name: str, vocab_size: int, limit: int) -> list[int]:
    if not isinstance(value, list):
        raise RecordRefused(f"{name} must be a list of token ids")
    if len(value) > limit:
        raise RecordRefused(f"{name} has {len(value)} entries, more than the bound {limit}")
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise RecordRefused(f"{name} holds {token!r}, not a token id in [0, {vocab_size})")
    return value


def validate_record(raw: Any, vocab_size: int) -> TrajectoryRecord:
    """Check an untrusted record dict field by field; returns the typed record."""
    if not isinstance(raw, dict):
        raise RecordRefused("a record must be a JSON object")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise RecordRefused(f"unknown schema version {raw.get('schema_version')!r} "
                            f"(this learner reads {SCHEMA_VERSION})")
    prompt = _int_list(raw.get("prompt_ids"), "prompt_ids", vocab_size, MAX_TOKENS_PER_RECORD)
    output = _int_list(raw.get("output_ids"), "output_ids", vocab_size, MAX_TOKENS_PER_RECORD)
    if not prompt or not output:
        raise RecordRefused("prompt_ids and output_ids must both be non-empty")
    total = len(prompt) + len(output)
    steps_raw = raw.get("steps")
    if not isinstance(steps_raw, list) or len(steps_raw) > len(output):
        raise RecordRefused("steps must be a list with at most one entry per output token")
    steps = []
    for i, step in enumerate(steps_raw):
        if not isinstance(step, dict):
            raise RecordRefused(f"steps[{i}] must be an object")
        drafts = _int_list(step.get("drafts"), f"steps[{i}].drafts", vocab_size, MAX_DRAFTS_PER_STEP)
        position, accepted = step.get("position"), step.get("num_accepted")
        if not isinstance(position, int) or not len(prompt) <= position < total:
            raise RecordRefused(f"steps[{i}].position {position!r} is outside the output")
        if not isinstance(accepted, int) or not 0 <= accepted <= len(drafts):
            raise RecordRefused(f"steps[{i}].num_accepted {accepted!r} is not in [0, {len(drafts)}]")
        steps.append(StepRecord(position, drafts, accepted, str(step.get("version", ""))))
    try:
        return TrajectoryRecord(
            record_id=str(raw["record_id"]), server_id=str(raw["server_id"]), prompt_ids=prompt,
            output_ids=output, steps=steps, temperature=float(raw["temperature"]), top_p=float(raw["top_p"]),
            created=float(raw["created"]), finished=float(raw["finished"]),
            domain=None if raw.get("domain") is None else str(raw["domain"]))
    except (KeyError, TypeError, ValueError) as error:
        raise RecordRefused(f"missing or malformed field: {error}") from None
