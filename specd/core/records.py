"""What servers tell the learner: trajectory records, acceptance counts and acceptance reports.

Contract: a record is self-contained and small (token ids, not text): schema version, record id,
server id, prompt and output ids, one entry per verification step (position, drafts, accepted count,
drafter version, and the drafting source: "learned" for the learned drafter, or a context-match /
traffic-table source such as "context4" or "table2"), sampling settings and timestamps, and
optionally the target's features of its positions (`FeatureBlock`: float16, base64 in JSON) for a
learner that trains a feature drafter; a server that cannot capture them (vLLM) sends ids only.
`validate_record` turns an untrusted dict (from JSON, MQTT, anywhere) into a `TrajectoryRecord` or
raises `RecordRefused` with the reason; it never lets a malformed record reach training.
`AcceptanceCounts` is the one type for "drafts proposed, drafts accepted, target passes, tokens
emitted", used by the engine's metrics, specd's and vLLM's servers, their reports and the canary
alike; an `AcceptanceReport` carries cumulative counts for one server and traffic domain, per
drafter version (the learned drafter's own drafts only) and per drafting source kind
(`source_kind`), and `validate_report` checks an untrusted one. This module knows nothing of
engines or models.
"""

from __future__ import annotations

import base64
import binascii
import math
import time as clock
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from specd.core.errors import RecordRefused, RefusalReason

SCHEMA_VERSION = 1
LEARNED_SOURCE = "learned"
NO_DRAFTS_SOURCE = "none"  # a pass that verified no drafts: no drafter's acceptance
MAX_SOURCE_CHARS = 32
MAX_TOKENS_PER_RECORD = 65_536
MAX_DRAFTS_PER_STEP = 64
MAX_NAME_CHARS = 128              # record ids, server ids and domains
MAX_REPORT_ENTRIES = 64           # versions (and sources) one report names: a server reports the few it served
MAX_FEATURE_BYTES = 64 * 2**20   # per record: ~14k positions of SmolLM2's four 576-wide states
FEATURE_DTYPE = "float16"


@dataclass(frozen=True)
class FeatureBlock:
    """The target's features of positions 0..n-1 of prompt + output: float16, row-major."""

    num_positions: int
    feature_size: int
    data: bytes

    @classmethod
    def of(cls, array: np.ndarray) -> FeatureBlock:
        array = np.ascontiguousarray(array, dtype="<f2")
        if array.ndim != 2:
            raise ValueError(f"features must be [positions, feature_size], got shape {array.shape}")
        return cls(int(array.shape[0]), int(array.shape[1]), array.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype="<f2").reshape(self.num_positions, self.feature_size)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": FEATURE_DTYPE, "shape": [self.num_positions, self.feature_size],
                "data": base64.b64encode(self.data).decode("ascii")}


def validate_features(raw: Any, num_tokens: int, feature_size: int | None) -> FeatureBlock:
    """An untrusted features object: float16, [n, F] with 1 <= n < num_tokens, F as expected, finite."""
    if not isinstance(raw, dict) or raw.get("dtype") != FEATURE_DTYPE:
        raise RecordRefused(f"features must be an object with dtype {FEATURE_DTYPE!r}", RefusalReason.FEATURES)
    shape = raw.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise RecordRefused("features shape must be [positions, feature_size] of positive integers",
                            RefusalReason.FEATURES)
    positions, size = shape
    if positions >= num_tokens:
        raise RecordRefused(f"features cover {positions} positions; a record of {num_tokens} tokens has at most "
                            f"{num_tokens - 1} (the last token is never run)", RefusalReason.FEATURES)
    if feature_size is not None and size != feature_size:
        raise RecordRefused(f"features are {size} wide; this learner's drafter reads {feature_size}",
                            RefusalReason.FEATURES)
    if positions * size * 2 > MAX_FEATURE_BYTES:
        raise RecordRefused(f"features of {positions * size * 2} bytes exceed the bound {MAX_FEATURE_BYTES}",
                            RefusalReason.FEATURES)
    data = raw.get("data")
    try:
        decoded = base64.b64decode(data, validate=True) if isinstance(data, str) else b""
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) != positions * size * 2:
        raise RecordRefused(f"features data must be base64 of {positions * size * 2} bytes", RefusalReason.FEATURES)
    block = FeatureBlock(positions, size, decoded)
    if not np.isfinite(block.array()).all():
        raise RecordRefused("features hold non-finite values", RefusalReason.FEATURES)
    return block


@dataclass(frozen=True)
class StepRecord:
    position: int             # index (in prompt + output) of the first token this step emitted
    drafts: list[int]
    num_accepted: int
    version: int | None       # the drafter version that proposed the drafts; None: no drafter ran
    source: str = LEARNED_SOURCE  # who drafted: the learned drafter, or "context<n>" / "table<n>" and the like


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
    features: FeatureBlock | None = None

    def to_dict(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "features"}
        raw = {**fields, "steps": [asdict(step) for step in self.steps]}
        if self.features is not None:
            raw["features"] = self.features.to_dict()
        return raw

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


NO_DRAFTER = "none"  # how a step that no drafter proposed for names its version in JSON and labels


def version_label(version: int | None) -> str:
    """A version as JSON object keys and Prometheus labels carry it."""
    return NO_DRAFTER if version is None else str(version)


def source_kind(source: str, num_drafts: int) -> str:
    """What a step's counts are shown under: the learned drafter's own drafts ("learned"), a kind of
    context matching ("context4" -> "context", "table2" -> "table"), or "none" for a pass that
    verified no drafts, so that no drafter is credited or blamed for it."""
    if num_drafts == 0:
        return NO_DRAFTS_SOURCE
    return source.rstrip("0123456789") or source


def parse_version(value: Any, name: str, reason: RefusalReason = RefusalReason.MALFORMED) -> int:
    """A drafter version number from untrusted input: a non-negative int, or its decimal string
    (how JSON object keys, Prometheus labels and records of older servers carry it)."""
    if isinstance(value, str) and value.isdecimal() and len(value) <= 18:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RecordRefused(f"{name} must be a drafter version number, got {value!r}", reason)
    return value


def _int_list(value: Any, name: str, vocab_size: int, limit: int) -> list[int]:
    if not isinstance(value, list):
        raise RecordRefused(f"{name} must be a list of token ids", RefusalReason.TOKENS)
    if len(value) > limit:
        raise RecordRefused(f"{name} has {len(value)} entries, more than the bound {limit}", RefusalReason.TOKENS)
    for token in value:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
            raise RecordRefused(f"{name} holds {token!r}, not a token id in [0, {vocab_size})", RefusalReason.TOKENS)
    return value


def _name(raw: dict[str, Any], field: str, optional: bool = False) -> str | None:
    """An id or label: a string (or, from older servers, an integer) of at most MAX_NAME_CHARS."""
    value = raw.get(field)
    if value in (None, "") and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int) or not 0 < len(str(value)) <= MAX_NAME_CHARS:
        raise RecordRefused(f"{field} must be a name of 1 to {MAX_NAME_CHARS} characters", RefusalReason.MALFORMED)
    return str(value)


def _number(raw: dict[str, Any], field: str, low: float = -math.inf, high: float = math.inf,
            low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with `low_open`): NaN, infinities and integers too
    large for a float (JSON allows all three) are refused here, not met by the learner's arithmetic."""
    value = raw.get(field)
    try:
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.nan
    if not math.isfinite(number) or number < low or number > high or (low_open and number == low):
        raise RecordRefused(f"{field} must be a finite number in {'(' if low_open else '['}{low}, {high}], "
                            f"got {str(value)[:40]}", RefusalReason.MALFORMED)
    return number


def validate_record(raw: Any, vocab_size: int, feature_size: int | None = None) -> TrajectoryRecord:
    """Check an untrusted record dict field by field; returns the typed record. Features, when
    present, must be `feature_size` wide (any width when None)."""
    if not isinstance(raw, dict):
        raise RecordRefused("a record must be a JSON object", RefusalReason.NOT_AN_OBJECT)
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise RecordRefused(f"unknown schema version {raw.get('schema_version')!r} "
                            f"(this learner reads {SCHEMA_VERSION})", RefusalReason.SCHEMA)
    prompt = _int_list(raw.get("prompt_ids"), "prompt_ids", vocab_size, MAX_TOKENS_PER_RECORD)
    output = _int_list(raw.get("output_ids"), "output_ids", vocab_size, MAX_TOKENS_PER_RECORD)
    if not prompt or not output:
        raise RecordRefused("prompt_ids and output_ids must both be non-empty", RefusalReason.TOKENS)
    total = len(prompt) + len(output)
    steps_raw = raw.get("steps")
    if not isinstance(steps_raw, list) or len(steps_raw) > len(output):
        raise RecordRefused("steps must be a list with at most one entry per output token", RefusalReason.STEPS)
    steps = []
    for i, step in enumerate(steps_raw):
        if not isinstance(step, dict):
            raise RecordRefused(f"steps[{i}] must be an object", RefusalReason.STEPS)
        drafts = _int_list(step.get("drafts"), f"steps[{i}].drafts", vocab_size, MAX_DRAFTS_PER_STEP)
        position, accepted = step.get("position"), step.get("num_accepted")
        if not isinstance(position, int) or not len(prompt) <= position < total:
            raise RecordRefused(f"steps[{i}].position {position!r} is outside the output", RefusalReason.STEPS)
        if not isinstance(accepted, int) or not 0 <= accepted <= len(drafts):
            raise RecordRefused(f"steps[{i}].num_accepted {accepted!r} is not in [0, {len(drafts)}]",
                                RefusalReason.STEPS)
        source = step.get("source", LEARNED_SOURCE)  # records from before sources were named: the learned drafter's
        if not isinstance(source, str) or not 0 < len(source) <= MAX_SOURCE_CHARS:
            raise RecordRefused(f"steps[{i}].source must be a name of 1 to {MAX_SOURCE_CHARS} characters",
                                RefusalReason.STEPS)
        version = step.get("version")
        version = None if version in (None, NO_DRAFTER) else parse_version(version, f"steps[{i}].version",
                                                                            RefusalReason.STEPS)
        steps.append(StepRecord(position, drafts, accepted, version, source))
    features = None if raw.get("features") is None else validate_features(raw["features"], total, feature_size)
    return TrajectoryRecord(
        record_id=str(_name(raw, "record_id")), server_id=str(_name(raw, "server_id")), prompt_ids=prompt,
        output_ids=output, steps=steps, temperature=_number(raw, "temperature", 0.0),
        top_p=_number(raw, "top_p", 0.0, 1.0, low_open=True), created=_number(raw, "created"),
        finished=_number(raw, "finished"), domain=_name(raw, "domain", optional=True), features=features)


@dataclass
class AcceptanceCounts:
    """Drafts proposed and accepted, target verification passes and tokens emitted."""

    drafts: int = 0
    accepted: int = 0
    passes: int = 0
    emitted: int = 0

    FIELDS = ("drafts", "accepted", "passes", "emitted")

    def add(self, other: AcceptanceCounts) -> None:
        self.drafts += other.drafts
        self.accepted += other.accepted
        self.passes += other.passes
        self.emitted += other.emitted

    def minus(self, earlier: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(self.drafts - earlier.drafts, self.accepted - earlier.accepted,
                                self.passes - earlier.passes, self.emitted - earlier.emitted)

    def covers(self, earlier: AcceptanceCounts) -> bool:
        """Every counter at least `earlier`'s: cumulative counts that did not restart from zero."""
        return all(getattr(self, name) >= getattr(earlier, name) for name in self.FIELDS)

    @property
    def is_empty(self) -> bool:
        return not any(getattr(self, name) for name in self.FIELDS)

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / proposed drafts, None before any draft."""
        return self.accepted / self.drafts if self.drafts else None

    @property
    def accept_length(self) -> float | None:
        """Tokens emitted per target pass, None before any pass."""
        return self.emitted / self.passes if self.passes else None

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_dict(cls, raw: Any, where: str = "counts") -> AcceptanceCounts:
        """Untrusted counts (a JSON object of non-negative integers; missing ones are 0)."""
        if not isinstance(raw, Mapping):
            raise RecordRefused(f"{where} must be an object of counters {list(cls.FIELDS)}", RefusalReason.REPORT)
        values = {}
        for name in cls.FIELDS:
            value = raw.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RecordRefused(f"{where}.{name} must be a non-negative integer, got {value!r}",
                                    RefusalReason.REPORT)
            values[name] = value
        return cls(**values)


@dataclass
class AcceptanceReport:
    """Cumulative acceptance counts from one server for one traffic domain: per drafter version, of
    the learned drafter's own drafts only (what the canary judges a version by), and per drafting
    source kind (`source_kind`) over all versions (what operators see next to it)."""

    server_id: str
    time: float
    domain: str
    versions: dict[int, AcceptanceCounts]
    sources: dict[str, AcceptanceCounts] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"server_id": self.server_id, "time": self.time, "domain": self.domain,
                "versions": {str(version): counts.as_dict() for version, counts in self.versions.items()},
                "sources": {source: counts.as_dict() for source, counts in self.sources.items()}}


def reports_from(server_id: str, totals: Mapping[tuple[int | None, str, str], AcceptanceCounts],
                 at: float | None = None) -> list[AcceptanceReport]:
    """One report per domain from counts keyed by (version, source kind, domain): `versions` sums
    the learned drafter's own steps per version, `sources` every step per source kind."""
    reports: dict[str, AcceptanceReport] = {}
    now = clock.time() if at is None else at
    for (version, source, domain), counts in totals.items():
        report = reports.setdefault(domain, AcceptanceReport(server_id, now, domain, {}))
        report.sources.setdefault(source, AcceptanceCounts()).add(counts)
        if source == LEARNED_SOURCE and version is not None:
            report.versions.setdefault(version, AcceptanceCounts()).add(counts)
    return list(reports.values())


def validate_report(raw: Any) -> AcceptanceReport:
    """Check an untrusted report dict; raises RecordRefused naming what is wrong."""
    if not isinstance(raw, dict):
        raise RecordRefused("a report must be a JSON object", RefusalReason.REPORT)
    versions = raw.get("versions")
    if not isinstance(versions, dict):
        raise RecordRefused("a report needs a `versions` object", RefusalReason.REPORT)
    sources = raw.get("sources", {})  # servers from before sources were reported send none
    if not isinstance(sources, dict) or not all(isinstance(s, str) and 0 < len(s) <= MAX_SOURCE_CHARS
                                                for s in sources):
        raise RecordRefused(f"a report's `sources` must map names of 1 to {MAX_SOURCE_CHARS} characters to counts",
                            RefusalReason.REPORT)
    if len(versions) > MAX_REPORT_ENTRIES or len(sources) > MAX_REPORT_ENTRIES:
        raise RecordRefused(f"a report names at most {MAX_REPORT_ENTRIES} versions and sources each",
                            RefusalReason.REPORT)
    try:
        at = None if raw.get("time") is None else _number(raw, "time")
        server_id, domain = _name(raw, "server_id", optional=True), _name(raw, "domain", optional=True)
    except RecordRefused as error:
        raise RecordRefused(f"report: {error}", RefusalReason.REPORT) from None
    return AcceptanceReport(
        server_id=server_id or "?", time=at if at is not None else clock.time(), domain=domain or "default",
        versions={parse_version(version, f"versions[{version!r}]", RefusalReason.REPORT):
                  AcceptanceCounts.from_dict(counts, f"versions[{version!r}]") for version, counts in versions.items()},
        sources={source: AcceptanceCounts.from_dict(counts, f"sources[{source!r}]")
                 for source, counts in sources.items()})

